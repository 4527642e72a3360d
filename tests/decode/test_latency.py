"""The latency model: interpolation, Eq. 11 step time, JSON round trip, and a real measurement's shape."""

from __future__ import annotations

import pytest
import torch

from decode.actions import Action
from decode.latency import LatencyTable, measure_latency
from decode.models import CachedLM
from tests.factories import tiny_llama

# draft: 1 ms + 0.01 ms per context token, +0.1 ms per extra block token; target: 10x that
TABLE = LatencyTable(
    lengths=[0, 100],
    sizes=[1, 11],
    draft_ms=[[1.0, 2.0], [2.0, 3.0]],
    target_ms=[[10.0, 20.0], [20.0, 30.0]],
)


def test_interpolation_and_edges():
    assert TABLE.draft(50, 6) == pytest.approx(2.0)
    assert TABLE.target(0, 1) == 10.0 and TABLE.target(500, 99) == 30.0  # held at the grid's edge
    assert TABLE.pass_times(100) == (2.0, 20.0)


def test_step_time_follows_eq_11():
    ctx, action = 20, Action(3, 2, 4)
    trunk = sum(TABLE.draft(ctx + j, 1) for j in range(2))
    branches = sum(TABLE.draft(ctx + 2 + 3 * j, 3) for j in range(4))
    assert TABLE.step_ms(ctx, action) == pytest.approx(trunk + branches + TABLE.target(ctx, 1 + 2 + 3 * 4))
    assert TABLE.step_ms(ctx, Action(4, 0, 0)) == pytest.approx(TABLE.target(ctx, 1))  # no draft: one target pass
    single = sum(TABLE.draft(ctx + j) for j in range(3)) + TABLE.target(ctx, 4)
    assert TABLE.step_ms(ctx, Action(4, 3, 0)) == pytest.approx(single)  # L2 = 0: K plays no part


def test_json_round_trip():
    assert LatencyTable.from_json(TABLE.to_json()) == TABLE


def test_measure_latency_fills_the_grid():
    target = CachedLM(tiny_llama(seed=1, vocab=32, hidden=32, layers=2))
    draft = CachedLM(tiny_llama(seed=2, vocab=32, hidden=32, layers=1))
    table = measure_latency(target, draft, lengths=[8, 24], sizes=[1, 4], repeats=2, warmup=1)
    assert table.lengths == [8, 24] and table.sizes == [1, 4]
    assert all(ms > 0 for row in table.draft_ms + table.target_ms for ms in row)
    assert target.length == 0 and draft.length == 0  # caches left empty


class _RecordingLM:
    """Just enough of CachedLM for measure_latency: records the block size of every pass."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.vocab_size, self.length, self.blocks = 16, 0, []
        self.context_limit = 128

    def prefill(self, tokens):
        self.length = len(tokens)

    def extend_tree(self, tokens, parents):
        assert parents == [self.length - 1] * len(tokens)  # siblings under the cache's last token
        self.blocks.append(len(tokens))
        self.length += len(tokens)

    def commit(self, keep):
        self.length -= self.blocks[-1]

    def reset(self):
        self.length = 0


def test_every_block_size_is_measured_with_repeats_interleaved():
    target, draft = _RecordingLM(), _RecordingLM()
    table = measure_latency(target, draft, lengths=[8, 20], repeats=2, warmup=1, max_size=5)
    assert table.sizes == [1, 2, 3, 4, 5]
    one_length = [1, 2, 3, 4, 5] * 3  # warm-up + 2 repeats, each sweeping every size
    assert target.blocks == one_length * 2 and draft.blocks == one_length * 2
    assert target.length == 0 and draft.length == 0


def _reference_interpolation(xs, ys, x):
    """Plain piecewise-linear interpolation held at the edges (what the table must agree with)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def test_dense_grid_matches_interpolating_every_column_then_the_size():
    import random

    rng = random.Random(0)
    lengths, sizes = [16, 64, 300], [1, 2, 3, 5, 8, 13]
    grid = [[rng.uniform(1, 30) for _ in sizes] for _ in lengths]
    table = LatencyTable(lengths, sizes, grid, grid)
    for length in [0, 16, 40, 64, 299.5, 400]:
        for size in [0, 1, 2, 4, 7.5, 13, 20]:
            by_size = [_reference_interpolation(lengths, [row[j] for row in grid], length) for j in range(len(sizes))]
            assert table.target(length, size) == pytest.approx(_reference_interpolation(sizes, by_size, size))


def test_vectorised_step_time_equals_eq_11_per_action():
    """step_ms_many (one numpy pass) against Eq. 11 summed lookup by lookup, on an irregular grid, at lengths
    inside, on and beyond its points, for every default action."""
    import numpy as np

    from decode.latency import draft_passes

    g = np.random.default_rng(0)
    lengths, sizes = [16, 40, 200, 333], [1, 2, 3, 5, 9, 17, 41]
    table = LatencyTable(lengths, sizes, g.uniform(1, 4, (4, 7)).tolist(), g.uniform(10, 30, (4, 7)).tolist())
    actions = [Action(k, l1, l2) for k in range(1, 5) for l1 in range(9) for l2 in range(9)]

    def eq_11(ctx, a):
        k = a.k if a.l2 > 0 else 0
        trunk = sum(table.draft(ctx + j, 1) for j in range(a.l1))
        branches = sum(table.draft(ctx + a.l1 + j * k, k) for j in range(a.l2))
        return trunk + branches + table.target(ctx, 1 + a.size)

    passes = draft_passes(actions)
    for ctx in [0, 16, 17, 39, 40, 150, 200, 320, 333, 900]:
        want = np.array([eq_11(ctx, a) for a in actions])
        np.testing.assert_allclose(table.step_ms_many(ctx, actions), want, rtol=1e-12)
        np.testing.assert_allclose(table.step_ms_many(ctx, passes), want, rtol=1e-12)
    one_point = LatencyTable([64], [4], [[2.0]], [[20.0]])  # a one-point grid holds its value everywhere
    assert one_point.step_ms(10, Action(2, 1, 3)) == pytest.approx(4 * 2.0 + 20.0)
