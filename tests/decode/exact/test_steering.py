"""A steered draft (decode.models.steering) keeps every verifier that accepts delayed trees exactly lossless through
several steps of the real loop: each step's δ comes from the target's states at the previous step's last accepted
token, so q depends on where earlier steps ended, not only on the prefix.

Exact enumeration (algorithms.md §1.3): :class:`ReplayRandom` walks every random choice of
:meth:`SpeculativeDecoder.generate` (the draws of the trees and the verifiers' coins) on tiny HF models over a
3-token vocabulary; the law of the first three tokens must equal the target's. Negative control: a loop that draws
each tree under the previous step's δ but hands the verifier q computed under this step's δ must be caught.
"""

from __future__ import annotations

import pytest
import torch

from decode.batch import BatchDecoder
from decode.drafting.actions import Action
from decode.drafting.delayed import DraftedTree
from decode.drafting.sampling import SamplingConfig, distributions
from decode.drafting.tree import ROOT
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import cached_lm
from decode.models.shared_cache import Block, SharedCache
from decode.models.slots import block_parents
from decode.models.steering import SteeringMap, SteeringSpec, link_steering
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.harness import enumerate_runs, outcome_law, recomputed_law
from tests.factories import tiny_llama

VOCAB, PROMPT, TOKENS = 3, [2, 0, 1], 3
ACTIONS = (Action(2, 1, 1), Action(2, 0, 1), Action(1, 1, 1))  # a delayed tree, root branching, a chain
TOL = 1e-5  # float32 models: a tree pass and a plain recompute differ by ~1e-7 in p


def steering_for(target_hidden: int, draft_ffn: int, seed: int = 0) -> SteeringMap:
    """A map with a non-zero output (a trained map's, not the zero one it starts as), large enough to move q."""
    steering = SteeringMap(SteeringSpec((1, 2), target_hidden, rank=4, draft_layers=1, draft_ffn=draft_ffn))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        steering.out.weight.copy_(8.0 * torch.randn(steering.out.weight.shape, generator=gen))
    return steering


def steered_pair(seed: int) -> tuple[CachedLM, CachedLM]:
    target = CachedLM(tiny_llama(seed=seed, vocab=VOCAB, hidden=32, layers=2, logit_scale=3.0))
    draft = cached_lm(tiny_llama(seed=seed + 100, vocab=VOCAB, hidden=16, layers=1, logit_scale=3.0))
    link_steering(draft, target, steering_for(32, 32, seed))
    return target, draft


def target_law(target: CachedLM, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(first TOKENS tokens = s) under the target, by plain recomputes."""
    return recomputed_law(target, PROMPT, TOKENS, VOCAB, sampling)


def loop_law(decoder: SpeculativeDecoder, action: Action, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    policy = StaticPolicy(action)
    return outcome_law(enumerate_runs(
        lambda rng: tuple(decoder.generate(PROMPT, TOKENS, policy, rng, sampling).tokens[:TOKENS])))


def law_error(got: dict, want: dict) -> float:
    return max(abs(got.get(s, 0.0) - p) for s, p in want.items())


class StaleSteeringStep(BatchDecoder):
    """Wrong: draws each tree under the previous step's δ, then gives the verifier q recomputed under this step's."""

    def _draft_trees(self, live, q_roots, actions):
        ((rid, request),) = live.items()
        link = self.draft.lm.hook
        current = link.up_bias(self.draft.tip(request.draft_seq))
        stale, request.previous_delta = getattr(request, "previous_delta", None), current
        link.up_bias = lambda root: stale  # shadows the method on this instance while the tree is drawn
        try:
            drafted = super()._draft_trees(live, q_roots, actions)
        finally:
            del link.up_bias
        self.draft.commit({})  # drop the stale slots, then run the same nodes under this step's δ
        return {rid: _requeried(self.draft, request.draft_seq, drafted[rid], q_roots[rid], request.job.sampling)}


class StaleSteeringDecoder(SpeculativeDecoder):
    step_class = StaleSteeringStep


def _requeried(draft: SharedCache, seq: int, drafted: DraftedTree, q_root: torch.Tensor, sampling) -> DraftedTree:
    """The same tree, with q at every node it ran recomputed by ``draft`` as it is now (slots re-made)."""
    tree, ran = drafted.tree, [v for v in range(1, drafted.tree.num_nodes) if drafted.slots[v] >= 0]
    slots, q = {ROOT: draft.tip(seq)}, drafted.q.clone()
    q[ROOT] = q_root
    if ran:
        (out,) = draft.run([Block(seq, [tree.tokens[v] for v in ran], block_parents(ran, tree.parents, slots))])
        slots.update({v: out.base + i for i, v in enumerate(ran)})
        for v, row in zip(ran, distributions(out.logits, sampling), strict=True):
            q[v] = row
    return DraftedTree(tree, q, [slots.get(v, -1) for v in range(tree.num_nodes)], drafted.draft_calls)


def _cases():
    """Each verifier on the first of ACTIONS it is lossless on (a delayed tree wherever it takes one)."""
    for name in verifier_names():
        verifier = get_verifier(name)
        action = next(a for a in ACTIONS if verifier.supports_action(a.k, a.l1, a.l2))
        yield pytest.param(name, action, id=f"{name}-{action.k},{action.l1},{action.l2}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "action"), list(_cases()))
def test_a_steered_draft_is_lossless_through_several_steps(name, action):
    target, draft = steered_pair(seed=3)
    sampling = SamplingConfig(1.0)
    got = loop_law(SpeculativeDecoder(target, draft, get_verifier(name)), action, sampling)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, target_law(target, sampling)) < TOL


def test_steering_moves_q_so_the_enumeration_can_tell():
    """The steered draft's q differs from the unsteered one's by far more than the tolerance, at the first step."""
    target, draft = steered_pair(seed=3)
    draft.prefill(PROMPT[:-1])
    plain = torch.softmax(draft.extend([PROMPT[-1]], commit=True)[-1], -1)  # the target has run nothing: unsteered
    target.prefill(PROMPT[:-1])
    draft.prefill(PROMPT[:-1])
    steered = torch.softmax(draft.extend([PROMPT[-1]], commit=True)[-1], -1)  # δ of the target at the token before
    assert float((plain - steered).abs().max()) > 0.05


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_tokens_drawn_under_a_stale_delta_are_caught(name):
    target, draft = steered_pair(seed=3)
    sampling = SamplingConfig(1.0)
    got = loop_law(StaleSteeringDecoder(target, draft, get_verifier(name)), Action(2, 1, 1), sampling)
    assert law_error(got, target_law(target, sampling)) > 100 * TOL
