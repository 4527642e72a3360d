"""The never-lose guard on the running machine (decode/policies/files/guard.py): a policy fitted under one latency table
and run under another keeps the better static tree of the machine it runs on, for selectors, expanders and policy
files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.files.expander_file import HaltingRule, NodeRule
from decode.policies.files.guard import RuleProfile, StaticProfile, length_quantiles

LENGTHS, SIZES = [64, 512], [1, 2, 4, 8, 16]
# Where trees are nearly free (a target pass over 8 tokens costs 1.15x one) and where each token costs a pass.
FLAT = LatencyTable(LENGTHS, SIZES, [[1.0, 1.1, 1.2, 1.3, 1.5]] * 2, [[10.0, 10.5, 11.0, 11.5, 12.0]] * 2)
STEEP = LatencyTable(LENGTHS, SIZES, [[4.0, 8.0, 16.0, 32.0, 64.0]] * 2, [[10.0, 19.0, 38.0, 76.0, 150.0]] * 2,
                     machine="a CPU without native bf16")
PROFILE = StaticProfile(["1,0,0", "1,1,0", "1,2,0", "2,1,2"], [1.0, 1.8, 2.5, 3.2], [100, 300])
RULE = RuleProfile(3.3, {"1,2,0": 0.5, "2,1,2": 0.5}, 0.0, [100, 300], 0.01)


def test_the_best_static_tree_follows_the_machine():
    assert PROFILE.best(FLAT) == Action(2, 1, 2)  # 3.2 tokens for ~14 ms
    assert PROFILE.best(STEEP) == Action(1, 1, 0)  # the wide tree costs 73 ms there
    assert PROFILE.best(FLAT, among=[Action(1, 0, 0), Action(1, 2, 0)]) == Action(1, 2, 0)


def test_a_rule_runs_only_where_it_beats_that_machines_static_tree():
    assert RULE.beats(PROFILE, FLAT) and not RULE.beats(PROFILE, STEEP)
    node = NodeRule(0.6, 1.0, "top", "2,1,2", HaltingRule(0.5, 0, 2, 2, 2), {"top": 1.05}, 0,
                    PROFILE.as_dict(), RULE.as_dict())
    assert node.on_machine(FLAT) == (Action(2, 1, 2), True)
    assert node.on_machine(STEEP) == (Action(1, 1, 0), False)
    assert node.on_machine(None) == (Action(2, 1, 2), True)  # no table: as fitted
    unprofiled = NodeRule(0.6, 1.0, "top", "2,1,2", HaltingRule(0.5, 0, 2, 2, 2))
    assert unprofiled.on_machine(STEEP) == (Action(2, 1, 2), True)  # a file without profiles: as fitted


def test_profiles_round_trip_and_refuse_nonsense():
    assert StaticProfile.from_dict(json.loads(json.dumps(PROFILE.as_dict()))) == PROFILE
    assert RuleProfile.from_dict(json.loads(json.dumps(RULE.as_dict()))) == RULE
    with pytest.raises(ValueError, match="one Ê per action"):
        StaticProfile(["1,0,0"], [1.0, 2.0], [10])
    with pytest.raises(ValueError, match=">= 1"):
        StaticProfile(["1,0,0"], [0.5], [10])
    with pytest.raises(ValueError, match="malformed"):
        RuleProfile.from_dict({"be": 2.0})
    points = length_quantiles([5] * 10 + [900])
    assert points[0] == 5 and points[-1] <= 900 and points == sorted(set(points)) and len(points) <= 16


def test_a_selector_fitted_on_a_flat_machine_falls_back_to_this_machines_best(selector_file, tmp_path):
    from decode.policies.base import StaticPolicy
    from tests.decode.selectors import selector_policy, with_metadata

    guards = [{"temperature": 1.0, "top_p": 1.0, "action": "2,1,2", "margin": None, "profile": PROFILE.as_dict()}]
    path = with_metadata(selector_file, tmp_path / "fitted.onnx", "ddte.fallbacks", json.dumps(guards))
    here = selector_policy(path, machine=STEEP).start(SamplingConfig(1.0))
    assert type(here) is StaticPolicy and here.action == Action(1, 1, 0)
    as_fitted = selector_policy(path).start(SamplingConfig(1.0))  # the negative control: no table of this machine
    assert type(as_fitted) is StaticPolicy and as_fitted.action == Action(2, 1, 2)
    assert "best on this machine's latency table" in selector_policy(path, machine=STEEP).describe(SamplingConfig(1.0))


def test_a_policy_file_re_picks_its_static_tree_on_this_machine(tmp_path):
    from decode.policies.build import deployed_source
    from decode.policies.files.deployment import Choice, Deployment, load_deployment

    class Pair:
        def fingerprint(self):
            return "abc"

    choice = Choice("specinfer", 1.0, 1.0, "static", "2,1,2", profile=PROFILE.as_dict())
    path = Deployment([choice], "specinfer", "abc").write(tmp_path / "policy.json")
    deployment = load_deployment(path)
    assert deployed_source(deployment, "specinfer", Pair(), STEEP).chosen(SamplingConfig(1.0)).action == Action(1, 1, 0)
    assert deployed_source(deployment, "specinfer", Pair()).chosen(SamplingConfig(1.0)).action == Action(2, 1, 2)
    benched_here = Deployment([choice], "specinfer", "abc", {"machine": STEEP.machine})  # a measurement stays
    assert deployed_source(benched_here, "specinfer", Pair(), STEEP).chosen(SamplingConfig(1.0)).action == \
        Action(2, 1, 2)


def test_a_latency_table_of_another_pair_is_refused():
    table = LatencyTable(LENGTHS, SIZES, FLAT.draft_ms, FLAT.target_ms, pair="f" * 64)
    with pytest.raises(ValueError, match="another pair"):
        table.check_pair("0" * 64)
    table.check_pair("f" * 64)
    LatencyTable.from_json(table.to_json()).check_pair("f" * 64)


def test_a_rule_profile_keeps_the_pairing_of_small_trees_with_low_acceptance():
    """Two roots: one drafts nothing and makes 1.2 tokens a step, the other a 3-token chain and makes 3. The stream
    throughput is 2 / (T(1,0,0)/1.2 + T(1,3,0)/3.0) under any table; Ê over the mean step time would read it low."""
    length = LENGTHS[0]
    fast, slow = (STEEP.step_ms(length, Action.parse(a)) for a in ("1,0,0", "1,3,0"))
    stream = 2 / (fast / 1.2 + slow / 3.0)
    profile = RuleProfile(2 / (1 / 1.2 + 1 / 3.0), {"1,0,0": 0.5, "1,3,0": 0.5}, 0.0, [length],
                          inverse_be={"1,0,0": 1 / (2 * 1.2), "1,3,0": 1 / (2 * 3.0)})
    assert profile.tokens_per_ms(STEEP) == pytest.approx(stream, rel=1e-9)
    older = RuleProfile.from_dict({k: v for k, v in profile.as_dict().items() if k != "inverse_be"})
    assert older.tokens_per_ms(STEEP) < 0.95 * stream  # the decoupled mean: why rules never ran on their machine
    assert RuleProfile.from_dict(profile.as_dict()) == profile


def test_a_static_profile_holds_the_tokens_per_step_of_its_roots_placement():
    be = np.array([[1.0, 2.0, np.nan], [4.0, 2.0, 3.0]])
    lengths = np.array([100, 300])
    steps = StaticProfile.from_labels(["1,0,0", "1,1,0", "1,2,0"], be, lengths, per_step=True)
    positions = StaticProfile.from_labels(["1,0,0", "1,1,0", "1,2,0"], be, lengths)
    assert steps.actions == positions.actions == ["1,0,0", "1,1,0"]  # unlabelled somewhere: left out
    assert steps.be == pytest.approx([2.5, 2.0])  # a loop's steps: the plain mean
    assert positions.be == pytest.approx([2 / (1 + 1 / 4), 2.0])  # positions: the harmonic mean
