"""Learned policies inside a batch (decode/batch.py): a root selector reading root features, and an expander deciding
the trunk node by node (its head on root features, or on the draft's own state), keep every request exactly the
target's law beside other requests.

Exact enumeration through the real step (tiny HF models over a 3-token vocabulary, :mod:`tests.decode.exact.harness`):
the watched request's every random choice is walked while companions decode beside it from seeded sources, with
other prompts, verifiers, sampling and policies. Negative control: a step that lets the selector's decision depend on
the current step's draw and the target's law at it (:class:`~tests.decode.exact.test_batch_budget.Peeking`) must be
caught. The features a request's policy reads in a batch are those of its own context (checked against a plain
recompute).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.batch import BatchDecoder, Job
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.policies.base import Policy, PolicySource, RootState, StaticPolicy
from decode.policies.features import SCALAR_NAMES, root_features
from decode.policies.halting import HaltingRule
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.harness import enumerate_runs, outcome_law, recomputed_law
from tests.decode.exact.test_batch import Entry, drive, other
from tests.decode.exact.test_batch_budget import Lookahead, Peeking
from tests.decode.exact.test_expander_loop import (
    LATENCY,
    PROMPT,
    TOKENS,
    TOL,
    VOCAB,
    law_error,
    pair,
    policy,
    splitting_threshold,
)
from tests.decode.policies.test_features import recompute

WATCHED = SamplingConfig(0.8)
ENTROPY_Q_ROOT = SCALAR_NAMES.index("entropy_q_root")


class FeatureRule(Policy, PolicySource):
    """A root selector: a chain of 2 where the draft's law at the root is sure (its entropy, a root feature, below
    ``threshold``), else a chain of 1; it records the chains it chose."""

    name = "feature-rule"
    needs_root_features = True

    def __init__(self, threshold: float = 0.6, chosen: set[int] | None = None, seen: list[float] | None = None) -> None:
        self.threshold, self.chosen = threshold, chosen if chosen is not None else set()
        self.seen = seen if seen is not None else []

    def start(self, sampling: SamplingConfig) -> FeatureRule:
        return self

    def choose(self, root: RootState) -> Action:
        self.seen.append(float(root.features.scalars[ENTROPY_Q_ROOT]))
        sure = self.seen[-1] < self.threshold
        self.chosen.add(2 if sure else 1)
        return Action(1, 2 if sure else 1, 0)


def chain_verifiers() -> list[str]:
    return [name for name in verifier_names() if get_verifier(name).supports_action(1, 2, 0)]


def watched_law(decoder: BatchDecoder, make) -> dict:
    return outcome_law(enumerate_runs(lambda rng: drive(decoder, make(rng))[0][:TOKENS]))


def selector_batch(name: str, chosen: set[int], source=None, threshold: float = 0.6, seen: list[float] | None = None):
    """The watched request on a root selector, a companion on another selector instance and prompt, and a static
    request joining after the first step."""
    return lambda rng: [
        Entry(Job(PROMPT, TOKENS, FeatureRule(threshold, chosen, seen), source(rng) if source else rng, WATCHED,
                  get_verifier(name))),
        Entry(Job([1], 4, FeatureRule(0.9), TorchRandom(7), SamplingConfig(1.2, 0.9), get_verifier(other(name)))),
        Entry(Job([0, 2], 3, StaticPolicy(Action(1, 1, 0)), TorchRandom(2), SamplingConfig(0.6),
                  get_verifier("specinfer")), at=1),
    ]


@pytest.mark.parametrize("name", chain_verifiers())
def test_a_root_selector_in_a_batch_is_the_targets_law(name):
    target, draft = pair()
    seen: list[float] = []
    watched_law(BatchDecoder(target, draft, latency=LATENCY), selector_batch(name, set(), seen=seen))
    threshold = float(np.median(np.unique(np.round(seen, 6))))  # some roots sure, some not
    chosen: set[int] = set()
    got = watched_law(BatchDecoder(target, draft, latency=LATENCY), selector_batch(name, chosen, threshold=threshold))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)) < TOL
    assert chosen == {1, 2}, f"the selector never changed its chain: {chosen}"


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_the_harness_catches_a_selector_that_peeks_at_the_draw_in_a_batch(name):
    target, draft = pair()
    want = recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)
    make = selector_batch(name, set(), source=Lookahead)
    assert law_error(watched_law(BatchDecoder(target, draft, latency=LATENCY), make), want) < TOL
    assert law_error(watched_law(Peeking(target, draft, latency=LATENCY), make), want) > 100 * TOL


@pytest.mark.parametrize("signal", ["learned", "top"])
@pytest.mark.parametrize("name", ["specinfer", "traversal", "naive"])
def test_an_expander_in_a_batch_is_the_targets_law(name, signal):
    """Per-node halting inside the batched drafting: on a head that reads root features (``learned``) and on the
    draft's own law (``top``); companions on a static tree and on another expander."""
    target, draft = pair()
    shape = HaltingRule(0.0, 0, 2, 1, 0)  # trunks of 0 to 2 tokens, halted where the signal falls below θ
    theta = splitting_threshold(SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY), signal, shape)
    rule = HaltingRule(theta, 0, 2, 1, 0)
    sampling = SamplingConfig(1.0)

    def make(rng):
        return [Entry(Job(PROMPT, TOKENS, policy(signal, rule), rng, sampling, get_verifier(name))),
                Entry(Job([1, 2], 4, StaticPolicy(Action(1, 2, 0)), TorchRandom(3), SamplingConfig(0.7),
                          get_verifier("traversal"))),
                Entry(Job([2], 3, policy("top", rule), TorchRandom(4), WATCHED, get_verifier("specinfer")), at=1)]

    got = watched_law(BatchDecoder(target, draft, latency=LATENCY), make)
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, sampling)) < TOL


@pytest.mark.parametrize("prompt", [[2, 0, 1, 1], [2]], ids=["prompt4", "prompt1"])
def test_the_root_features_a_request_reads_in_a_batch_are_its_own(prompt):
    """Beside a companion on another prompt, each root's features equal a plain recompute over the request's own
    context (up to float rounding)."""
    target, draft = pair()
    roots: list[RootState] = []

    class Recording(FeatureRule):
        def choose(self, root):
            roots.append(root)
            return super().choose(root)

    sampling = SamplingConfig(1.0, 0.95)
    jobs = [Job(prompt, 10, Recording(), TorchRandom(1), sampling, get_verifier("traversal")),
            Job([1, 1, 0], 6, FeatureRule(), TorchRandom(2), SamplingConfig(0.7), get_verifier("specinfer"))]
    generation = BatchDecoder(target, draft, latency=LATENCY).generate(jobs)[0]
    context = list(prompt) + generation.tokens
    assert len(roots) == generation.stats.steps > 1
    for root in roots:
        if root.context_length < 2:
            continue  # no previous token: zero states by definition
        ctx = context[: root.context_length]
        t_prev, p_prev, _, _ = recompute(target.model, ctx, sampling)
        d_prev, q_prev, d_root, q_root = recompute(draft.model, ctx, sampling)
        want = root_features(t_prev, d_prev, d_root, p_prev, q_prev, q_root, len(ctx), sampling, LATENCY.pass_times)
        for name in ("target_hidden_prev", "draft_hidden_prev", "draft_hidden_root", "scalars"):
            assert torch.allclose(getattr(root.features, name), getattr(want, name), atol=2e-4, rtol=1e-4), name
