"""Policy rows against the best static tree of their verifier: in-sample ratio and a bootstrap interval with the best
row chosen again in every resample."""

from __future__ import annotations

import numpy as np
import pytest

from bench.compare import (
    choose_static,
    cross_fitted_choice_ratio,
    fastest_row,
    format_comparisons,
    per_prompt_sums,
    policy_comparisons,
    resampled_rates,
)


def _row(method: str, walls: list[float], temperature: float = 1.0, tokens: float = 100.0, repeats: int = 1) -> dict:
    per_prompt = [{"prompt": i, "repeat": r, "new_tokens": tokens, "wall_seconds": w}
                  for r in range(repeats) for i, w in enumerate(walls)]
    return {"method": method, "temperature": temperature, "tokens_per_s": tokens / np.mean(walls),
            "per_prompt": per_prompt}


def test_runs_are_paired_and_summed_per_prompt():
    a = _row("nss@1,3,0", [1.0, 2.0], repeats=2)
    b = _row("nss@adaptive", [1.0, 2.0, 3.0])  # one repeat, one prompt more: only the shared runs count
    tokens, wall = per_prompt_sums([a, b])
    np.testing.assert_allclose(tokens, [[100, 100], [100, 100]])
    np.testing.assert_allclose(wall, [[1.0, 2.0], [1.0, 2.0]])
    tokens, wall = per_prompt_sums([a, _row("nss@1,2,0", [1.0, 1.0], repeats=2)])
    np.testing.assert_allclose(tokens, [[200, 200], [200, 200]])  # both repeats of a prompt in one column


def test_resamples_keep_rows_paired():
    """Every row sees the same resample: a row that is another one slowed down by 10 % everywhere stays 1/1.1 of it."""
    g = np.random.default_rng(1)
    wall = g.uniform(0.5, 2.0, size=(1, 20))
    rates = resampled_rates(np.full((2, 20), 50.0), np.vstack([wall, 1.1 * wall]), draws=100,
                            rng=np.random.default_rng(0))
    np.testing.assert_allclose(rates[1] / rates[0], 1 / 1.1)


def test_one_clear_winner_needs_no_correction():
    walls = list(np.random.default_rng(2).uniform(0.9, 1.1, size=24))
    rows = [_row("nss@1,3,0", walls), _row("nss@1,7,0", [2 * w for w in walls]), _row("nss@entropy", walls)]
    [c] = policy_comparisons(rows)
    assert c["best_static"] == "nss@1,3,0" and c["prompts"] == 24
    assert c["ratio_vs_best_static"] == pytest.approx(1.0)
    assert c["interval"] == pytest.approx([1.0, 1.0])


def test_near_tied_static_rows_bias_the_in_sample_best():
    """Three static rows with the same true speed and independent noise; the policy is a fourth draw of the same.
    Against the best of the three it reads below 1 on average (what the module docstring warns of), and the
    interval, which re-chooses the best row per resample, covers 1 in most runs."""
    rng = np.random.default_rng(0)
    read, covers = [], []
    for _ in range(100):
        walls = rng.normal(1.0, 0.1, size=(4, 16))
        rows = [_row(f"nss@1,{d},0", list(w)) for d, w in zip((2, 3, 4), walls[:3], strict=True)]
        [c] = policy_comparisons([*rows, _row("nss@adaptive", list(walls[3]))], draws=300)
        read.append(c["ratio_vs_best_static"])
        covers.append(c["interval"][0] <= 1.0 <= c["interval"][1])
        assert c["interval"][0] <= c["ratio_vs_best_static"] + 1e-9
    assert 0.97 < np.mean(read) < 0.985  # the maximum of three noisy rows: 1.8-2.0 % high
    assert np.mean(covers) > 0.7  # 0.80 with this seed: the selection bias costs the 95 % interval coverage


