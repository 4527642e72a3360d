"""The speculative decoding loop: root → policy → draft a delayed tree → one target pass → verify → commit.

Cache discipline. Each model's cache holds a committed prefix of the output. Tokens that are committed but
not yet run are *pending*. The target always has exactly one pending token, the root: the correction or
bonus token of the previous step (the last prompt token at first). Its logits come out of the same tree
pass that verifies the new tree. The draft runs the prompt up to the first root at prefill (:func:`prefill_to_root`,
which the collector shares); after a step its pending tokens are the root plus any accepted leaf (leaves are never
run by the draft). After verification both caches keep the accepted path and drop the rest.

The decoder holds the models and the verifier; everything that belongs to one generation (its sampling settings, the
policy serving it, pending tokens, the previous token's states for root features, statistics) lives in a
:class:`Request` that the steps pass along. Sampling settings come with each call, as in gpt-fast, so one decoder
serves any number of generations, at any temperature, one after another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.delayed import DraftedTree, TrunkNode, draft_delayed_tree
from decode.drafting.rng import RandomSource
from decode.drafting.sampling import SamplingConfig, distributions
from decode.drafting.tree import ROOT, Regime
from decode.models.cached_lm import CachedLM, run_nodes
from decode.models.loading import check_same_vocab
from decode.policies.base import Policy, PolicySource, RootState, StepOutcome
from decode.policies.features import RootFeatures, root_features
from decode.stats import GenerationStats
from decode.verifiers import UnsupportedTreeError, Verifier, VerifyResult

# (final hidden state (H,), distribution after it (V,)) of one model at one position
State = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Generation:
    """One generated sample: the new token ids and the statistics of producing them."""

    tokens: list[int]
    stats: GenerationStats
    stopped_by: str  # "eos", "length", or "caller" (generate's on_step asked to stop)

    def as_dict(self, tokenizer=None) -> dict:
        """The sample as JSON: its tokens, why it stopped, its statistics, and its text when given a tokenizer."""
        record = {"tokens": self.tokens, "stopped_by": self.stopped_by, "stats": self.stats.as_dict()}
        if tokenizer is not None:
            record["text"] = tokenizer.decode(self.tokens)
        return record


@dataclass
class Request:
    """The state of one generation between steps.

    Attributes:
        policy: the runner of this generation (what :meth:`PolicySource.start` returned for its sampling).
        sampling: how this generation turns logits into p and q.
        features: whether the policy reads root features (its declared ``needs_root_features``).
        draft_hidden: whether the draft's hidden states are kept (root features, or a policy that reads the draft's
            state at each trunk node: ``needs_draft_hidden``); nothing else is computed for a policy that reads less.
        target_pending, draft_pending: committed tokens each model has not run yet (see the module docstring).
        target_root_logits: ``(V,)`` after a one-token prompt, whose root the target ran at prefill.
        draft_root_logits: ``(V,)`` the draft's logits at the first root (run at prefill).
        target_prev, draft_prev: each model's state at the token before the root (root features only).
        target_root_hidden, draft_root_hidden: ``(H,)`` states at the root (root features only).
    """

    policy: Policy
    rng: RandomSource
    sampling: SamplingConfig
    features: bool
    draft_hidden: bool = False
    stats: GenerationStats = field(default_factory=GenerationStats)
    target_pending: list[int] = field(default_factory=list)
    draft_pending: list[int] = field(default_factory=list)
    target_root_logits: torch.Tensor | None = None
    draft_root_logits: torch.Tensor | None = None
    target_prev: State | None = None
    draft_prev: State | None = None
    target_root_hidden: torch.Tensor | None = None
    draft_root_hidden: torch.Tensor | None = None

    @classmethod
    def start(cls, policy: PolicySource, rng: RandomSource, sampling: SamplingConfig) -> Request:
        """A new generation at ``sampling``: the policy starts it; what it starts declares whether it reads features."""
        policy = policy.start(sampling)
        return cls(policy, rng, sampling, features=policy.needs_root_features,
                   draft_hidden=policy.needs_root_features or policy.needs_draft_hidden)


class SpeculativeDecoder:
    """Lossless speculative decoding of a target model with a draft model and delayed trees.

    Commands open one through :func:`decode.session.open_session`, which moves the models to this machine's kernels
    first and hands the decoder the latency table its policies read. The decoder never measures one itself: a
    generation whose policy reads root features needs ``latency`` (their pass times), and fails without it.
    """

    def __init__(
        self,
        target: CachedLM,
        draft: CachedLM,
        verifier: Verifier,
        eos_token_id: int | None = None,
        allow_padded_vocab: bool = False,
        latency: LatencyTable | None = None,
    ) -> None:
        self.vocab = check_same_vocab(target.config, draft.config, allow_padded_tail=allow_padded_vocab)
        self.target, self.draft = target, draft
        self.verifier = verifier
        self.eos_token_id = eos_token_id
        self.context_limit = min(target.context_limit, draft.context_limit)
        self.without_replacement = verifier.draft_regime == Regime.WITHOUT_REPLACEMENT
        self.latency = latency  # the pass times root features read; None: no policy here may read them

    # --- the loop -------------------------------------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, policy: PolicySource, rng: RandomSource,
        sampling: SamplingConfig, on_step: Callable[[list[int]], bool] | None = None,
    ) -> Generation:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` at ``sampling`` (stops early at EOS).

        ``policy`` (a policy source) may serve every call: the request runs the runner ``policy.start(sampling)``
        returns. ``on_step``, when given, receives each step's kept tokens as soon as the step ends (a
        server streams them); returning False ends the generation there (``stopped_by`` "caller": a stop string, a
        client gone). Whether to go on may depend on the tokens emitted so far only, which is what keeps a stop
        rule exact (tests/decode/exact/test_on_step.py).
        """
        check_request(prompt_ids, max_new_tokens, self.vocab, self.context_limit)
        request = Request.start(policy, rng, sampling)
        if request.features and self.latency is None:
            raise ValueError(f"the policy '{request.policy.name}' reads root features, which need the decoder's "
                             "latency table: open the decoder with decode.session, or give it one")
        start = time.perf_counter()
        self._prefill(request, prompt_ids)
        request.stats.seconds["prefill"] += time.perf_counter() - start
        out: list[int] = []
        stopped_by = "length"
        while len(out) < max_new_tokens:
            emitted, done = self._step(request, len(prompt_ids) + len(out), max_new_tokens - len(out))
            out.extend(emitted)
            go_on = on_step(emitted) if on_step is not None else True
            if done:
                stopped_by = "eos"
                break
            if not go_on:
                stopped_by = "caller"
                break
        request.stats.wall_seconds = time.perf_counter() - start
        request.stats.network_seconds.extend(request.policy.network_seconds())
        return Generation(out, request.stats, stopped_by)

    def _prefill(self, request: Request, prompt_ids: Sequence[int]) -> None:
        """Run the prompt: the target all but its last token, which becomes the first root (pending); the draft up to
        and including the root (:func:`prefill_to_root`).

        A one-token prompt has nothing to run before the root, so the target runs the root here and its logits are
        kept. With root features on, the last prefix token's states become the "previous token" of the first root.
        """
        prefix, root = list(prompt_ids[:-1]), int(prompt_ids[-1])
        hidden, draft_hidden = request.features, request.draft_hidden
        t_logits, t_hidden = _split(self.target.prefill(prefix or [root], output_hidden=hidden, last=1), hidden)
        d_logits, d_hidden = _split(prefill_to_root(self.draft, prompt_ids, output_hidden=draft_hidden), draft_hidden)
        request.draft_root_logits = d_logits[-1]
        if draft_hidden:
            request.draft_root_hidden = d_hidden[-1]
        if prefix:
            request.target_pending = [root]
            if hidden:
                request.target_prev = (t_hidden[-1], distributions(t_logits[-1], request.sampling))
                request.draft_prev = (d_hidden[-2], distributions(d_logits[-2], request.sampling))
            return
        request.target_root_logits = t_logits[-1]
        if hidden:  # no previous token: zero states and a uniform law
            request.target_root_hidden = t_hidden[-1]
            uniform = torch.full_like(t_logits[-1], 1.0 / t_logits.shape[-1])
            request.target_prev = (torch.zeros_like(t_hidden[-1]), uniform)
            request.draft_prev = (torch.zeros_like(d_hidden[-1]), uniform)

    def _step(self, request: Request, context_length: int, budget: int) -> tuple[list[int], bool]:
        """One speculative step; returns the tokens kept (cut at EOS / the budget) and whether EOS was hit."""
        stats, policy = request.stats, request.policy
        clock = _Clock(stats)
        started = clock.last
        q_root = distributions(self._run_draft_pending(request), request.sampling)
        stats.draft_calls += 1
        clock.lap("draft")
        room = min(self.context_limit - context_length - 1, budget - 1)
        features = self._root_features(request, q_root, context_length) if request.features else None
        root = RootState(context_length, q_root, room, request.sampling, features, self.latency)
        action = policy.choose(root).clipped(max(room, 0))
        clock.lap("policy")
        decided = len(stats.network_seconds)
        drafted = self._draft_tree(request, q_root, action)
        stats.draft_calls += drafted.draft_calls
        clock.lap("draft")
        clock.move("draft", "policy", sum(stats.network_seconds[decided:]))  # per-node decisions: the policy's time
        action = _drafted_action(action, drafted) if request.policy.decides_per_node else action
        logits, target_hidden = _split(self._target_pass(request, drafted), request.features)
        p = distributions(logits, request.sampling)
        clock.lap("target")
        try:
            result = self.verifier.verify(drafted.tree, p, drafted.q.to(p.dtype), request.rng)
        except UnsupportedTreeError as err:
            raise ValueError(f"action {action} with verifier '{self.verifier.name}': {err}") from err
        clock.lap("verify")
        self._commit(request, drafted, result)
        if request.features:
            _remember_previous(request, drafted, result, p, target_hidden, q_root)
        kept, hit_eos = cut_at_eos(list(result.emitted), budget, self.eos_token_id)
        stats.record_step(str(action), drafted.tree.max_depth, result.accepted, len(kept))
        clock.lap("other")
        step_seconds = clock.last - started
        policy.observe(StepOutcome(action, result.accepted, len(result.emitted), context_length, step_seconds))
        clock.lap("policy")
        return kept, hit_eos

    # --- pieces ---------------------------------------------------------------------------------------------
    def _run_draft_pending(self, request: Request) -> torch.Tensor:
        """Run the draft over its pending tokens (committing them); returns its logits after the root, ``(V,)``."""
        if not request.draft_pending:
            return request.draft_root_logits
        pending, request.draft_pending = request.draft_pending, []
        hidden = request.draft_hidden
        logits, states = _split(self.draft.extend(pending, commit=True, output_hidden=hidden), hidden)
        if hidden:
            request.draft_root_hidden = states[-1]
            if request.features and len(pending) > 1:  # the previous token was an accepted leaf the draft had not run
                request.draft_prev = (states[-2], distributions(logits[-2], request.sampling))
        return logits[-1]

    def _draft_tree(self, request: Request, q_root: torch.Tensor, action: Action) -> DraftedTree:
        """Draft this step's tree from the draft's tip; a policy that decides per
        node is asked at every trunk node, each decision's wall time going to the statistics' ``network_seconds``."""
        halting = None
        if request.policy.decides_per_node:
            def halting(node: TrunkNode) -> bool:
                start = time.perf_counter()
                halt = request.policy.halts(node)
                request.stats.network_seconds.append(time.perf_counter() - start)
                return halt
        return draft_delayed_tree(self.draft, q_root, action, request.sampling, request.rng,
                                  self.without_replacement, output_hidden=request.draft_hidden, halting=halting,
                                  root_hidden=request.draft_root_hidden)

    def _target_pass(self, request: Request, drafted: DraftedTree):
        """One target forward over the pending root and the tree's nodes.

        Returns logits ``(n, V)`` in node order, or ``(logits, hidden (n, H))`` with root features on.
        """
        tree, hidden = drafted.tree, request.features
        tip = self.target.length - 1
        if request.target_pending:  # the usual case: the root is the block's first token, a child of the tip
            tokens = request.target_pending + list(tree.tokens[1:])
            return run_nodes(self.target, range(tree.num_nodes), tokens, tree.parents, {tree.parents[ROOT]: tip},
                             output_hidden=hidden)
        # A one-token prompt: the root was run at prefill, so its row comes from there.
        root = request.target_root_logits.unsqueeze(0)
        if tree.num_nodes == 1:
            logits, states = root, None
        else:
            out = run_nodes(self.target, range(1, tree.num_nodes), tree.tokens, tree.parents, {ROOT: tip},
                            output_hidden=hidden)
            logits, states = _split(out, hidden)
            logits = torch.cat([root, logits])
        if not hidden:
            return logits
        root_hidden = request.target_root_hidden.unsqueeze(0)
        return logits, root_hidden if states is None else torch.cat([root_hidden, states])

    def _commit(self, request: Request, drafted: DraftedTree, result: VerifyResult) -> None:
        """Keep the root and the accepted path in both caches; queue what each model has not run yet."""
        tree = drafted.tree
        if request.target_pending:
            base = self.target.length - tree.num_nodes  # the root's slot in this pass's block
            self.target.commit([base + u for u in (ROOT, *result.path)])
        else:
            base = self.target.length - (tree.num_nodes - 1)  # node 1's slot; the root is already committed
            self.target.commit([base + u - 1 for u in result.path])
        ran = [drafted.slots[u] for u in result.path if drafted.slots[u] >= 0]
        self.draft.commit(ran)
        request.draft_pending = [tree.tokens[u] for u in result.path[len(ran) :]] + [result.extra_token]
        request.target_pending = [result.extra_token]

    def _root_features(self, request: Request, q_root: torch.Tensor, context_length: int) -> RootFeatures:
        (target_hidden, p_prev), (draft_hidden, q_prev) = request.target_prev, request.draft_prev
        return root_features(
            target_hidden, draft_hidden, request.draft_root_hidden, p_prev, q_prev, q_root,
            context_length, request.sampling, self.latency.pass_times,
        )


