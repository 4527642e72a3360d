"""The decoding step: one speculative step advances every request of a batch; a single request is a batch of one.

Glossary (algorithms.md has the rules):

- **law**: a distribution ``(V,)`` after the request's sampling transform: ``p`` the target's, ``q`` the draft's.
- **root**: the last committed token of a request; each step drafts a tree of its continuations and one target pass
  gives the target's law at the root and at every tree node.
- **trunk** and **branch**: a (K, L1, L2)-delayed tree is a single path of L1 tokens (the trunk), then K branches of
  L2 tokens from where the trunk ends; a per-node policy may end the trunk early, while it is drafted.
- **pending**: committed tokens a model has not run yet: a new request's prompt (both models), then the step's extra
  token (the target), or the extra token after an accepted leaf the draft never ran (the draft).
- **commit**: keep a request's root and accepted path in a model's cache, drop the rest of its tree.

A step, for every request at once: (1) a request that has just joined and whose policy reads root features: its prompt
before the root through the target; (2) **one draft pass** over every request's pending tokens, which gives q at each
root; (3) each policy's action at its root (the requests whose policy shares the budget decided together,
decode/policies/budget.py); (4) each tree drafted by the single rule :func:`~decode.drafting.delayed.delayed_tree_steps`
from the request's own random source, the draft calls of all growing trees run as **one draft pass per level**, a
per-node policy asked at each trunk node as it grows; (5) **one target pass** over every request's pending tokens and
tree; (6) each request's verifier on its own tree, with its own p and exactly the q each draft token was drawn from; (7)
commit, and each request's step closed (its tokens cut at EOS or its budget, its policy told the outcome). Requests join
and leave between steps.

**Layout.** Each model's cache holds every request as a sequence of its own (:mod:`decode.models.shared_cache`):
one KV store, disjoint trees, positions per sequence, each request attending over its own slots alone
(decode/models/attention.py): its logits are the same bits alone and in a batch, so a seeded request gives the same
tokens (but for a lone one-row pass, on one-row kernels); its law is the same either way (tests/decode/exact/
test_batch.py, with negative controls). A model with a forward hook (a steered pair) holds one request at a time.

**What a policy may read.** Its request's root (context length, q at the root, room, sampling, root features built
from states of earlier passes, the latency table), the draft's own state at each trunk node while drafting, and the
outcomes of its earlier steps: never the target's outputs of the current step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Generator, Sequence
from typing import cast

import torch

from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.delayed import DraftedTree, TreeDrafting, TrunkNode, delayed_tree_steps
from decode.drafting.sampling import distributions
from decode.drafting.tree import ROOT
from decode.generation import Generation, Job, check_request, cut_at_eos, token_logprobs
from decode.models.cached_lm import CachedLM
from decode.models.loading import check_same_vocab
from decode.models.shared_cache import Block, BlockOutput, SharedCache
from decode.models.slots import block_parents
from decode.policies.base import RootState, StepOutcome
from decode.policies.budget import SharedBudgetPolicy, batch_actions
from decode.policies.features import RootFeatures, root_features
from decode.request_state import Request, State, StepClock, StepReport, prompt_logprobs, remember_previous
from decode.verifiers.base import UnsupportedTreeError, VerifyResult


class BatchDecoder:
    """Decodes a changing batch of requests with one target and one draft (see the module docstring).

    The decoder owns both models' caches while it lives. ``latency``: the table root features read (their pass
    times); a request whose policy reads them is refused without one.
    """

    cache_class = SharedCache  # each model's cache (a test's negative control swaps in a leaking layout)

    def __init__(self, target: CachedLM, draft: CachedLM, eos_token_id: int | None = None,
                 allow_padded_vocab: bool = False, latency: LatencyTable | None = None) -> None:
        self.vocab = check_same_vocab(target.config, draft.config, allow_padded_tail=allow_padded_vocab)
        self.target, self.draft = self.cache_class(target), self.cache_class(draft)
        self.eos_token_id = eos_token_id
        self.latency = latency
        self.context_limit = min(target.context_limit, draft.context_limit)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.pass_tokens = 0  # tokens in the last step's target pass (every pending token and tree node), for metrics

    def join(self, job: Job) -> int:
        """Add a request between steps (checked now; nothing runs): its prompt runs in the next step's passes, its
        last token the first root. Returns its id."""
        check_request(job.prompt_ids, job.max_new_tokens, self.vocab, self.context_limit)
        self.target.check_owned()
        self.draft.check_owned()
        policy = job.policy.start(job.sampling)
        if policy.needs_root_features and self.latency is None:
            raise ValueError(f"the policy '{policy.name}' reads root features, which need the decoder's latency "
                             "table: open the decoder with decode.session, or give it one")
        target_seq = self.target.add()
        try:
            draft_seq = self.draft.add()
        except ValueError:
            self.target.drop(target_seq)
            raise
        request = Request(job, policy, target_seq, draft_seq, time.perf_counter())
        prompt = [int(t) for t in job.prompt_ids]
        request.target_pending, request.draft_pending = list(prompt), list(prompt)
        rid = next(self._ids)
        self.requests[rid] = request
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
        clock = StepClock([r.stats for r in live.values()])
        self._run_prefixes(live)
        clock.lap("prefill")
        q_roots = self._draft_roots(live)
        clock.lap("draft")
        actions = self._choose_all(live, q_roots)
        clock.lap("policy")
        decided = {rid: len(r.stats.network_seconds) for rid, r in live.items()}
        drafted = self._draft_trees(live, q_roots, actions)
        self._check_trees(live, drafted)
        clock.lap("draft")  # per-node decisions ran inside the drafting: their time is the policy's
        clock.move("draft", "policy", sum(sum(r.stats.network_seconds[decided[rid]:]) for rid, r in live.items()))
        outs = self._target_pass(live, drafted)
        clock.lap("target")
        laws = {rid: distributions(outs[rid].logits, r.job.sampling) for rid, r in live.items()}  # p, (n, V) each
        results = self._verify(live, drafted, laws)
        clock.lap("verify")
        self._commit(live, drafted, outs, results)
        for rid, r in live.items():
            if r.features:
                remember_previous(r, drafted[rid], results[rid], laws[rid], outs[rid].hidden, q_roots[rid])
        reports = {rid: self._close_step(rid, r, actions[rid], drafted[rid], results[rid], laws[rid], clock.elapsed)
                   for rid, r in live.items()}
        clock.lap("other")
        return reports

    def _run_prefixes(self, live: dict[int, Request]) -> None:
        """A new request whose policy reads root features needs the target's state at the token before its first
        root before it chooses, and a steered draft reads it at its root's pass: such a request's prompt before the
        root runs through the target now (one pass for every such request), and for a steered draft through the
        draft too (its root's pass then steered, as at every later root). Every other prompt runs beside the trees in
        the step's target pass: a pass of its own would cost a whole pass's weight streaming (a lone request's time to
        its first token), where the prompt's rows add little to a pass that streams the weights anyway."""
        steered = self.draft.lm.hook is not None  # a steered pair holds one request
        fresh = {rid: r for rid, r in live.items() if (r.features or steered) and len(r.target_pending) > 1}
        if not fresh:
            return
        every_row = any(r.job.prompt_logprobs is not None for r in fresh.values())
        outs = self.target.settle({r.target_seq: r.target_pending[:-1] for r in fresh.values()}, output_hidden=True,
                                  last=None if every_row else 1)
        for r, out in zip(fresh.values(), outs, strict=True):
            r.target_prev = _state(out, -1, r) if r.features else None
            if r.job.prompt_logprobs is not None:  # row i predicts prompt token i + 1, the root included
                r.prompt_logprobs = prompt_logprobs(out.logits, r.target_pending[1:], r.job.prompt_logprobs)
            r.target_pending = r.target_pending[-1:]
        if not steered:
            return
        outs = self.draft.settle({r.draft_seq: r.draft_pending[:-1] for r in fresh.values()}, output_hidden=True,
                                 last=1)
        for r, out in zip(fresh.values(), outs, strict=True):
            r.draft_prev = _state(out, -1, r) if r.features else None
            r.draft_pending = r.draft_pending[-1:]
            r.stats.draft_calls += 1

    def _draft_roots(self, live: dict[int, Request]) -> dict[int, torch.Tensor]:
        """q after each request's root ``(V,)``: one draft pass over every request's pending tokens (a request that
        has none ran its root before)."""
        pending = {rid: r for rid, r in live.items() if r.draft_pending}
        if pending:
            hidden = any(r.draft_hidden for r in pending.values())
            last = 2 if any(r.features for r in pending.values()) else 1  # root features read the token before too
            outs = self.draft.settle({r.draft_seq: r.draft_pending for r in pending.values()}, output_hidden=hidden,
                                     last=last)
            for r, out in zip(pending.values(), outs, strict=True):
                ran, r.draft_pending, r.draft_root_logits = r.draft_pending, [], out.logits[-1]
                r.draft_root_hidden = _hidden(out)[-1] if r.draft_hidden else None
                if r.features and len(ran) > 1:  # a prompt, or an accepted leaf the draft had not run before the root
                    r.draft_prev = _state(out, -2, r)
                r.stats.draft_calls += 1
        return {rid: distributions(r.root_logits, r.job.sampling) for rid, r in live.items()}

    def _choose_all(self, live: dict[int, Request], q_roots: dict[int, torch.Tensor]) -> dict[int, Action]:
        """Every request's action: each policy's own, except those that share the budget, decided together beside
        the others' trees (decode/policies/budget.py); each refused before any tree is drafted when its verifier is
        not lossless on it (the batch is then as it was)."""
        shared = [rid for rid, r in live.items() if r.policy.shares_budget]
        actions = {rid: self._choose(r, q_roots[rid]) for rid, r in live.items() if rid not in shared}
        if shared:
            policies = [cast(SharedBudgetPolicy, live[rid].policy) for rid in shared]  # the one kind that shares
            chains = batch_actions(policies, [self._room(live[rid]) for rid in shared],
                                   [r.context_length for r in live.values()], list(actions.values()))
            actions.update(zip(shared, chains, strict=True))
        for rid, r in live.items():
            r.job.verifier.check_action(actions[rid])
        return {rid: actions[rid] for rid in live}

    def _room(self, r: Request) -> int:
        """The deepest tree that fits the request's context window and its token budget."""
        return min(self.context_limit - r.context_length - 1, r.budget - 1)

    def _choose(self, r: Request, q_root: torch.Tensor) -> Action:
        """The request's action at its root, clipped to its room."""
        room = self._room(r)
        features = self._root_features(r, q_root) if r.features else None
        root = RootState(r.context_length, q_root, room, r.job.sampling, features, self.latency)
        return r.policy.choose(root).clipped(max(room, 0))

    def _root_features(self, r: Request, q_root: torch.Tensor) -> RootFeatures:
        """The request's root features; a one-token prompt's first root has no previous token: zero states and a
        uniform law stand for it."""
        assert self.latency is not None and r.draft_root_hidden is not None  # join() and draft_hidden saw to both
        uniform = torch.full_like(q_root, 1.0 / q_root.numel())
        target_hidden, p_prev = r.target_prev or (torch.zeros(self.target.lm.config.hidden_size), uniform)
        draft_hidden, q_prev = r.draft_prev or (torch.zeros_like(r.draft_root_hidden), uniform)
        return root_features(target_hidden, draft_hidden, r.draft_root_hidden, p_prev, q_prev, q_root,
                             r.context_length, r.job.sampling, self.latency.pass_times)

    def _draft_trees(self, live: dict[int, Request], q_roots: dict[int, torch.Tensor],
                     actions: dict[int, Action]) -> dict[int, DraftedTree]:
        """Each request's tree by the one drafting rule and from its own source; the draft calls of every tree that
        still grows run as one forward per level."""
        states: dict[int, TreeDrafting] = {}
        steps: dict[int, Generator[list[int], None, DraftedTree]] = {}
        asked: dict[int, list[int]] = {}
        done: dict[int, DraftedTree] = {}
        for rid, r in live.items():
            states[rid] = TreeDrafting(self.draft.lm, q_roots[rid], r.job.sampling, r.job.rng, r.draft_hidden,
                                       root_slot=self.draft.tip(r.draft_seq))
            steps[rid] = delayed_tree_steps(states[rid], actions[rid], r.without_replacement, _halting(r),
                                            r.draft_root_hidden)
            _advance(rid, steps[rid], asked, done)
        while asked:
            self._expand(live, states, asked)
            for rid in list(asked):
                _advance(rid, steps[rid], asked, done)
        for rid, r in live.items():
            r.stats.draft_calls += done[rid].draft_calls
        return done

    def _expand(self, live: dict[int, Request], states: dict[int, TreeDrafting],
                asked: dict[int, list[int]]) -> None:
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

    def _check_trees(self, live: dict[int, Request], drafted: dict[int, DraftedTree]) -> None:
        """A per-node policy may cut a trunk into a tree its verifier refuses: drop every speculative slot (the batch
        is then as before the drafting) and say so."""
        for rid, r in live.items():
            try:
                r.job.verifier.check_tree(drafted[rid].tree)
            except UnsupportedTreeError as err:
                self.draft.commit({})
                raise ValueError(f"request {rid} with verifier '{r.job.verifier.name}': {err}") from err

    def _target_pass(self, live: dict[int, Request], drafted: dict[int, DraftedTree]) -> dict[int, BlockOutput]:
        """One target forward over every request's pending tokens (its root last: a new request's whole prompt)
        and tree nodes; each block's output starts at its root (node u at row u, ``base`` the root's slot). A new
        prompt's other rows are read only where its job asks for their log-probabilities."""
        blocks, skip = [], []
        for rid, r in live.items():
            tree, n = drafted[rid].tree, len(r.target_pending)
            parents = [None] + [-j for j in range(1, n)] + [-(tree.parents[v] + n) for v in range(1, tree.num_nodes)]
            blocks.append(Block(r.target_seq, r.target_pending + list(tree.tokens[1:]), parents))
            skip.append(0 if r.job.prompt_logprobs is not None else n - 1)
        self.pass_tokens = sum(len(block.tokens) for block in blocks)
        hidden = any(r.features for r in live.values())
        outs = dict(zip(live, self.target.run(blocks, output_hidden=hidden, skip=skip), strict=True))
        for (rid, r), rows in zip(live.items(), skip, strict=True):
            prompt = len(r.target_pending) - 1 - rows  # rows before the root this block returned
            if prompt > 0 and r.job.prompt_logprobs is not None:  # rows before the root come back only when asked
                r.prompt_logprobs = prompt_logprobs(outs[rid].logits[:prompt], r.target_pending[1:],
                                                     r.job.prompt_logprobs)
                out = outs[rid]
                outs[rid] = BlockOutput(out.logits[prompt:], None if out.hidden is None else out.hidden[prompt:],
                                        out.base + prompt)
        return outs

    def _verify(self, live: dict[int, Request], drafted: dict[int, DraftedTree],
                laws: dict[int, torch.Tensor]) -> dict[int, VerifyResult]:
        """Each request's verifier on its own tree, with its own p ``(n, V)`` and q ``(n, V)``: the one call site of
        a verifier in decoding."""
        return {rid: r.job.verifier.verify(drafted[rid].tree, laws[rid], self._q(rid, drafted).to(laws[rid].dtype),
                                           r.job.rng)
                for rid, r in live.items()}

    def _q(self, rid: int, drafted: dict[int, DraftedTree]) -> torch.Tensor:
        """The q request ``rid``'s verifier reads ``(n, V)``: the laws its own draft tokens were drawn from."""
        return drafted[rid].q

    def _commit(self, live: dict[int, Request], drafted: dict[int, DraftedTree], outs: dict[int, BlockOutput],
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

    def _close_step(self, rid: int, r: Request, action: Action, drafted: DraftedTree, result: VerifyResult,
                    p: torch.Tensor, seconds: float) -> StepReport:
        """Cut the step's tokens at EOS or the budget, record them, tell the policy; end the request if done.
        ``p`` ``(n, V)``: the target's laws at the tree's nodes (the new tokens' log-probabilities, where asked)."""
        context_length = r.context_length
        eos = self.eos_token_id if r.job.stop_at_eos else None
        kept, hit_eos = cut_at_eos(list(result.emitted), r.budget, eos)
        r.tokens.extend(kept)
        action = _drafted_action(action, drafted) if r.policy.decides_per_node else action
        if r.stats.steps == 0:  # its first tokens: a TPOT leaves this step out, as it leaves out a prompt
            r.stats.first_token_seconds = time.perf_counter() - r.started
        r.stats.record_step(str(action), drafted.tree.max_depth, result.accepted, len(kept))
        r.policy.observe(StepOutcome(action, result.accepted, len(result.emitted), context_length, seconds))
        report = StepReport(kept, prompt_logprobs=r.prompt_logprobs)
        r.prompt_logprobs = []
        if r.job.logprobs is not None:  # token j of the step was drawn at node path[j - 1] (the root for j = 0)
            rows = [ROOT, *result.path][: len(kept)]
            report.logprobs = token_logprobs(p[rows].log(), kept, r.job.logprobs)
        if hit_eos or r.budget == 0:
            report.finished = self._end(rid, "eos" if hit_eos else "length")
        return report

    def _end(self, rid: int, stopped_by: str) -> Generation:
        r = self.requests.pop(rid)
        self.target.drop(r.target_seq)
        self.draft.drop(r.draft_seq)
        r.stats.wall_seconds = time.perf_counter() - r.started
        r.stats.network_seconds.extend(r.policy.network_seconds())
        return Generation(r.tokens, r.stats, stopped_by)


def _hidden(out: BlockOutput) -> torch.Tensor:
    """A block's hidden rows, from a pass that was asked for them."""
    if out.hidden is None:
        raise ValueError("the pass returned no hidden states (run it with output_hidden=True)")
    return out.hidden


def _state(out: BlockOutput, row: int, r: Request) -> State:
    """A model's (state, law) at ``row`` of a block that ran with hidden states, the law by ``r``'s sampling."""
    return _hidden(out)[row], distributions(out.logits[row], r.job.sampling)


def _halting(r: Request) -> Callable[[TrunkNode], bool] | None:
    """The request's per-node decision while its trunk grows, each decision's wall time in its statistics'
    ``network_seconds`` (None for a policy that decides at the root only)."""
    if not r.policy.decides_per_node:
        return None

    def halts(node: TrunkNode) -> bool:
        start = time.perf_counter()
        halt = r.policy.halts(node)
        r.stats.network_seconds.append(time.perf_counter() - start)
        return halt

    return halts


def _advance(rid: int, steps: Generator[list[int], None, DraftedTree], asked: dict[int, list[int]],
             done: dict[int, DraftedTree]) -> None:
    """Run a tree's drafting rule to its next draft call (its nodes into ``asked``) or its end (``done``)."""
    asked.pop(rid, None)
    try:
        asked[rid] = next(steps)
    except StopIteration as end:
        done[rid] = end.value


def _drafted_action(widest: Action, drafted: DraftedTree) -> Action:
    """The action a per-node policy drafted: its widest tree with the trunk cut where it halted (a single path there
    when the widest tree has no branches)."""
    depth = drafted.trunk_depth
    if depth is None or depth == widest.l1:
        return widest
    return Action(1, depth, 0) if widest.is_single_path else Action(widest.k, depth, widest.l2)
