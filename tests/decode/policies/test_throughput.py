"""The offline throughput estimator predicts the decoding loop's rate: a loop that steps from wherever its last step
ended, over positions whose labels the collector sampled at evenly spaced positions."""

from __future__ import annotations

import numpy as np
import pytest

from decode.policies.throughput import best_static, harmonic_block_efficiency, static_throughputs, stream_throughput


def _loop_rate(advance: np.ndarray, step_ms: np.ndarray) -> tuple[float, float]:
    """(tokens per ms, tokens per step) of a loop that, at position p, spends step_ms[p] and moves advance[p] on."""
    position, time, steps = 0, 0.0, 0
    while position < len(advance):
        time += step_ms[position]
        position += int(advance[position])
        steps += 1
    return position / time, position / steps


def test_the_estimator_is_the_loops_rate_and_a_ratio_of_sums_is_not():
    # Easy stretches (a long chain advances 8 tokens per 20 ms step) alternate with hard ones (2 tokens per 20 ms).
    block = 8 * 2 * 50
    advance = np.concatenate([np.full(block, 8), np.full(block, 2)] * 3).astype(float)
    step = np.full(len(advance), 20.0)
    rate, per_step = _loop_rate(advance, step)
    roots = np.arange(0, len(advance), 16)  # the collector's evenly spaced roots
    be, ms = advance[roots, None], step[roots, None]
    assert stream_throughput(be, ms, np.zeros(len(roots), dtype=int)) == pytest.approx(rate, rel=1e-9)
    assert harmonic_block_efficiency(be[:, 0]) == pytest.approx(per_step, rel=1e-9)
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
