"""Per-node expansion measured offline: halting depths, a planted informative signal that the rules exploit, an
uninformative one they cannot, and the whole report on a tiny collected data set."""

from __future__ import annotations

import json

import numpy as np
import pytest

from decode.drafting.actions import action_grid
from decode.policies.fit.rule_fit import rule_step_ms, rule_terms
from decode.policies.halting import halting_depth
from selector.expander.expansion import evaluate_expansion
from selector.expander.expansion_fit import (
    EpisodeData,
    Rule,
    _Index,
    best_rule,
)

L_MAX, K_MAX, TREES = 3, 2, 2


def test_halting_depth_honours_floor_cap_and_threshold():
    signal = np.array([[[0.9, 0.2, 0.9, 0.9]]])
    assert halting_depth(signal, 0.5, 0, 3)[0, 0] == 1  # first node below θ
    assert halting_depth(signal, 0.5, 2, 3)[0, 0] == 3  # the floor skips depth 1; nothing below θ after: the cap
    assert halting_depth(signal, 0.1, 0, 2)[0, 0] == 2  # never below θ: halts at the cap
    assert halting_depth(signal, 0.95, 0, 3)[0, 0] == 0


def _episodes(informative: bool, roots: int = 400, seed: int = 0, pass_ms: float = 0.0) -> EpisodeData:
    """Chains whose acceptance β at each node is either high (0.95) or low (0.05); a path's Ê is 1 + the product of
    accepted prefixes. ``informative``: the draft's top probability equals β (else it is noise). ``pass_ms``: a
    draft pass, which a rule pays for looking at a node it stops at (0: free, so a rule can match the oracle)."""
    rng = np.random.default_rng(seed)
    actions = action_grid(K_MAX, L_MAX)
    depth = L_MAX + 1
    beta = np.where(rng.random((roots, TREES, depth)) < 0.5, 0.95, 0.05)
    reach = np.cumprod(np.concatenate([np.ones((roots, TREES, 1)), beta[..., :-1]], axis=-1), axis=-1)
    be = np.zeros((roots, TREES, len(actions)))
    for i, a in enumerate(actions):
        d = a.depth if a.is_single_path else a.l1
        be[:, :, i] = 1.0 + reach[:, :, 1 : d + 1].sum(axis=-1)  # branching adds nothing here: stop or go on
    step = np.array([[10.0 + a.size for a in actions]] * roots)  # each drafted token costs 1 ms, a pass 10 ms
    top = beta if informative else rng.random(beta.shape)
    features = np.concatenate([top[..., None], rng.random((roots, TREES, depth, 3))], axis=-1)
    return EpisodeData(be, step, np.arange(roots) // 4, top, -np.log(top), beta, features, np.full(roots, pass_ms),
                       actions)


def test_an_informative_draft_confidence_is_exploited_and_noise_is_not():
    informative = evaluate_expansion(_episodes(True), L_MAX, K_MAX, folds=4)
    assert informative["top"] > 1.1 and informative["beta"] > 1.1 and informative["learned"] > 1.1
    assert informative["top"] == pytest.approx(informative["oracle"], rel=0.01)  # halting where β is low is all
    noise = evaluate_expansion(_episodes(False), L_MAX, K_MAX, folds=4)
    assert noise["top"] == pytest.approx(1.0, abs=0.03)  # confidence that says nothing wins nothing
    assert noise["beta"] > 1.1  # ... while the exact β still would
    assert noise["corr_with_beta"]["top"] == pytest.approx(0.0, abs=0.1)


def test_rules_are_scored_per_group_and_count_the_episodes_that_leave_the_static_tree():
    informative, noise = _episodes(True, roots=400), _episodes(False, roots=400, seed=1)
    both = EpisodeData(*(np.concatenate([getattr(informative, f), getattr(noise, f)]) for f in (
        "be", "step", "prompts", "top", "entropy", "beta", "features", "trunk_pass_ms")), informative.actions)
    both.prompts = np.concatenate([informative.prompts, noise.prompts + 1000])
    groups = np.array(["confident"] * 400 + ["noise"] * 400)
    out = evaluate_expansion(both, L_MAX, K_MAX, folds=4, groups=groups)
    # one rule fitted on both groups: it gains where the draft's confidence means something, and only there
    assert out["by_group"]["confident"]["top"] > 1.05 and out["by_group"]["confident"]["roots"] == 400
    assert out["by_group"]["noise"]["top"] < out["by_group"]["confident"]["top"] - 0.05
    assert out["by_group"]["noise"]["beta"] > 1.1  # the exact β wins on both: the planted β is there too
    assert 0.0 < out["leaves_static"]["top"] < 1.0 and out["leaves_static"]["beta"] > 0.3


