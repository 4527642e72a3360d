"""An expander whose threshold follows the acceptance it realizes (decode/policies/calibration.py) stays exactly the
target's law, alone through several steps and in a batch where two requests share one calibration.

Exact enumeration (tests/decode/exact/harness.py) on the tiny pair of test_expander_loop.py: the rule halts on the
draft's top probability, its calibration decides from the second step on (one tested token is evidence enough
here, every bin in its band; a bin short of it is explored every
second step), and the machine's chain times put the marginal rule's break-even near an acceptance
of one half, so the counts of earlier steps flip decisions the fitted threshold would have made (checked). Each
enumerated run starts a fresh calibration: its decisions are a function of that run's own history, as the
enumeration needs. Negative control: a step that counts its own outcome first (whether the target likes the trunk's
first draw at least as much as the draft) and drops the tree where the calibration, so told, halts at the root.
"""

from __future__ import annotations

import numpy as np
import pytest

from decode.batch import BatchDecoder
from decode.cost.table import LatencyTable
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.policies.calibration import AcceptanceCalibration
from decode.policies.expander import HaltingPolicy
from decode.policies.files.expander_file import HaltingRule, NodeRule
from decode.verifiers import get_verifier
from tests.decode.exact.harness import enumerate_runs, outcome_law
from tests.decode.exact.test_batch import Entry, drive
from tests.decode.exact.test_batch import job as batch_job
from tests.decode.exact.test_expander_loop import (
    PROMPT,
    SAMPLING,
    TOKENS,
    TOL,
    _first_trunk_token,
    _root_only,
    law_error,
    pair,
    target_law,
    target_likes_at_least,
)

# a draft pass costs half a one-token target pass: growing the chain pays where β̃ is above about one half
MACHINE = LatencyTable(lengths=[1, 64], sizes=[1, 8], draft_ms=[[5.0, 5.0], [5.0, 5.0]],
                       target_ms=[[10.0, 12.0], [10.0, 12.0]])
CAP = 2
overruled: list[bool] = []  # per decision where the calibration may act: whether it differed from the fitted rule's
counted: list[bool] = []  # per such decision: whether the counts of earlier steps decided it (else: the fitted rule)


class Calibrated(HaltingPolicy):
    """The halting policy on the top probability with a calibration; as a source it starts each generation with the
    calibration it was given (``shared``) or a fresh one."""

    def __init__(self, theta: float, calibration: AcceptanceCalibration | None = None, k: int = 1, l2: int = 0):
        rule = HaltingRule(theta, 0, CAP, k, l2)
        super().__init__(NodeRule(1.0, 1.0, "top", "1,0,0", rule), None, MACHINE,
                         calibration or AcceptanceCalibration(np.array([theta]), (0, 1), theta, 1, 2))
        self.theta = theta

    def start(self, sampling):
        return Calibrated(self.theta, self.calibration, self.rule.k, self.rule.l2)

    def halts(self, node):
        halt = super().halts(node)
        if node.depth < CAP and node.depth in self._signals:
            overruled.append(halt != (self._signals[node.depth] < self.theta))
            counted.append(self.calibration.decides(self._signals[node.depth]))
        return halt


def fresh(theta: float, k: int = 1, l2: int = 0) -> Calibrated:
    return Calibrated(theta, AcceptanceCalibration(np.array([theta]), (0, 1), theta, 1, 2), k, l2)


THETA = 0.4  # between top probabilities the tiny draft meets at the root (0.37 to 0.44)


def loop_law(decoder: SpeculativeDecoder, theta: float, k: int = 1, l2: int = 0) -> dict:
    """The law of the first TOKENS tokens of generations of TOKENS + 1 (more steps, where the counts decide)."""
    return outcome_law(enumerate_runs(
        lambda rng: tuple(decoder.generate(PROMPT, TOKENS + 1, fresh(theta, k, l2), rng, SAMPLING).tokens[:TOKENS])))


@pytest.mark.parametrize(("name", "k", "l2"), [("specinfer", 2, 1), ("traversal", 2, 1), ("nss", 1, 0)])
def test_a_calibrated_expander_is_the_targets_law_through_several_steps(name, k, l2):
    target, draft = pair()
    overruled.clear(), counted.clear()
    got = loop_law(SpeculativeDecoder(target, draft, get_verifier(name)), THETA, k, l2)
    assert any(o and c for o, c in zip(overruled, counted, strict=True)), "the counts never overruled the rule"
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, target_law(target)) < TOL


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_two_requests_sharing_a_calibration_are_each_the_targets_law(name):
    """The watched request's decisions read the companion's earlier outcomes (one calibration, as a source shares
    it); the companion decodes from a seeded source beside it."""
    target, draft = pair()
    decoder = BatchDecoder(target, draft)
    overruled.clear()

    def make(rng):
        shared = fresh(THETA, 2, 1)
        return [Entry(batch_job(PROMPT, TOKENS, name, SAMPLING, rng, shared)),
                Entry(batch_job([1, 0], 4, name, SamplingConfig(0.8), TorchRandom(3), shared))]

    got = outcome_law(enumerate_runs(lambda rng: drive(decoder, make(rng))[0][:TOKENS]))
    assert any(overruled)
    assert law_error(got, target_law(target)) < TOL


class CountsFirstStep(BatchDecoder):
    """Wrong: counts the step's own outcome before its tree is kept (the target's p against q at the trunk's first
    draw, as if that token were tested), then drops the tree where the calibration, so told, halts at the root."""

    def _draft_trees(self, live, q_roots, actions):
        drafted = super()._draft_trees(live, q_roots, actions)
        for rid, r in live.items():
            token, policy = _first_trunk_token(drafted[rid]), r.policy
            if token is None or not isinstance(policy, Calibrated):
                continue
            accepted = int(target_likes_at_least(self, r, token, q_roots[rid]))
            signals = {0: float(q_roots[rid].max())}
            for _ in range(4):
                policy.calibration.record(signals, 1, accepted)
            chain = policy.chain_ms(len(r.job.prompt_ids) + len(r.tokens), MACHINE)
            if policy.calibration.halts(0, signals, chain):
                drafted[rid] = _root_only(drafted[rid])
        return drafted


class CountsFirst(SpeculativeDecoder):
    step_class = CountsFirstStep


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_calibration_that_counts_the_current_step_first_is_caught(name):
    target, draft = pair()
    assert law_error(loop_law(CountsFirst(target, draft, get_verifier(name)), THETA), target_law(target)) > 100 * TOL
