"""The latency model: interpolation, Eq. 11 step time, JSON round trip, and a real measurement's shape."""

from __future__ import annotations

import pytest

from decode.drafting import Action
from decode.latency import LatencyTable, measure_latency
from decode.models import CachedLM
from tests.engine.tiny import tiny_llama

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