def test_the_marginal_rule_on_an_exact_beta_halts_where_the_oracle_does():
    from decode.policies.halting import marginal_gain
    from selector.expander.expander import chain_times

    data = _episodes(True)
    marginal = marginal_gain(data.beta, chain_times(data)[:, None, :])
    out = evaluate_expansion(data, L_MAX, K_MAX, folds=4, extra={"marginal": marginal})
    assert out["marginal"] > 1.1 and out["marginal"] == pytest.approx(out["oracle"], rel=0.02)


def test_a_chain_stopped_below_its_cap_pays_the_pass_that_looked_at_its_last_node():
    data = _episodes(True, roots=8, pass_ms=0.5)
    index = _Index(data.actions)
    signal = np.ones_like(data.top)
    signal[..., 1] = 0.0  # every trunk halts at depth 1
    for rule, extra in [(Rule(0.5, 0, 3, 1, 0), 0.5), (Rule(0.5, 0, 1, 1, 0), 0.0), (Rule(0.5, 0, 3, 2, 1), 0.0),
                        (Rule(2.0, 0, 3, 1, 0), 0.0)]:  # below the cap; at the cap; branching; halting at the root
        depth = halting_depth(signal, rule.theta, rule.floor, rule.cap)
        tree = index(rule.k, int(depth[0, 0]), rule.l2 if rule.k > 1 else 0)
        np.testing.assert_allclose(rule_step_ms(data, rule, depth, np.full(depth.shape, tree)),
                                   data.step[:, [tree] * TREES] + extra)
        (tokens, ms), _ = rule_terms(data, signal, rule, index)  # position roots: one each, ms per token
        be = data.be[:, :, tree].mean(axis=1)
        assert float(ms.sum()) == pytest.approx(float(((data.step[:, tree] + extra) / be).sum())) and len(ms) == 8
        assert (tokens == 1).all()


def test_the_loop_runs_the_extra_pass_the_offline_charge_counts(tiny_pair):
    """Drafting with a halting rule runs one draft forward more than the static tree it ends with exactly where
    :func:`rule_step_ms` charges one: a chain stopped at 1 <= d < cap."""
    import torch

    from decode.drafting.delayed import draft_delayed_tree
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig, distributions
    from decode.pair import load_pair_config

    draft = load_pair_config(tiny_pair / "pair.yaml").draft
    sampling = SamplingConfig(temperature=1.0)

    def calls(rule: Rule | None, action, halt_at: int) -> int:
        logits = draft.prefill([5, 9, 11, 4])
        q_root = distributions(logits[-1], sampling)
        halting = None if rule is None else (lambda node: rule.halts(node.depth, 0.0 if node.depth == halt_at else 1.0))
        with torch.inference_mode():
            return draft_delayed_tree(draft, q_root, action, sampling, TorchRandom(0), halting=halting).draft_calls

    for rule, halt_at, extra in [(Rule(0.5, 0, 3, 1, 0), 1, 1), (Rule(0.5, 0, 3, 1, 0), 2, 1),
                                 (Rule(0.5, 0, 3, 1, 0), 9, 0), (Rule(0.5, 0, 3, 1, 0), 0, 0),
                                 (Rule(0.5, 0, 3, 2, 2), 1, 0), (Rule(0.5, 0, 3, 2, 2), 9, 0)]:
        depth = min(halt_at, rule.cap)
        static = calls(None, rule.tree_at(depth), halt_at)
        assert calls(rule, rule.widest, halt_at) == static + extra, (rule, halt_at)
        data = _episodes(True, roots=4, pass_ms=0.5)
        charged = rule_step_ms(data, rule, np.full((4, TREES), depth), np.zeros((4, TREES), int))
        assert charged[0, 0] - data.step[0, 0] == pytest.approx(0.5 * extra)


