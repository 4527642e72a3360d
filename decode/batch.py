"""Batched speculative decoding: one step advances every request of a batch, each exactly the target's law.

On a CPU a target pass over n tokens costs little more than one over a single token while the weights stream from
memory, so requests that decode together cost about one request's passes. A step here runs, for all requests at
once: one draft pass over their pending tokens, one draft pass per drafting level over the nodes every tree asks for,
and **one target pass over every request's root and tree**; then each request's own verifier accepts a path of its
own tree. Requests join and leave between steps (:meth:`BatchDecoder.join`, :meth:`BatchDecoder.leave`; one ends by
itself at EOS or its token budget). A request that joins runs its prompt inside the next step's passes (its pending
tokens), not in passes of its own that every other request would wait for.

**Layout: one KV sequence, disjoint trees, a block-diagonal mask** (:mod:`decode.models.shared_cache`). Every request
is a sequence of its own inside each model's one cache, with its own positions; a token attends to its own request's
committed prefix and its own tree ancestors only. This was chosen over a batch dimension with padding because it
reuses the tree cache as it is: the same key/value stores (HF's ``DynamicCache``, the fast draft's tensors), the same
additive masks, and the commit that moves kept slots after the settled ones, while a batch dimension would need every
request's cache padded to the longest and a per-row rollback that neither store has (HF's crop is batch-wide). Its
price: each query's attention runs over the other requests' slots too (masked), quadratic in the batch size for the
attention alone; and a request that leaves leaves dead slots, compacted once they are as many as the live ones. On
the Zen 5 (Qwen pair, one thread) a pass beside 4 requests of 256 tokens cost 1.16-1.25x the one-sequence pass of as
many tokens for the target and, before the fast draft took torch's flash attention, 1.5x for the draft; at 64 tokens
1.03-1.2x. The machine's latency table carries these ratios for a batch (``LatencyTable.batch``, measured once
through this layout's own passes), which is what the shared budget prices a step with. The target's attention reads
the cache's grouped-query key/value heads unrepeated (:mod:`decode.models.attention`; transformers' sdpa copied them
per query head under a mask): in process, 4 requests' steps took 0.99x the time at the serve bench's contexts and
0.95x at 300-token prompts (target pass 0.985x and 0.93x), the same tokens.

**A step's time** (same machine, 4 requests, static (1,3,0) chains, contexts 18-70, a 300 ms step): the target pass
~195-205 ms, three draft passes ~93 ms (105 before the fast draft's flash attention; the requests' pending tokens, then
two levels), everything else ~10 ms (verifiers 3.3, commits 0.8, slot plans 0.3, the rest bookkeeping and the q of
each root): the passes are the step.

**Exactness.** Each request keeps its own prompt, sampling settings, random source, verifier and policy. Its tree is
drafted by the single loop's own rule (:func:`~decode.drafting.delayed.delayed_tree_steps`, the generator behind
:func:`~decode.drafting.delayed.draft_delayed_tree`), from its own source, and its verifier reads exactly the q each of
its draft tokens was drawn from and the target's p through its own sampling settings. The mask makes every row of
another request invisible, so a request's laws are those of its context alone and its output is the target's law
whatever the others do (tests/decode/exact/test_batch.py, by exact enumeration, with negative controls). Its floats
are not bit for bit those of a request decoded alone: its rows are computed inside another block shape, which changes
summation order (~1e-7), so a seeded request gives the same tokens alone and in a batch except where a draw falls
within rounding of a boundary; its law is the same either way.

Policies: any that reads no root features (static trees, the adaptive schedule, the per-node entropy stop and
expanders on the draft's own state, which run inside the shared drafting rule); a policy that reads root features (a
selector) is refused at join, as is a steered pair. ``ddte serve --max-batch N`` schedules requests onto a
decoder opened by decode/session.py (``batch=True``). A policy that ``shares_budget`` (``VERIFIER@shared``) has its
chain decided together with the other such requests' each step, from what each knew before it
(:func:`decode.policies.budget.batch_actions`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode.drafting.actions import Action
from decode.drafting.delayed import DraftedTree, TreeDrafting, TrunkNode, delayed_tree_steps
from decode.drafting.rng import RandomSource
from decode.drafting.sampling import SamplingConfig, distributions
from decode.drafting.tree import ROOT, Regime
from decode.engine import Generation, check_request, cut_at_eos
from decode.models.cached_lm import CachedLM
from decode.models.loading import check_same_vocab
from decode.models.shared_cache import Block, BlockOutput, SharedCache
from decode.models.slots import block_parents
from decode.policies.base import Policy, RootState, StepOutcome
from decode.policies.budget import batch_actions
from decode.stats import GenerationStats
from decode.verifiers.base import UnsupportedTreeError, Verifier, VerifyResult


@dataclass(frozen=True)
class Job:
    """A request to decode in a batch: everything that is its own."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    policy: Policy
    rng: RandomSource
    sampling: SamplingConfig
    verifier: Verifier


