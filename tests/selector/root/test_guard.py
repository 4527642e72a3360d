"""The never-lose guard's margin: fitted on validation roots, and no margin at all when the best guarded rule does not
beat the fallback by what the policy phase costs."""

from __future__ import annotations

import numpy as np

from selector.root.guard import MIN_GAIN, fit_margin, guarded_choice


def _roots(gain: float, n: int = 200, seed: int = 0):
    """Two actions with equal step times; action 1 is better by ``gain`` on half the roots (those where the selector's
    value says so) and equal elsewhere. Action 0 is the fallback."""
    rng = np.random.default_rng(seed)
    better = rng.random(n) < 0.5
    be = np.stack([np.full(n, 2.0), np.where(better, 2.0 * (1 + 2 * gain), 2.0)], axis=1)
    step = np.full((n, 2), 10.0)
    value = np.stack([np.full(n, 1.0), np.where(better, 1.5, 0.9)], axis=1)  # ranks the two correctly
    return value, be, step


def test_a_gain_that_pays_for_the_policy_phase_gets_a_margin():
    value, be, step = _roots(gain=0.05)
    fit = fit_margin(value, be, step, fallback=0)
    assert fit.margin is not None and fit.best_ratio >= 1 + MIN_GAIN
    chosen = guarded_choice(value, np.zeros(len(value), dtype=np.int64), fit.margin)
    assert (chosen == (value[:, 1] > value[:, 0])).all()  # leaves the fallback exactly where action 1 is better


def test_a_gain_below_the_policy_cost_keeps_the_fallback_everywhere():
    value, be, step = _roots(gain=MIN_GAIN / 4)
    fit = fit_margin(value, be, step, fallback=0)
    assert 1.0 < fit.best_ratio < 1 + MIN_GAIN and fit.margin is None
    assert fit_margin(value, be, step, fallback=0, min_gain=0.0).margin is not None  # the threshold is what refuses it
