"""The expander's file contract (decode/policies/expander_file.py): the runtime halting rule is the offline one, the
metadata round-trips, and a file for another verifier, draft, pair or schema is refused."""

from __future__ import annotations

import numpy as np
import pytest

from decode.drafting.sampling import SamplingConfig
from decode.policies.expander_file import ExpanderFileError, ExpanderMetadata, HaltingRule, NodeRule


def metadata(**extra) -> ExpanderMetadata:
    rules = [NodeRule(0.6, 1.0, "learned", "1,1,0", HaltingRule(0.5, 0, 4, 1, 0), {"learned": 1.03}, 0),
             NodeRule(1.0, 1.0, "static", "1,0,0", None, {"learned": 0.99}, 1)]
    return ExpanderMetadata("traversal", 16, rules, pair_fingerprint="abc", fit_prompts=["p0"], **extra)


@pytest.mark.parametrize("floor, cap", [(0, 1), (0, 4), (1, 3), (2, 2)])
def test_the_runtime_rule_halts_where_the_offline_rule_does(floor, cap):
    from selector.expansion import halting_depth

    signal = np.random.default_rng(floor + 10 * cap).uniform(size=(50, 2, 6))
    offline = halting_depth(signal, 0.4, floor, cap)
    rule = HaltingRule(0.4, floor, cap, 2, 1)
    runtime = np.array([[next(d for d in range(6) if rule.halts(d, s[d])) for s in tree] for tree in signal])
    assert (runtime == offline).all()


def test_a_lazy_signal_is_read_only_where_the_depth_does_not_decide():
    rule, asked = HaltingRule(0.4, 1, 3, 1, 0), []

    def signal_at(depth: int, value: float):
        return lambda: asked.append(depth) or value

    decisions = [rule.halts(d, signal_at(d, 0.9)) for d in range(5)]
    assert decisions == [False, False, False, True, True] and asked == [1, 2]
    assert rule.halts(1, signal_at(1, 0.1)) and rule.halts(2, 0.1) and not rule.halts(2, 0.9)


def test_a_rule_drafts_its_terminal_at_the_halting_depth():
    branch, stop = HaltingRule(0.5, 0, 3, 2, 2), HaltingRule(0.5, 0, 3, 1, 0)
    assert branch.widest.key == "2,3,2" and branch.tree_at(1).key == "2,1,2"
    assert stop.widest.key == "1,3,0" and stop.tree_at(0).key == "1,0,0"
    with pytest.raises(ValueError):
        HaltingRule(0.5, 2, 1, 1, 0)  # floor above cap
    with pytest.raises(ValueError):
        HaltingRule(0.5, 0, 1, 2, 0)  # branches without length


def test_metadata_round_trips_and_picks_the_nearest_configuration():
    meta = metadata()
    back = ExpanderMetadata.from_props(meta.to_props(), "f")
    assert back == meta
    assert back.rule_for(SamplingConfig(0.7)).signal == "learned"
    assert back.rule_for(SamplingConfig(0.9)).rule is None


@pytest.mark.parametrize("change, message", [
    (lambda p: p.pop("ddte.expander.rules"), "not a ddte expander"),
    (lambda p: p.pop("ddte.expander.verifier"), "lacks"),
    (lambda p: p.update({"ddte.expander.rules": "[{"}), "not JSON"),
    (lambda p: p.update({"ddte.expander.metadata_version": "7"}), "version 7"),
    (lambda p: p.update({"ddte.expander.rules": '[{"temperature": 1, "top_p": 1, "signal": "peek", '
                                                '"fallback": "1,0,0"}]'}), "malformed"),
    (lambda p: p.update({"ddte.expander.rules": "[]"}), "no rules"),
])
def test_a_broken_file_is_refused_with_one_line(change, message):
    props = metadata().to_props()
    change(props)
    with pytest.raises(ExpanderFileError, match=message):
        ExpanderMetadata.from_props(props, "f")


@pytest.mark.parametrize("args, message", [
    (("specinfer", 16, "abc"), "verifier 'traversal'"),
    (("traversal", 32, "abc"), "hidden size 16"),
    (("traversal", 16, "xyz"), "another pair"),
])
def test_a_file_for_another_verifier_draft_or_pair_is_refused(args, message):
    with pytest.raises(ExpanderFileError, match=message):
        metadata().check_compatible("f", *args)
    metadata().check_compatible("f", "traversal", 16, None)  # no fingerprint given: not checked