@dataclass
class StepReport:
    """One request's part of a step: the tokens it kept (cut at EOS or its budget) and, when it ended in this step
    and left the batch, its :class:`~decode.engine.Generation`."""

    tokens: list[int]
    finished: Generation | None = None


@dataclass
class _Live:
    """A request between steps. ``target_pending``: tokens the target has not run, its root last (the target runs
    them in the step's tree pass: a new request's whole prompt, then the root alone); ``draft_pending``: tokens the
    draft has not run (a new request's prompt; the root, after an accepted leaf); ``draft_root_logits``
    ``(V,)`` and ``draft_root_hidden`` ``(H,)``: the draft at the root, once it ran it."""

    job: Job
    policy: Policy
    target_seq: int
    draft_seq: int
    started: float
    stats: GenerationStats = field(default_factory=GenerationStats)
    tokens: list[int] = field(default_factory=list)
    target_pending: list[int] = field(default_factory=list)
    draft_pending: list[int] = field(default_factory=list)
    draft_root_logits: torch.Tensor | None = None
    draft_root_hidden: torch.Tensor | None = None

    @property
    def context_length(self) -> int:
        return len(self.job.prompt_ids) + len(self.tokens)

    @property
    def budget(self) -> int:
        return self.job.max_new_tokens - len(self.tokens)

    @property
    def draft_hidden(self) -> bool:
        return self.policy.needs_draft_hidden

    @property
    def without_replacement(self) -> bool:
        return self.job.verifier.draft_regime == Regime.WITHOUT_REPLACEMENT


