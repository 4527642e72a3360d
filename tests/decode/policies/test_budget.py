"""The shared budget's rule (decode/policies/budget.py) and its spec, without models (its exactness in a batch:
tests/decode/exact/test_batch_budget.py)."""

from __future__ import annotations

import pytest

from decode.cost.pricing import step_ms
from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import RootState, StepOutcome
from decode.policies.budget import PRIOR_SURVIVAL, SharedBudgetPolicy, batch_actions, shared_lengths
from decode.policies.build import build_policy, needs_latency
from decode.policies.spec import PolicySpec, parse_policy_spec, parse_verifier_spec

SIZES = list(range(1, 30))
TABLE = LatencyTable(lengths=[1, 512], sizes=SIZES, draft_ms=[[1.0] * len(SIZES)] * 2,
                     target_ms=[[10.0 + 3 * n for n in SIZES]] * 2)


def test_the_spec_reads_and_spells_shared():
    assert parse_policy_spec("shared") == PolicySpec.shared() and PolicySpec.shared().max_draft == 6
    assert parse_policy_spec("shared:max-draft=4").text == "shared:max-draft=4"
    assert parse_policy_spec("shared:max-draft=6").text == "shared"
    assert parse_verifier_spec("traversal@shared") == ("traversal", PolicySpec.shared())
    assert needs_latency(PolicySpec.shared())
    with pytest.raises(ValueError, match="max-draft"):
        parse_policy_spec("shared:threshold=2")


def test_the_shared_budget_needs_a_latency_table():
    with pytest.raises(ValueError, match="latency table"):
        build_policy(PolicySpec.shared(), None, "traversal", None)
    assert build_policy(PolicySpec.shared(4), None, "traversal", TABLE).start(SamplingConfig(1.0)).max_draft == 4


def test_a_likelier_request_drafts_no_shorter_and_the_caps_hold():
    lengths = [shared_lengths([beta], [8], 100, TABLE)[0] for beta in (0.3, 0.5, 0.7, 0.85, 0.95)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert shared_lengths([0.99, 0.99], [0, 2], 100, TABLE) == [0, 2]


def test_the_batch_drafts_one_length_which_its_likelier_requests_lengthen():
    """Every request gets the same chain (below its cap); a likelier batch drafts no shorter, and the length is the
    one whose step has the most expected tokens per ms."""
    mixed = shared_lengths([0.9, 0.5, 0.7], [8, 8, 8], 100, TABLE)
    assert len(set(mixed)) == 1
    capped = shared_lengths([0.9, 0.5, 0.7], [8, 1, 8], 100, TABLE)
    assert capped[0] == capped[2] >= 1 and capped[1] == 1
    likelier = shared_lengths([0.95, 0.9, 0.9], [8, 8, 8], 100, TABLE)
    assert likelier[0] > mixed[0]
    betas = [0.9, 0.5, 0.7]

    def rate(length: int) -> float:
        expected = sum(1 + sum(b ** j for j in range(1, length + 1)) for b in betas)
        return expected / step_ms([length] * 3, 100, TABLE)

    assert mixed[0] == max(range(9), key=rate)


def test_the_step_prices_every_pass():
    # R = 2: root pass + levels 1, 2 (two nodes, then one) + target over (1 + 3) + (1 + 2) tokens
    assert step_ms([3, 2], 100, TABLE) == pytest.approx(1.0 + 1.0 + 1.0 + 10 + 3 * 7)
    # a fixed tree (2, 1, 1): its trunk node runs, its two leaves do not; 1 + 3 target tokens
    assert step_ms([0], 100, TABLE, [Action(2, 1, 1)]) == pytest.approx(1.0 + 1.0 + 10 + 3 * 5)


def test_the_estimate_learns_from_the_requests_own_steps_only():
    policy = SharedBudgetPolicy(TABLE)
    assert policy.survival == pytest.approx(PRIOR_SURVIVAL)
    policy.observe(StepOutcome(Action(1, 3, 0), 3, 4))
    high = policy.survival
    for _ in range(2):
        policy.observe(StepOutcome(Action(1, 3, 0), 0, 1))
    assert high > PRIOR_SURVIVAL > policy.survival
    low = policy.survival
    policy.observe(StepOutcome(Action(1, 0, 0), 0, 1))  # nothing drafted: nothing tested, the prior weighs more
    assert low < policy.survival < PRIOR_SURVIVAL


def test_alone_and_in_a_batch_the_rule_is_the_same():
    import torch

    policy = SharedBudgetPolicy(TABLE)
    alone = policy.choose(RootState(100, torch.ones(3) / 3, 40, SamplingConfig(1.0)))
    assert batch_actions([policy], [40], [100]) == [alone] and alone.k == 1 and alone.l2 == 0
    assert batch_actions([policy], [0], [100]) == [Action(1, 0, 0)]


def _steep(ratio_at_4: float) -> LatencyTable:
    """TABLE with a batch cost: a target pass beside 4 requests costs up to ``ratio_at_4`` times the table's, the
    ratio rising from 1 at one token to ``ratio_at_4`` at 29 (each token dearer as it attends over every request's
    slots), linear in the requests from 1 at one; the draft's passes no dearer."""
    from decode.cost.table import BatchCost

    ones = [[[1.0, 1.0]] * 2]
    cost = BatchCost([1, 4], [1, 512], [1, 29], ones * 2, ones + [[[1.0, ratio_at_4]] * 2])
    return LatencyTable(**{**TABLE.__dict__, "batch": cost})


def test_the_step_prices_each_pass_beside_every_request_in_the_cache():
    steep = _steep(2.0)
    assert step_ms([3], 100, steep) == pytest.approx(step_ms([3], 100, TABLE))  # alone: the single loop's step
    # four requests, 10 target tokens: the target pass dearer by its ratio there, the draft's passes not at all
    flat = step_ms([3, 2, 0, 1], 100, TABLE)
    target = TABLE.target(100, 4 + 3 + 2 + 1)
    assert step_ms([3, 2, 0, 1], 100, steep) == pytest.approx(flat + target * (10 - 1) / 28)


def test_a_dearer_batch_pass_admits_fewer_tokens():
    betas, caps = [0.9, 0.85, 0.8, 0.75], [6] * 4
    cheap = shared_lengths(betas, caps, 100, TABLE)
    steep = shared_lengths(betas, caps, 100, _steep(3.0))
    assert sum(steep) < sum(cheap)
    assert all(s <= c for s, c in zip(steep, cheap, strict=True))  # no request drafts longer for it
    assert shared_lengths([0.8], [6], 100, _steep(3.0)) == shared_lengths([0.8], [6], 100, TABLE)  # alone: unchanged