def test_a_rule_that_could_pick_an_unlabelled_tree_is_never_chosen():
    """Branching is unlabelled past depth 0 (as GBV labels only K root paths). On the fitting data the signal never
    drops below θ after depth 0, so a branching rule with a cap of 2 halts at 0 there and reads no NaN; it could still
    halt at depth 1 or 2 on other trees, so it must not be chosen, and the held-out figures must be numbers."""
    data = _episodes(True)
    index = _Index(data.actions)
    for a in data.actions:
        if not a.is_single_path and a.l1 > 0:
            data.be[:, :, index(a.k, a.l1, a.l2)] = np.nan
    data.be[:, :, index(2, 0, 3)] += 5.0  # branching at the root pays a lot: the tempting rule
    signal = np.ones_like(data.top)
    signal[..., 0] = 0.0  # every tree halts at depth 0 for any θ in (0, 1]
    tempting = Rule(0.5, 0, 2, 2, 3)
    chosen = best_rule(data, signal, [tempting, Rule(0.5, 0, 0, 2, 3), Rule(0.5, 0, 2, 1, 0)], index)
    assert chosen == Rule(0.5, 0, 0, 2, 3)  # the same terminal with a cap of 0: it can only halt at the root
    figures = evaluate_expansion(data, L_MAX, K_MAX, folds=4)
    assert all(np.isfinite(figures[name]) for name in ("top", "entropy", "learned", "beta"))


def test_a_root_time_choice_is_scored_only_on_the_roots_it_may_be_scored_on():
    data = _episodes(True)
    worst = int(np.argmax(data.step[0]))  # the largest tree: never the best static action here
    chosen = np.full(len(data.be), worst)
    chosen[data.prompts % 2 == 0] = -1  # roots of prompts the selector was fitted on
    left_out = evaluate_expansion(data, L_MAX, K_MAX, folds=4, root_choice=chosen)
    assert left_out["root_time_roots"] == int((chosen >= 0).sum())
    assert left_out["root_time"] < 0.95  # its own roots, its own (poor) action
    nothing_left = evaluate_expansion(data, L_MAX, K_MAX, folds=4, root_choice=np.full(len(data.be), -1))
    assert nothing_left["root_time_roots"] == 0 and np.isnan(nothing_left["root_time"])


def test_the_report_runs_on_a_collected_data_set(tiny_collected, tmp_path, capsys):
    from ddte.cli import main

    assert main(["analyze", "--data", str(tiny_collected), "--output", str(tmp_path), "--expansion",
                 "--folds", "2"]) == 0
    result = json.loads((tmp_path / "expansion.json").read_text())
    assert set(result) == {"specinfer/T0.7", "specinfer/T1", "traversal/T0.7", "traversal/T1", "gbv/T0.7", "gbv/T1"}
    for figures in result.values():
        for name in ("top", "entropy", "learned", "beta", "oracle"):
            assert figures[name] > 0
    assert "learned per-node" in capsys.readouterr().out


@pytest.mark.parametrize("per_step", [False, True])
def test_a_rule_profile_prices_the_stream_as_its_roots_stand_for_it(per_step):
    """Under a table whose times do not depend on the context, a rule's machine-free profile gives exactly the
    stream throughput the rule search scores (rule_terms), over step roots and over position roots alike."""
    import dataclasses

    from decode.cost.table import LatencyTable, draft_passes
    from selector.expander.expansion_fit import rule_profile

    table = LatencyTable([8, 512], [1, 2, 4, 8], [[1.0, 1.2, 1.5, 2.0]] * 2, [[10.0, 11.0, 13.0, 16.0]] * 2)
    data = _episodes(True, roots=40, pass_ms=table.draft(8, 1))
    data = dataclasses.replace(data, lengths=np.full(40, 8), per_step=per_step,
                               step=np.tile(table.step_ms_many(8, draft_passes(data.actions)), (40, 1)))
    index = _Index(data.actions)
    rule = Rule(0.5, 0, 3, 1, 0)
    (tokens, ms), _ = rule_terms(data, data.top, rule, index)
    profile = rule_profile(data, data.top, rule, min_gain=0.0)
    assert profile.tokens_per_ms(table) == pytest.approx(tokens.sum() / ms.sum(), rel=1e-9)
    other = dataclasses.replace(data, per_step=not per_step)
    (tokens, ms), _ = rule_terms(other, data.top, rule, index)
    assert profile.tokens_per_ms(table) != pytest.approx(tokens.sum() / ms.sum(), rel=1e-3)  # the placement matters