def test_rows_are_compared_within_a_temperature_with_their_verifier_and_across_verifiers():
    rows = [_row("ar", [1.0, 1.0]), _row("traversal@1,3,0", [1.0, 2.0]), _row("traversal@adaptive", [1.5, 1.5]),
            _row("specinfer@adaptive", [1.0, 1.0]),  # no specinfer static row: only against traversal's
            _row("traversal@1,3,0", [9.0, 9.0], temperature=0.6),
            _row("traversal@entropy", [1.0, 1.0], temperature=0.6)]
    comparisons = policy_comparisons(rows)
    assert [(c["temperature"], c["policy"], c["against"]) for c in comparisons] == [
        (1.0, "traversal@adaptive", "own verifier"), (1.0, "specinfer@adaptive", "any verifier"),
        (0.6, "traversal@entropy", "own verifier")]  # no other verifier's static row at 0.6: no second entry
    assert comparisons[1]["best_static"] == "traversal@1,3,0"
    assert comparisons[2]["ratio_vs_best_static"] == pytest.approx(9.0)
    table = format_comparisons(comparisons)
    assert "| 0.6 | traversal@entropy | 1,3,0 | 9.000" in table
    assert "| 1 | specinfer@adaptive | traversal@1,3,0 |" in table
    assert format_comparisons([]) == ""


def test_choosing_the_fastest_row_on_tied_rows_gains_nothing_cross_fitted():
    """Three rows with one true speed: the fastest in-sample reads about 2 % above the reference, the cross-fitted
    choice (chosen on one half of the prompts, scored on the other) about 1.0."""
    rng = np.random.default_rng(3)
    in_sample, cross_fitted = [], []
    for _ in range(200):
        rows = [_row(f"nss@1,{d},0", list(w)) for d, w in zip((2, 3, 4), rng.normal(1.0, 0.1, size=(3, 16)),
                                                                strict=True)]
        in_sample.append(rows[fastest_row(rows)]["tokens_per_s"] / rows[0]["tokens_per_s"])
        cross_fitted.append(cross_fitted_choice_ratio(rows))
    assert np.mean(in_sample) > 1.015
    assert abs(np.mean(cross_fitted) - 1.0) < 0.005


def test_a_truly_faster_row_is_found_cross_fitted():
    walls = np.random.default_rng(4).uniform(0.8, 1.2, size=12)
    rows = [_row("nss@1,3,0", list(walls)), _row("nss@1,5,0", list(walls / 1.05)), _row("nss@1,7,0", list(walls * 1.1))]
    assert fastest_row(rows) == 1
    assert cross_fitted_choice_ratio(rows) == pytest.approx(1.05)
    assert cross_fitted_choice_ratio(rows, reference=2) == pytest.approx(1.05 * 1.1)
    assert cross_fitted_choice_ratio([_row("nss@1,3,0", [1.0]), _row("nss@1,5,0", [0.9])]) is None  # one prompt


def test_the_training_split_choice_stays_unless_a_runner_up_beats_it_beyond_noise():
    """Three tied rows with 10 % noise per run over 16 prompts: the fastest row is a runner-up two times in three,
    but the choice leaves the training split's row rarely (7 % in 300 such benches; the percentile bootstrap of 16
    prompts is a little narrow for the nominal 5 %). A runner-up 10 % faster with 3 % noise is taken."""
    rng = np.random.default_rng(5)
    actions = ["1,3,0", "1,5,0", "1,7,0"]
    left, fastest_elsewhere = [], []
    for _ in range(100):
        rows = [_row(f"nss@{a}", list(w)) for a, w in zip(actions, rng.normal(1.0, 0.1, size=(3, 16)), strict=True)]
        kept, reason = choose_static(rows, actions)
        left.append(kept != 0)
        fastest_elsewhere.append(fastest_row(rows) != 0)
        assert (kept == 0) == ("kept the training split's choice" in reason or "ran fastest" in reason)
    assert np.mean(left) <= 0.15 and np.mean(fastest_elsewhere) >= 0.5
    walls = rng.normal(1.0, 0.03, size=(3, 16))
    walls[2] /= 1.1
    rows = [_row(f"nss@{a}", list(w)) for a, w in zip(actions, walls, strict=True)]
    kept, reason = choose_static(rows, actions)
    assert kept == 2 and "(1,7,0) ran 1.1" in reason and "beyond this bench's noise" in reason
    assert choose_static(rows[:1], actions[:1]) == (0, "(1,3,0) is the only static candidate")
