"""The offline throughput estimator predicts the decoding loop's rate: a loop that steps from wherever its last step
ended, over roots the collector placed at evenly spaced positions or at the loop's own step starts; and the per-root
oracle is the stream optimum either way."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from decode.cost.throughput import best_static, block_efficiency, per_root_best, static_throughputs, stream_throughput


def _loop(advance: np.ndarray, step_ms: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(tokens per ms, tokens per step, the step starts) of a loop that, at position p, spends step_ms[p] and moves
    advance[p] on."""
    position, time, starts = 0, 0.0, []
    while position < len(advance):
        starts.append(position)
        time += step_ms[position]
        position += int(advance[position])
    return position / time, position / len(starts), np.array(starts)


def _loop_rate(advance: np.ndarray, step_ms: np.ndarray) -> tuple[float, float]:
    return _loop(advance, step_ms)[:2]


def test_the_estimator_is_the_loops_rate_and_a_ratio_of_sums_is_not():
    # Easy stretches (a long chain advances 8 tokens per 20 ms step) alternate with hard ones (2 tokens per 20 ms).
    block = 8 * 2 * 50
    advance = np.concatenate([np.full(block, 8), np.full(block, 2)] * 3).astype(float)
    step = np.full(len(advance), 20.0)
    rate, per_step = _loop_rate(advance, step)
    roots = np.arange(0, len(advance), 16)  # the collector's evenly spaced roots
    be, ms = advance[roots, None], step[roots, None]
    assert stream_throughput(be, ms, np.zeros(len(roots), dtype=int)) == pytest.approx(rate, rel=1e-9)
    assert block_efficiency(be[:, 0]) == pytest.approx(per_step, rel=1e-9)
    assert be.sum() / ms.sum() > 1.5 * rate  # each root counted as one step: the easy stretches weigh too much


def test_best_static_prefers_the_steady_action_the_loop_prefers():
    # Action 0 makes 3 tokens everywhere; action 1 makes 6 on half the roots and 1.5 on the other half: its mean Ê
    # (3.75) is higher, but the loop spends 4x the steps on its bad half.
    be = np.array([[3.0, 6.0], [3.0, 1.5]] * 50)
    step = np.full(be.shape, 10.0)
    assert be[:, 1].mean() > be[:, 0].mean() and best_static(be, step) == 0
    assert static_throughputs(be, step) == pytest.approx([0.3, 0.24])


def test_unlabelled_actions_never_compete_and_impossible_labels_are_refused():
    be = np.array([[2.0, np.nan], [2.0, 9.0]])
    assert static_throughputs(be, np.ones_like(be))[1] == -np.inf and best_static(be, np.ones_like(be)) == 0
    with pytest.raises(ValueError, match="no label"):
        stream_throughput(be, np.ones_like(be), np.array([1, 1]))
    with pytest.raises(ValueError, match="below 1"):
        stream_throughput(np.array([[0.5]]), np.ones((1, 1)), np.array([0]))


def _stream_advance() -> tuple[np.ndarray, np.ndarray]:
    """The easy and hard stretches of the test above, with a slower step where the chain is long."""
    block = 8 * 2 * 50
    advance = np.concatenate([np.full(block, 8), np.full(block, 2)] * 3).astype(float)
    return advance, np.where(advance > 4, 30.0, 20.0)


def test_roots_at_the_loops_step_starts_read_its_rate_as_a_ratio_of_sums():
    advance, step = _stream_advance()
    rate, per_step, starts = _loop(advance, step)
    be, ms = advance[starts, None], step[starts, None]
    chosen = np.zeros(len(starts), dtype=int)
    assert stream_throughput(be, ms, chosen, per_step=True) == pytest.approx(rate, rel=1e-9)
    assert block_efficiency(be[:, 0], per_step=True) == pytest.approx(per_step, rel=1e-9)
    # the same step roots read as positions would give every step the weight of one token: far too low here
    assert stream_throughput(be, ms, chosen) < 0.8 * rate and block_efficiency(be[:, 0]) < 0.8 * per_step


