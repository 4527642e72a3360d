"""An expander's rule refitted on the running machine (decode/policies/fit/machine_fit.py) and the rule search both the
export and the refit run (decode/policies/fit/rule_fit.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from decode.cost.table import LatencyTable
from decode.cost.throughput import best_static
from decode.drafting.actions import Action, action_grid
from decode.policies.fit.machine_fit import FitSet, refit
from decode.policies.fit.rule_fit import ActionIndex, best_rule, candidate_rules, rule_terms
from decode.policies.halting import halting_depth

L_MAX, K_MAX, TREES = 3, 2, 2
LENGTHS, SIZES = [64, 512], [1, 2, 4, 8, 16]
# a target pass over 8 tokens 1.15x one (trees nearly free) and one where every token costs a pass
FLAT = LatencyTable(LENGTHS, SIZES, [[1.0, 1.1, 1.2, 1.3, 1.5]] * 2, [[10.0, 10.5, 11.0, 11.5, 12.0]] * 2)
STEEP = LatencyTable(LENGTHS, SIZES, [[4.0, 8.0, 16.0, 32.0, 64.0]] * 2, [[10.0, 19.0, 38.0, 76.0, 150.0]] * 2)


def episodes(roots: int = 120, seed: int = 0, informative: bool = True) -> FitSet:
    """Synthetic episodes: per trunk node an acceptance β, Ê of each tree from those β (a trunk token survives with
    the running product; K branches at the halting node with 1 − (1 − β)^K), and a ``top`` signal that is β plus
    noise (``informative``) or noise alone."""
    rng = np.random.default_rng(seed)
    beta = rng.beta(2.0, 1.0, size=(roots, TREES, L_MAX + 1))
    actions = [a for a in action_grid(K_MAX, L_MAX) if a.k == 1 or a.l2 > 0]
    be = np.empty((roots, TREES, len(actions)))
    for j, a in enumerate(actions):
        reach = np.concatenate([np.ones((roots, TREES, 1)), np.cumprod(beta, axis=-1)], axis=-1)  # P_0..P_{D}
        trunk = reach[..., 1:a.l1 + 1].sum(axis=-1)
        branch = reach[..., a.l1] * (1 - (1 - beta[..., a.l1]) ** a.k) * (0.7 ** np.arange(a.l2)).sum() \
            if a.l2 else 0.0
        be[..., j] = 1.0 + trunk + branch
    noise = rng.normal(0, 0.05, size=beta.shape)
    top = beta + noise if informative else rng.uniform(size=beta.shape)
    lengths = rng.integers(64, 512, size=roots)
    prompts = np.arange(roots) // 6  # six roots a prompt
    return FitSet([a.key for a in actions], be, lengths, prompts, {"top": top}, L_MAX, K_MAX)


def test_the_refit_prices_roots_as_the_collection_placed_them():
    """A steps fit set's static fallback is the best static tree under Σ Ê / Σ T̂, a positions one's under
    N / Σ T̂/Ê; on these episodes the two pick different trees, so a refit that ignored the roots would fail one."""
    fit_set = episodes(roots=60, seed=2)
    picks = {}
    for roots in ("positions", "steps"):
        data = dataclasses.replace(fit_set, roots=roots).on_machine(STEEP)
        want = data.actions[best_static(data.be.mean(axis=1), data.step, per_step=roots == "steps")].canonical()
        picks[roots] = refit(dataclasses.replace(fit_set, roots=roots), STEEP, min_gain=10.0).fallback
        assert picks[roots] == want
    assert picks["positions"] != picks["steps"]


def test_a_fit_set_travels_as_json_without_pickle():
    fit_set = episodes(roots=12)
    back = FitSet.from_dict(json.loads(json.dumps(fit_set.as_dict())))
    assert back.actions == fit_set.actions and back.l_max == L_MAX and back.k_max == K_MAX
    np.testing.assert_allclose(back.be, fit_set.be, rtol=1e-3)  # float16
    np.testing.assert_array_equal(back.lengths, fit_set.lengths)
    np.testing.assert_allclose(back.signals["top"], fit_set.signals["top"], atol=1e-3)
    assert back.roots == "positions"
    steps = dataclasses.replace(fit_set, roots="steps").as_dict()
    assert FitSet.from_dict(json.loads(json.dumps(steps))).roots == "steps"
    older = fit_set.as_dict()
    del older["roots"]  # files written before the roots were recorded: positions
    assert FitSet.from_dict(older).roots == "positions"
    with pytest.raises(ValueError, match="positions or steps"):
        dataclasses.replace(fit_set, roots="tokens")
    broken = fit_set.as_dict()
    broken["be"]["dtype"] = "|O"
    with pytest.raises(ValueError, match="malformed fit set"):
        FitSet.from_dict(broken)
    with pytest.raises(ValueError, match="same roots"):
        FitSet(fit_set.actions, fit_set.be, fit_set.lengths[:3], fit_set.prompts, {}, L_MAX, K_MAX)


@pytest.mark.parametrize("roots", ["positions", "steps"])
def test_the_grouped_search_finds_the_best_rule_a_rule_at_a_time_would(roots):
    fit_set = dataclasses.replace(episodes(roots=60, seed=3), roots=roots)
    data, signal = fit_set.on_machine(FLAT), fit_set.signals["top"]
    assert data.per_step == (roots == "steps")
    index = ActionIndex(data.actions)
    rules = candidate_rules(signal, L_MAX, K_MAX)

    def throughput(rule):
        (tokens, ms), _ = rule_terms(data, signal, rule, index)
        return tokens.sum() / ms.sum()

    chosen = best_rule(data, signal, rules, index)
    assert throughput(chosen) == pytest.approx(max(throughput(rule) for rule in rules))
    assert halting_depth(signal, chosen.theta, chosen.floor, chosen.cap).shape == (60, TREES)


def test_the_refit_follows_the_machine_it_runs_on():
    fit_set = episodes()
    flat, steep = refit(fit_set, FLAT, min_gain=0.0), refit(fit_set, STEEP, min_gain=0.0)
    assert flat.fallback != steep.fallback  # the best static tree is the machine's
    assert flat.fallback.size > steep.fallback.size  # wide trees where passes are flat
    assert flat.signal == "top" and flat.rule is not None and flat.ratios["top"] > 1.0


def test_a_rule_that_does_not_win_held_out_on_this_machine_does_not_run():
    choice = refit(episodes(informative=False), FLAT, min_gain=0.02)
    assert choice.signal == "static" and choice.rule is None
    assert choice.ratios["top"] < 1.02  # noise: what it gains in sample it loses on the prompts it did not see
    assert isinstance(choice.fallback, Action)
