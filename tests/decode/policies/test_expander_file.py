"""The expander's file contract (decode/policies/files/expander_file.py): the runtime halting rule is the offline one,
the metadata round-trips, and a file for another verifier, draft, pair or schema is refused."""

from __future__ import annotations

import numpy as np
import pytest

from decode.drafting.sampling import SamplingConfig
from decode.policies.files.expander_file import ExpanderFileError, ExpanderMetadata, HaltingRule, NodeRule


def metadata(**extra) -> ExpanderMetadata:
    rules = [NodeRule(0.6, 1.0, "learned", "1,1,0", HaltingRule(0.5, 0, 4, 1, 0), {"learned": 1.03}, 0),
             NodeRule(1.0, 1.0, "static", "1,0,0", None, {"learned": 0.99}, 1)]
    return ExpanderMetadata("traversal", 16, rules, pair_fingerprint="abc", fit_prompts=["p0"], **extra)


@pytest.mark.parametrize("floor, cap", [(0, 1), (0, 4), (1, 3), (2, 2)])
def test_the_runtime_rule_halts_where_the_offline_rule_does(floor, cap):
    from decode.policies.halting import halting_depth

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
    assert back.rule_table().nearest(SamplingConfig(0.7)).signal == "learned"
    assert back.rule_table().nearest(SamplingConfig(0.9)).rule is None


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


def test_the_marginal_signal_weighs_the_tokens_a_node_adds_against_its_time():
    from decode.policies.halting import marginal_gain

    beta = np.array([0.9, 0.5, 0.2])
    chain = np.array([10.0, 12.0, 14.0])  # a chain of d tokens costs 10 + 2d: each token adds 2
    got = marginal_gain(beta, chain)
    # d = 0: one more token adds 0.9 in 2 ms; stopping yields 1 token in 10 ms
    # d = 1: adds 0.45 in 2 ms, against 1.9 tokens in 12 ms; d = 2: adds 0.09 against 2.35 in 14 ms
    want = [(0.9 / 2) / (1 / 10), (0.45 / 2) / (1.9 / 12), (0.09 / 2) / (2.35 / 14)]
    assert np.allclose(got, want)
    # a β̂ past a node never moves its signal: the rule on it is a stopping time of the draft's own draws
    assert np.allclose(marginal_gain(np.array([0.9, 0.5, 0.99]), chain)[:2], got[:2])
    # batched over leading axes, as the offline fit runs it
    assert np.allclose(marginal_gain(np.stack([beta, beta]), np.stack([chain, chain]))[1], got)


def test_a_marginal_rule_needs_its_chain_times_and_old_files_read_without_new_keys():
    with pytest.raises(ValueError, match="chain_ms"):
        NodeRule(1.0, 1.0, "marginal", "1,1,0", HaltingRule(1.0, 0, 3, 1, 0))
    rule = NodeRule(1.0, 1.0, "marginal", "1,1,0", HaltingRule(1.0, 0, 3, 1, 0), chain_ms=[10.0, 12.0, 14.0, 16.0])
    meta = metadata()
    meta.rules.append(rule)
    props = meta.to_props()
    assert ExpanderMetadata.from_props(props).rules[-1] == rule
    del props["ddte.expander.head_inputs"]  # a file written before the key: the ridge head's inputs
    assert ExpanderMetadata.from_props(props).reads_root
