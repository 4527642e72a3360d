"""The speculative decoding loop: root → policy → draft a delayed tree → one target pass → verify → commit.

Cache discipline. Each model's cache holds a committed prefix of the output. Tokens that are committed but
not yet run are *pending*. The target always has exactly one pending token, the root: the correction or
bonus token of the previous step (the last prompt token at first). Its logits come out of the same tree
pass that verifies the new tree. The draft's pending tokens are the root plus any accepted leaf (leaves are
never run by the draft). After verification both caches keep the accepted path and drop the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode.drafting import Action, DraftedTree, draft_delayed_tree
from decode.features import RootFeatures, root_features
from decode.latency import LatencyTable, measure_latency
from decode.models import CachedLM, check_same_vocab
from decode.policies import Policy, RootState, StepOutcome
from decode.rng import RandomSource
from decode.sampling import SamplingConfig, distributions
from decode.stats import GenerationStats
from decode.tree import ROOT
from decode.verifiers import Verifier, VerifyResult
from decode.verifiers.base import UnsupportedTreeError


@dataclass
class Generation:
    """One generated sample: the new token ids and the statistics of producing them."""

    tokens: list[int]
    stats: GenerationStats
    stopped_by: str  # "eos" or "length"


class SpeculativeDecoder:
    """Lossless speculative decoding of a target model with a draft model and delayed trees."""

    def __init__(
        self,
        target: CachedLM,
        draft: CachedLM,
        verifier: Verifier,
        sampling: SamplingConfig,
        eos_token_id: int | None = None,
        allow_padded_vocab: bool = False,
        latency: LatencyTable | None = None,
    ) -> None:
        self.vocab = check_same_vocab(target.config, draft.config, allow_padded_tail=allow_padded_vocab)
        self.target, self.draft = target, draft
        self.verifier, self.sampling = verifier, sampling
        self.eos_token_id = eos_token_id
        self.context_limit = min(_context_limit(target), _context_limit(draft))
        # RSD's regime is per-node without replacement; every other verifier drafts i.i.d. branches.
        self.without_replacement = verifier.name == "rsd"
        self.latency = latency  # measured on first use when a policy asks for root features
        self.features = False

    # --- the loop -------------------------------------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, policy: Policy, rng: RandomSource
    ) -> Generation:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (stops early at EOS)."""
        self._check_request(prompt_ids, max_new_tokens)
        self.features = bool(getattr(policy, "wants_features", False))
        if self.features and self.latency is None:
            # every block size up to the largest default tree (1 + 8 + 4·8); beyond it the table holds its edge
            self.latency = measure_latency(self.target, self.draft, lengths=[32, 256], repeats=3)
        stats = GenerationStats()
        start = time.perf_counter()
        self._prefill(prompt_ids)
        stats.seconds["prefill"] += time.perf_counter() - start
        out: list[int] = []
        stopped_by = "length"
        while len(out) < max_new_tokens:
            emitted, done = self._step(policy, rng, stats, len(prompt_ids) + len(out), max_new_tokens - len(out))
            out.extend(emitted)
            if done:
                stopped_by = "eos"
                break
        stats.wall_seconds = time.perf_counter() - start
        return Generation(out, stats, stopped_by)

    def _prefill(self, prompt_ids: Sequence[int]) -> None:
        """Run the prompt but its last token, which becomes the first root (pending in both models).

        A one-token prompt has nothing to run before the root, so the root is run here instead and its logits kept.
        With root features on, the last prefix token's states become the "previous token" of the first root.
        """
        prefix, root = list(prompt_ids[:-1]), int(prompt_ids[-1])
        hidden = self.features
        if prefix:
            t_logits, t_hidden = _split(self.target.prefill(prefix, output_hidden=hidden), hidden)
            d_logits, d_hidden = _split(self.draft.prefill(prefix, output_hidden=hidden), hidden)
            self.target_pending, self.draft_pending = [root], [root]
            if hidden:
                self.target_prev = (t_hidden[-1], distributions(t_logits[-1], self.sampling))
                self.draft_prev = (d_hidden[-1], distributions(d_logits[-1], self.sampling))
        else:
            t_logits, t_hidden = _split(self.target.prefill([root], output_hidden=hidden), hidden)
            d_logits, d_hidden = _split(self.draft.prefill([root], output_hidden=hidden), hidden)
            self.target_root_logits, self.draft_root_logits = t_logits[-1], d_logits[-1]
            self.target_pending, self.draft_pending = [], []
            if hidden:  # no previous token: zero states and a uniform law
                self.draft_root_hidden, self.target_root_hidden = d_hidden[-1], t_hidden[-1]
                uniform = torch.full_like(t_logits[-1], 1.0 / t_logits.shape[-1])
                self.target_prev = (torch.zeros_like(t_hidden[-1]), uniform)
                self.draft_prev = (torch.zeros_like(d_hidden[-1]), uniform)

    def _step(
        self, policy: Policy, rng: RandomSource, stats: GenerationStats, context_length: int, budget: int
    ) -> tuple[list[int], bool]:
        """One speculative step; returns the tokens kept (cut at EOS / the budget) and whether EOS was hit."""
        clock = _Clock(stats)
        started = clock.last
        q_root = distributions(self._run_draft_pending(), self.sampling)
        stats.draft_calls += 1
        clock.lap("draft")
        room = min(self.context_limit - context_length - 1, budget - 1)
        features = self._root_features(q_root, context_length) if self.features else None
        action = policy.choose(RootState(context_length, q_root, room, features, self.latency)).clipped(max(room, 0))
        clock.lap("policy")
        drafted = draft_delayed_tree(
            self.draft, q_root, action, self.sampling, rng, self.without_replacement, output_hidden=self.features
        )
        stats.draft_calls += drafted.draft_calls
        clock.lap("draft")
        logits, target_hidden = _split(self._target_pass(drafted), self.features)
        p = distributions(logits, self.sampling)
        clock.lap("target")
        try:
            result = self.verifier.verify(drafted.tree, p, drafted.q.to(p.dtype), rng)
        except UnsupportedTreeError as err:
            raise ValueError(f"action {action} with verifier '{self.verifier.name}': {err}") from err
        clock.lap("verify")
        self._commit(drafted, result)
        if self.features:
            self._remember_previous(drafted, result, p, target_hidden, q_root)
        kept, hit_eos = self._cut(list(result.emitted), budget)
        stats.record_step(str(action), drafted.tree.max_depth, result.accepted, len(kept))
        clock.lap("other")
        step_seconds = clock.last - started
        policy.observe(StepOutcome(action, result.accepted, len(result.emitted), context_length, step_seconds))
        clock.lap("policy")
        return kept, hit_eos

    # --- pieces ---------------------------------------------------------------------------------------------
    def _run_draft_pending(self) -> torch.Tensor:
        """Run the draft over its pending tokens (committing them); returns its logits after the root, ``(V,)``."""
        if not self.draft_pending:
            return self.draft_root_logits
        pending, self.draft_pending = self.draft_pending, []
        logits, hidden = _split(self.draft.extend(pending, commit=True, output_hidden=self.features), self.features)
        if self.features:
            self.draft_root_hidden = hidden[-1]
            if len(pending) > 1:  # the previous token was an accepted leaf the draft had not run
                self.draft_prev = (hidden[-2], distributions(logits[-2], self.sampling))
        return logits[-1]

    def _target_pass(self, drafted: DraftedTree):
        """One target forward over the pending root and the tree's nodes.

        Returns logits ``(n, V)`` in node order, or ``(logits, hidden (n, H))`` with root features on.
        """
        tree, hidden = drafted.tree, self.features
        tip = self.target.length - 1
        if self.target_pending:  # the usual case: the root is the block's first token
            parents = [tip] + [-(u + 1) for u in tree.parents[1:]]
            return self.target.extend_tree(self.target_pending + list(tree.tokens[1:]), parents, output_hidden=hidden)
        # A one-token prompt: the root was run at prefill, so its row comes from there.
        root = self.target_root_logits.unsqueeze(0)
        if tree.num_nodes == 1:
            logits, states = root, None
        else:
            parents = [tip if u == ROOT else -u for u in tree.parents[1:]]
            out = self.target.extend_tree(list(tree.tokens[1:]), parents, output_hidden=hidden)
            logits, states = _split(out, hidden)
            logits = torch.cat([root, logits])
        if not hidden:
            return logits
        root_hidden = self.target_root_hidden.unsqueeze(0)
        return logits, root_hidden if states is None else torch.cat([root_hidden, states])

    def _commit(self, drafted: DraftedTree, result: VerifyResult) -> None:
        """Keep the root and the accepted path in both caches; queue what each model has not run yet."""
        tree = drafted.tree
        if self.target_pending:
            base = self.target.length - tree.num_nodes  # the root's slot in this pass's block
            self.target.commit([base + u for u in (ROOT, *result.path)])
        else:
            base = self.target.length - (tree.num_nodes - 1)  # node 1's slot; the root is already committed
            self.target.commit([base + u - 1 for u in result.path])
        ran = [drafted.slots[u] for u in result.path if drafted.slots[u] >= 0]
        self.draft.commit(ran)
        self.draft_pending = [tree.tokens[u] for u in result.path[len(ran) :]] + [result.extra_token]
        self.target_pending = [result.extra_token]

    def _root_features(self, q_root: torch.Tensor, context_length: int) -> RootFeatures:
        (target_hidden, p_prev), (draft_hidden, q_prev) = self.target_prev, self.draft_prev
        return root_features(
            target_hidden, draft_hidden, self.draft_root_hidden, p_prev, q_prev, q_root,
            context_length, self.sampling, self.latency.pass_times,
        )

    def _remember_previous(self, drafted, result, p, target_hidden, q_root) -> None:
        """After a step, the last accepted node (the root if none) is the next root's previous token."""
        last = result.path[-1] if result.path else ROOT
        self.target_prev = (target_hidden[last], p[last])
        if last == ROOT:
            self.draft_prev = (self.draft_root_hidden, q_root)
        elif drafted.slots[last] >= 0:
            self.draft_prev = (drafted.hidden[last], drafted.q[last])
        # else: an accepted leaf; the next pending run gives its draft state

    def _cut(self, emitted: list[int], budget: int) -> tuple[list[int], bool]:
        kept = emitted[:budget]
        if self.eos_token_id is not None and self.eos_token_id in kept:
            return kept[: kept.index(self.eos_token_id) + 1], True
        return kept, False

    def _check_request(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab}): {bad[:5]}")
        if len(prompt_ids) + max_new_tokens > self.context_limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the models' "
                f"context window ({self.context_limit} positions)"
            )


def _split(out, with_hidden: bool):
    """(logits, hidden) from a CachedLM call made with ``output_hidden=with_hidden``."""
    return out if with_hidden else (out, None)


def _context_limit(model: CachedLM) -> int:
    return int(getattr(model.config, "max_position_embeddings", 1 << 30))


class _Clock:
    """Splits a step's wall time into the phases of GenerationStats."""

    def __init__(self, stats: GenerationStats) -> None:
        self.stats, self.last = stats, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.stats.seconds[phase] += now - self.last
        self.last = now


def check_action(verifier: Verifier, action: Action) -> None:
    """Raise a clear ValueError, before any decoding, when the verifier is not lossless on the action's trees."""
    from decode.tree import delayed_tree

    if verifier.name == "rsd":
        return  # RSD drafts its own (without-replacement) regime for every action
    probe = delayed_tree([0] * action.l1, [[0] * action.l2 for _ in range(action.k)])
    if not verifier.supports(probe):
        raise ValueError(
            f"verifier '{verifier.name}' is not lossless on {action} trees; it supports {verifier.regime_help}"
        )