def test_the_step_estimator_is_tokens_over_time_on_a_hand_example():
    be = np.array([[2.0, 4.0], [3.0, 1.0]])
    step = np.array([[1.0, 2.0], [2.0, 1.0]])
    chosen = np.array([0, 1])
    # steps: (2 + 1) / (1 + 1) = 3/2; positions: 2 / (1/2 + 1/1) = 4/3
    assert stream_throughput(be, step, chosen, per_step=True) == pytest.approx(1.5)
    assert stream_throughput(be, step, chosen) == pytest.approx(4 / 3)
    # static: action 0 (2 + 3) / (1 + 2) = 5/3, action 1 (4 + 1) / (2 + 1) = 5/3 vs positions 2 / (1/2 + 2/3) = 12/7
    # and 2 / (1/2 + 1) = 4/3
    assert static_throughputs(be, step, per_step=True) == pytest.approx([5 / 3, 5 / 3])
    assert static_throughputs(be, step) == pytest.approx([12 / 7, 4 / 3])


def test_block_efficiency_is_the_plain_mean_over_steps_and_the_harmonic_mean_over_positions():
    be = np.array([1.0, 4.0])
    assert block_efficiency(be, per_step=True) == pytest.approx(2.5)
    assert block_efficiency(be) == pytest.approx(2 / (1 + 1 / 4))


def _rate(be: np.ndarray, step: np.ndarray, chosen: np.ndarray) -> float:
    rows = np.arange(len(chosen))
    return be[rows, chosen].sum() / step[rows, chosen].sum()


def test_the_per_ratio_argmax_is_not_the_step_optimum():
    """Negative control: over step roots a longer, slower tree can pay although its own Ê / T̂ is lower."""
    be = np.array([[2.0, 6.0], [1.0, 1.0]])
    step = np.array([[1.0, 4.0], [10.0, 10.0]])
    argmax = np.argmax(be / step, axis=1)
    assert argmax.tolist() == [0, 0] and _rate(be, step, argmax) == pytest.approx(3 / 11)
    best = per_root_best(be, step, per_step=True)
    assert best.tolist() == [1, 0] and _rate(be, step, best) == pytest.approx(7 / 14)
    assert per_root_best(be, step).tolist() == [0, 0]  # over positions the argmax is the optimum


@pytest.mark.parametrize("per_step", [True, False])
def test_the_per_root_oracle_is_the_brute_force_optimum_of_the_stream(per_step):
    rng = np.random.default_rng(3)
    roots, actions = 4, 3
    for _ in range(50):
        be = rng.uniform(1.0, 6.0, (roots, actions))
        step = rng.uniform(1.0, 8.0, (roots, actions))
        best = max(stream_throughput(be, step, np.array(c), per_step)
                   for c in itertools.product(range(actions), repeat=roots))
        assert stream_throughput(be, step, per_root_best(be, step, per_step), per_step) == pytest.approx(best,
                                                                                                       rel=1e-12)


def test_the_step_oracle_never_loses_to_the_per_root_argmax_and_skips_unlabelled_actions():
    rng = np.random.default_rng(4)
    wins = 0
    for _ in range(20):
        be = rng.uniform(1.0, 8.0, (200, 12))
        step = rng.uniform(1.0, 20.0, (200, 12))
        be[rng.random(be.shape) < 0.2] = np.nan
        be[:, 0] = rng.uniform(1.0, 8.0, 200)  # every root keeps a label
        chosen = per_root_best(be, step, per_step=True)
        assert np.isfinite(be[np.arange(200), chosen]).all()
        argmax = np.argmax(np.where(np.isfinite(be), be / step, -np.inf), axis=1)
        ours, theirs = _rate(be, step, chosen), _rate(be, step, argmax)
        assert ours >= theirs - 1e-12
        wins += ours > theirs * (1 + 1e-9)
    assert wins > 0  # not only equal: the argmax is beaten on such data