class BatchDecoder:
    """Decodes a changing batch of requests with one target and one draft (see the module docstring).

    The decoder owns both models' caches while it lives (each holds every request as a sequence of its own).
    """

    cache_class = SharedCache  # each model's cache (a test's negative control swaps in a leaking layout)

    def __init__(self, target: CachedLM, draft: CachedLM, eos_token_id: int | None = None,
                 allow_padded_vocab: bool = False) -> None:
        self.vocab = check_same_vocab(target.config, draft.config, allow_padded_tail=allow_padded_vocab)
        self.target, self.draft = self.cache_class(target), self.cache_class(draft)
        self.eos_token_id = eos_token_id
        self.context_limit = min(target.context_limit, draft.context_limit)
        self.requests: dict[int, _Live] = {}
        self._ids = itertools.count()
        self.pass_tokens = 0  # tokens in the last step's shared target pass (every root and tree node), for metrics

    def join(self, job: Job) -> int:
        """Add a request between steps (checked now; nothing runs): its prompt runs in the next step's passes, the
        draft's over every request's pending tokens and the target's beside the others' trees, its last token the
        first root. A prompt run apart would hold every other request for a pass of its own. Returns its id."""
        check_request(job.prompt_ids, job.max_new_tokens, self.vocab, self.context_limit)
        self.target.check_owned()
        self.draft.check_owned()
        policy = job.policy.start(job.sampling)
        if policy.needs_root_features:
            raise ValueError(f"the policy '{policy.name}' reads root features, which a batch does not compute")
        live = _Live(job, policy, self.target.add(), self.draft.add(), time.perf_counter())
        prompt = [int(t) for t in job.prompt_ids]
        live.target_pending, live.draft_pending = list(prompt), list(prompt)
        rid = next(self._ids)
        self.requests[rid] = live
        return rid

    def leave(self, rid: int) -> Generation:
        """End a request between steps (a client gone, a stop string); its generation so far."""
        if rid not in self.requests:
            raise ValueError(f"no request {rid} in the batch")
        return self._end(rid, "caller")

    def generate(self, jobs: Sequence[Job]) -> list[Generation]:
        """Decode ``jobs`` together until each ends; their generations in order."""
        ids = [self.join(job) for job in jobs]
        done: dict[int, Generation] = {}
        while any(rid not in done for rid in ids):
            done.update({rid: r.finished for rid, r in self.step().items() if r.finished is not None})
        return [done[rid] for rid in ids]

    # --- the step -------------------------------------------------------------------------------------------
    def step(self) -> dict[int, StepReport]:
        """One speculative step of every request in the batch; each request's report by id (empty: no request)."""
        live = dict(self.requests)
        if not live:
            return {}
        clock = _Clock([r.stats for r in live.values()])
        q_roots = self._draft_roots(live)
        clock.lap("draft")
        actions = self._choose_all(live, q_roots)
        clock.lap("policy")
        drafted = self._draft_trees(live, q_roots, actions)
        self._check_trees(live, drafted)
        clock.lap("draft")
        outs = self._target_pass(live, drafted)
        clock.lap("target")
        results = self._verify(live, drafted, outs)
        clock.lap("verify")
        self._commit(live, drafted, outs, results)
        reports = {rid: self._close_step(rid, r, actions[rid], drafted[rid], results[rid], clock.elapsed)
                   for rid, r in live.items()}
        clock.lap("other")
        return reports

    def _draft_roots(self, live: dict[int, _Live]) -> dict[int, torch.Tensor]:
        """q after each request's root ``(V,)``: one draft pass over every request's pending tokens (a request that
        has none ran its root before)."""
        pending = {rid: r for rid, r in live.items() if r.draft_pending}
        if pending:
            hidden = any(r.draft_hidden for r in pending.values())
            outs = self.draft.settle({r.draft_seq: r.draft_pending for r in pending.values()}, output_hidden=hidden,
                                     last=1)
            for r, out in zip(pending.values(), outs, strict=True):
                r.draft_pending, r.draft_root_logits = [], out.logits[-1]
                r.draft_root_hidden = out.hidden[-1] if r.draft_hidden else None
                r.stats.draft_calls += 1
        return {rid: distributions(r.draft_root_logits, r.job.sampling) for rid, r in live.items()}

    def _choose_all(self, live: dict[int, _Live], q_roots: dict[int, torch.Tensor]) -> dict[int, Action]:
        """Every request's action: each policy's own, except those that share the budget, decided together beside
        the others' trees (decode/policies/budget.py); each refused before any tree is drafted when its verifier is
        not lossless on it (the batch is then as it was)."""
        shared = [rid for rid, r in live.items() if r.policy.shares_budget]
        actions = {rid: self._choose(r, q_roots[rid]) for rid, r in live.items() if rid not in shared}
        if shared:
            chains = batch_actions([live[rid].policy for rid in shared], [self._room(live[rid]) for rid in shared],
                                   [r.context_length for r in live.values()], list(actions.values()))
            actions.update(zip(shared, chains, strict=True))
        for rid, r in live.items():
            r.job.verifier.check_action(actions[rid])
        return {rid: actions[rid] for rid in live}

    def _room(self, r: _Live) -> int:
        """The deepest tree that fits the request's context window and its token budget."""
        return min(self.context_limit - r.context_length - 1, r.budget - 1)

    def _choose(self, r: _Live, q_root: torch.Tensor) -> Action:
        """The request's action from its root, as the single loop clips it."""
        room = self._room(r)
        return r.policy.choose(RootState(r.context_length, q_root, room, r.job.sampling)).clipped(max(room, 0))

    def _draft_trees(self, live: dict[int, _Live], q_roots: dict[int, torch.Tensor],
                     actions: dict[int, Action]) -> dict[int, DraftedTree]:
        """Each request's tree by the single loop's rule and from its own source; the draft calls of every tree that
        still grows run as one forward per level."""
        states, steps, asked, done = {}, {}, {}, {}
        for rid, r in live.items():
            states[rid] = TreeDrafting(self.draft.lm, q_roots[rid], r.job.sampling, r.job.rng, r.draft_hidden,
                                       root_slot=self.draft.tip(r.draft_seq))
            halting = _halting(r)
            steps[rid] = delayed_tree_steps(states[rid], actions[rid], r.without_replacement, halting,
                                            r.draft_root_hidden)
            _advance(rid, steps[rid], asked, done)
        while asked:
            self._expand(live, states, asked)
            for rid in list(asked):
                _advance(rid, steps[rid], asked, done)
        for rid, r in live.items():
            r.stats.draft_calls += done[rid].draft_calls
        return done

    def _expand(self, live: dict[int, _Live], states: dict[int, TreeDrafting], asked: dict[int, list[int]]) -> None:
        """One draft forward over the nodes each growing tree asked for; each tree takes its rows' laws."""
        blocks = [Block(live[rid].draft_seq, [states[rid].builder.tokens[v] for v in nodes],
                        block_parents(nodes, states[rid].builder.parents, states[rid].slots))
                  for rid, nodes in asked.items()]
        hidden = any(states[rid].output_hidden for rid in asked)
        on_support = next(iter(states.values())).support is not None  # one draft: one support for all
        outs = self.draft.run(blocks, output_hidden=hidden, on_support=on_support)
        for (rid, nodes), out in zip(asked.items(), outs, strict=True):
            states[rid].slots.update({v: out.base + i for i, v in enumerate(nodes)})
            states[rid].absorb(nodes, out.logits, out.hidden)

    def _check_trees(self, live: dict[int, _Live], drafted: dict[int, DraftedTree]) -> None:
        """A per-node policy may cut a trunk into a tree its verifier refuses: drop every speculative slot (the batch
        is then as before the drafting) and say so."""
        for rid, r in live.items():
            try:
                r.job.verifier.check_tree(drafted[rid].tree)
            except UnsupportedTreeError as err:
                self.draft.commit({})
                raise ValueError(f"request {rid} with verifier '{r.job.verifier.name}': {err}") from err

    def _target_pass(self, live: dict[int, _Live], drafted: dict[int, DraftedTree]) -> dict[int, BlockOutput]:
        """One target forward over every request's pending tokens (its root last: a new request's whole prompt)
        and tree nodes; each block's output starts at its root (node u at row u, ``base`` the root's slot)."""
        blocks, skip = [], []
        for rid, r in live.items():
            tree, n = drafted[rid].tree, len(r.target_pending)
            parents = [None] + [-j for j in range(1, n)] + [-(tree.parents[v] + n) for v in range(1, tree.num_nodes)]
            blocks.append(Block(r.target_seq, r.target_pending + list(tree.tokens[1:]), parents))
            skip.append(n - 1)
        self.pass_tokens = sum(len(block.tokens) for block in blocks)
        return dict(zip(live, self.target.run(blocks, skip=skip), strict=True))

    def _verify(self, live: dict[int, _Live], drafted: dict[int, DraftedTree],
                outs: dict[int, BlockOutput]) -> dict[int, VerifyResult]:
        """Each request's verifier on its own tree, p through its own sampling and its own q."""
        results = {}
        for rid, r in live.items():
            p = distributions(outs[rid].logits, r.job.sampling)
            results[rid] = r.job.verifier.verify(drafted[rid].tree, p, self._q(rid, drafted).to(p.dtype), r.job.rng)
        return results

    def _q(self, rid: int, drafted: dict[int, DraftedTree]) -> torch.Tensor:
        """The q request ``rid``'s verifier reads ``(n, V)``: the laws its own draft tokens were drawn from."""
        return drafted[rid].q

    def _commit(self, live: dict[int, _Live], drafted: dict[int, DraftedTree], outs: dict[int, BlockOutput],
                results: dict[int, VerifyResult]) -> None:
        """Keep each request's root and accepted path in both caches; queue what each model has not run."""
        target_chains, draft_chains = {}, {}
        for rid, r in live.items():
            tree, slots, result = drafted[rid].tree, drafted[rid].slots, results[rid]
            before_root = range(outs[rid].base - len(r.target_pending) + 1, outs[rid].base)  # a new prompt's slots
            target_chains[r.target_seq] = [*before_root, *(outs[rid].base + u for u in (ROOT, *result.path))]
            ran = [slots[u] for u in result.path if slots[u] >= 0]  # leaves were never run by the draft
            draft_chains[r.draft_seq] = ran
            r.draft_pending = [tree.tokens[u] for u in result.path[len(ran):]] + [result.extra_token]
            r.target_pending = [result.extra_token]
        self.target.commit(target_chains)
        self.draft.commit(draft_chains)

    def _close_step(self, rid: int, r: _Live, action: Action, drafted: DraftedTree, result: VerifyResult,
                    seconds: float) -> StepReport:
        """Cut the step's tokens at EOS or the budget, record them, tell the policy; end the request if done."""
        context_length = r.context_length
        kept, hit_eos = cut_at_eos(list(result.emitted), r.budget, self.eos_token_id)
        r.tokens.extend(kept)
        if r.policy.decides_per_node and drafted.trunk_depth is not None and drafted.trunk_depth < action.l1:
            depth = drafted.trunk_depth  # the trunk halted early: record the tree drafted, as the single loop does
            action = Action(1, depth, 0) if action.is_single_path else Action(action.k, depth, action.l2)
        r.stats.record_step(str(action), drafted.tree.max_depth, result.accepted, len(kept))
        r.policy.observe(StepOutcome(action, result.accepted, len(result.emitted), context_length, seconds))
        if hit_eos or r.budget == 0:
            return StepReport(kept, self._end(rid, "eos" if hit_eos else "length"))
        return StepReport(kept)

    def _end(self, rid: int, stopped_by: str) -> Generation:
        r = self.requests.pop(rid)
        self.target.drop(r.target_seq)
        self.draft.drop(r.draft_seq)
        r.stats.wall_seconds = time.perf_counter() - r.started
        r.stats.network_seconds.extend(r.policy.network_seconds())
        return Generation(r.tokens, r.stats, stopped_by)


def _halting(r: _Live) -> Callable[[TrunkNode], bool] | None:
    """The request's per-node decision while its trunk grows (None for a policy that decides at the root only)."""
    return r.policy.halts if r.policy.decides_per_node else None


def _advance(rid: int, steps, asked: dict[int, list[int]], done: dict[int, DraftedTree]) -> None:
    """Run a tree's drafting rule to its next draft call (its nodes into ``asked``) or its end (``done``)."""
    asked.pop(rid, None)
    try:
        asked[rid] = next(steps)
    except StopIteration as end:
        done[rid] = end.value


class _Clock:
    """Splits a step's wall time into the phases of each request's statistics (each request waited the whole
    shared pass, so every phase counts for every request)."""

    def __init__(self, stats: list[GenerationStats]) -> None:
        self.stats, self.start = stats, time.perf_counter()
        self.last = self.start

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        for stats in self.stats:
            stats.seconds[phase] += now - self.last
        self.last = now