def prefill_to_root(draft: CachedLM, prompt_ids: Sequence[int], output_hidden: bool = False):
    """Run a prompt through the draft as the decoding loop does: all but its last token as one prefill, then the last
    token (the first root) as its own committed run. The collector runs its draft the same way, so its states equal
    the loop's to the bit (a block's floats depend on its shape).

    Returns:
        logits ``(m, V)`` float32 of the token before the root (where the prompt has one) and of the root, ``m`` =
        ``min(2, len(prompt_ids))``; ``(logits, hidden (m, H))`` when ``output_hidden``.
    """
    prefix, root = list(prompt_ids[:-1]), [int(prompt_ids[-1])]
    if not prefix:
        return draft.prefill(root, output_hidden=output_hidden)
    before = _split(draft.prefill(prefix, output_hidden=output_hidden, last=1), output_hidden)
    at_root = _split(draft.extend(root, commit=True, output_hidden=output_hidden), output_hidden)
    logits = torch.cat([before[0][-1:], at_root[0]])
    if not output_hidden:
        return logits
    return logits, torch.cat([before[1][-1:], at_root[1]])


def _drafted_action(widest: Action, drafted: DraftedTree) -> Action:
    """The action a per-node policy drafted: its widest tree with the trunk cut where it halted (a single path there
    when the widest tree has no branches)."""
    depth = drafted.trunk_depth
    if depth is None or depth == widest.l1:
        return widest
    return Action(1, depth, 0) if widest.is_single_path else Action(widest.k, depth, widest.l2)


def _last_accepted(result: VerifyResult) -> int:
    """The deepest accepted node (the root if none): its target output gave the step's extra token."""
    return result.path[-1] if result.path else ROOT


def _remember_previous(request: Request, drafted: DraftedTree, result: VerifyResult, p: torch.Tensor,
                       target_hidden: torch.Tensor, q_root: torch.Tensor) -> None:
    """After a step, the last accepted node (the root if none) is the next root's previous token."""
    last = _last_accepted(result)
    request.target_prev = (target_hidden[last], p[last])
    if last == ROOT:
        request.draft_prev = (request.draft_root_hidden, q_root)
    elif drafted.slots[last] >= 0:
        request.draft_prev = (drafted.hidden[last], drafted.q[last])
    # else: an accepted leaf; the next pending run gives its draft state


def _split(out, with_hidden: bool):
    """(logits, hidden) from a CachedLM call made with ``output_hidden=with_hidden``."""
    return out if with_hidden else (out, None)


class _Clock:
    """Splits a step's wall time into the phases of GenerationStats."""

    def __init__(self, stats: GenerationStats) -> None:
        self.stats, self.last = stats, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.stats.seconds[phase] += now - self.last
        self.last = now

    def move(self, source: str, to: str, seconds: float) -> None:
        """Count ``seconds`` already lapped in ``source`` as ``to``'s."""
        self.stats.seconds[source] -= seconds
        self.stats.seconds[to] += seconds


def cut_at_eos(emitted: list[int], budget: int, eos_token_id: int | None) -> tuple[list[int], bool]:
    """(the first ``budget`` of a step's ``emitted`` tokens, cut after EOS if it is among them; whether it was)."""
    kept = emitted[:budget]
    if eos_token_id is not None and eos_token_id in kept:
        return kept[: kept.index(eos_token_id) + 1], True
    return kept, False


def check_request(prompt_ids: Sequence[int], max_new_tokens: int, vocab: int, context_limit: int) -> None:
    """ValueError, in one line, for a request no decoder can serve: an empty prompt, no tokens asked, an id outside
    the vocabulary, or more positions than the models' context window."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    if len(prompt_ids) + max_new_tokens > context_limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the models' "
                         f"context window ({context_limit} positions)")
