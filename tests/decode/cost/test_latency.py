"""The latency model: interpolation, Eq. 11 step time, JSON round trip, and a real measurement's shape."""

from __future__ import annotations

import json

import pytest
import torch

from decode.cost.measure import measure_batch_cost, measure_latency
from decode.cost.table import BatchCost, LatencyTable
from decode.drafting.actions import Action
from decode.models.cached_lm import CachedLM
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


def test_step_time_counts_the_passes_the_loop_runs():
    ctx, action = 20, Action(3, 2, 4)
    # the root and both trunk nodes one token at a time; 3 of the 4 branch levels have children
    trunk = sum(TABLE.draft(ctx + j, 1) for j in range(3))
    branches = sum(TABLE.draft(ctx + 3 + 3 * j, 3) for j in range(3))
    assert TABLE.step_ms(ctx, action) == pytest.approx(trunk + branches + TABLE.target(ctx, 1 + 2 + 3 * 4))
    # no tree: the root's draft pass (the next step needs its q) and one target pass
    assert TABLE.step_ms(ctx, Action(4, 0, 0)) == pytest.approx(TABLE.draft(ctx, 1) + TABLE.target(ctx, 1))
    chain = sum(TABLE.draft(ctx + j) for j in range(3)) + TABLE.target(ctx, 4)
    assert TABLE.step_ms(ctx, Action(4, 3, 0)) == pytest.approx(chain)  # L2 = 0: K plays no part, the leaf is not run
    assert TABLE.step_ms(ctx, Action(1, 0, 3)) == pytest.approx(chain)  # the same chain drawn as one branch


def test_json_round_trip():
    assert LatencyTable.from_json(TABLE.to_json()) == TABLE


def test_measure_latency_fills_the_grid():
    target = CachedLM(tiny_llama(seed=1, vocab=32, hidden=32, layers=2))
    draft = CachedLM(tiny_llama(seed=2, vocab=32, hidden=32, layers=1))
    table = measure_latency(target, draft, lengths=[8, 24], sizes=[1, 4], repeats=2, warmup=1)
    assert table.lengths == [8, 24] and table.sizes == [1, 4]
    assert all(ms > 0 for row in table.draft_ms + table.target_ms for ms in row)
    assert target.length == 0 and draft.length == 0  # caches left empty


class _FakeClock:
    """A perf_counter that moves only when a fake model runs: the measured times are exactly the modelled ones."""

    def __init__(self) -> None:
        self.now, self.last_model = 0.0, None
        self.slow = (0.0, 0.0)  # seconds [from, to) in which every pass takes twice as long

    def __call__(self) -> float:
        return self.now


class _RecordingLM:
    """Just enough of CachedLM for measure_latency: records every pass and charges it to a fake clock
    (``ms_per_token`` per token, plus ``cold_ms`` when another model ran last, as after the loop's target pass)."""

    def __init__(self, name: str, clock: _FakeClock, ms_per_token: float = 1.0, cold_ms: float = 0.0) -> None:
        self.device, self.dtype, self.kernel = torch.device("cpu"), torch.float32, "default"
        self.vocab_size, self.length, self.blocks, self.prefills = 16, 0, [], []
        self.context_limit = 128
        self.name, self.clock, self.ms_per_token, self.cold_ms = name, clock, ms_per_token, cold_ms

    def prefill(self, tokens):
        self.length = len(tokens)
        self.prefills.append(len(tokens))

    def extend_tree(self, tokens, parents, on_support=False):
        assert parents == [self.length - 1] * len(tokens)  # siblings under the cache's last token
        assert on_support == (self.name == "draft")  # the draft is timed as the drafting loop runs it
        self.blocks.append(len(tokens))
        self.length += len(tokens)
        cold = self.cold_ms if self.clock.last_model not in (None, self.name) else 0.0
        slow = 2.0 if self.clock.slow[0] <= self.clock.now < self.clock.slow[1] else 1.0
        self.clock.now += slow * (self.ms_per_token * len(tokens) + cold) / 1e3
        self.clock.last_model = self.name
        return torch.zeros(len(tokens), self.vocab_size)

    def commit(self, keep):
        self.length -= self.blocks[-1]

    def reset(self):
        self.length = 0


def _recording_pair(monkeypatch, cold_ms: float = 0.0):
    clock = _FakeClock()
    monkeypatch.setattr("decode.cost.measure.time.perf_counter", clock)
    return _RecordingLM("target", clock, ms_per_token=10.0), _RecordingLM("draft", clock, cold_ms=cold_ms)


def test_every_block_size_is_measured_in_the_loops_order(monkeypatch):
    target, draft = _recording_pair(monkeypatch)
    table = measure_latency(target, draft, lengths=[8, 20], repeats=2, warmup=1, max_size=5)
    assert table.sizes == [1, 2, 3, 4, 5]
    # per length: warm-up + 2 repeats, each sweeping every size with one simulated step
    assert target.blocks == [1, 2, 3, 4, 5] * 3 * 2
    # per step: the cold one-token pass, the same pass warm, then the block
    assert draft.blocks == [n for _ in range(3 * 2) for size in range(1, 6) for n in (1, 1, size)]
    assert target.length == 0 and draft.length == 0
    assert target.prefills == draft.prefills == [8, 20] * 3  # repeats outermost: every length once per repeat


def test_a_slow_phase_of_the_machine_does_not_bend_the_table(monkeypatch):
    """After the warm-up, every pass runs twice as slow for as long as two slowed sweeps take. Repeats outermost put
    the phase on repeat 1 of each length, and the medians stay exact; with the lengths outermost it would fall on
    repeats 2 and 3 of the first length and bend its row (the code before this test did)."""
    target, draft = _recording_pair(monkeypatch)
    sweep_s = (10 + 20 + 30 + 40 + 3 + 4 + 5 + 6) / 1e3  # one length's sizes 1..4: target block, 3 draft passes each
    target.clock.slow = (2 * sweep_s - 1e-6, 5.9 * sweep_s)
    table = measure_latency(target, draft, lengths=[8, 20], repeats=3, warmup=1, max_size=4)
    assert table.target_ms == [pytest.approx([10.0, 20.0, 30.0, 40.0])] * 2
    assert table.draft_ms == [pytest.approx([1.0, 2.0, 3.0, 4.0])] * 2


def test_measured_passes_and_the_cold_first_draft_pass(monkeypatch):
    """With a fake clock: pass times are the modelled ones, and c(l) is exactly the cold penalty of a draft pass
    run right after the target's, which T̂ then counts once per step."""
    target, draft = _recording_pair(monkeypatch, cold_ms=0.7)
    table = measure_latency(target, draft, lengths=[8, 20], repeats=3, warmup=1, max_size=4)
    assert table.draft_ms == [pytest.approx([1.0, 2.0, 3.0, 4.0])] * 2  # the block follows two draft passes: warm
    assert table.target_ms == [pytest.approx([10.0, 20.0, 30.0, 40.0])] * 2
    assert table.step_extra_ms == pytest.approx([0.7, 0.7])
    eq_11 = 3 * table.draft(8, 1) + table.target(8, 4)  # the root and two trunk nodes run
    assert table.step_ms(8, Action(1, 3, 0)) == pytest.approx(0.7 + eq_11)

    target, draft = _recording_pair(monkeypatch)  # negative control: no cold penalty, no per-step term
    assert measure_latency(target, draft, lengths=[8], repeats=2, max_size=2).step_extra_ms == [0.0]


def test_a_table_without_the_per_step_term_reads_as_zero():
    """Tables written before c(l) existed (data sets, latency files) load and keep their T̂."""
    import json

    old = json.loads(TABLE.to_json())
    del old["step_extra_ms"]
    table = LatencyTable.from_json(json.dumps(old))
    assert table.step_extra(50) == 0.0
    assert table.step_ms(20, Action(3, 2, 4)) == pytest.approx(TABLE.step_ms(20, Action(3, 2, 4)))
    with_extra = LatencyTable(TABLE.lengths, TABLE.sizes, TABLE.draft_ms, TABLE.target_ms, step_extra_ms=[1.0, 3.0])
    assert with_extra.step_extra(50) == pytest.approx(2.0) and with_extra.step_extra(900) == 3.0
    assert with_extra.step_ms(50, Action(1, 3, 0)) == pytest.approx(2.0 + TABLE.step_ms(50, Action(1, 3, 0)))


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

    from decode.cost.table import draft_passes

    g = np.random.default_rng(0)
    lengths, sizes = [16, 40, 200, 333], [1, 2, 3, 5, 9, 17, 41]
    table = LatencyTable(lengths, sizes, g.uniform(1, 4, (4, 7)).tolist(), g.uniform(10, 30, (4, 7)).tolist())
    actions = [Action(k, l1, l2) for k in range(1, 5) for l1 in range(9) for l2 in range(9)]

    def eq_11(ctx, a):
        singles = 1 + a.l1 if a.l2 > 0 else max(1, a.l1)
        trunk = sum(table.draft(ctx + j, 1) for j in range(singles))
        branches = sum(table.draft(ctx + singles + j * a.k, a.k) for j in range(a.l2 - 1))
        return trunk + branches + table.target(ctx, 1 + a.size)

    passes = draft_passes(actions)
    for ctx in [0, 16, 17, 39, 40, 150, 200, 320, 333, 900]:
        want = np.array([eq_11(ctx, a) for a in actions])
        np.testing.assert_allclose(table.step_ms_many(ctx, actions), want, rtol=1e-12)
        np.testing.assert_allclose(table.step_ms_many(ctx, passes), want, rtol=1e-12)
    one_point = LatencyTable([64], [4], [[2.0]], [[20.0]])  # a one-point grid holds its value everywhere
    assert one_point.step_ms(10, Action(2, 1, 3)) == pytest.approx(4 * 2.0 + 20.0)  # 2 single passes, 2 levels


@pytest.mark.parametrize(("change", "words"), [
    ({"target_ms": [[1.0]]}, "target_ms must hold 2 rows"),
    ({"draft_ms": [[1.0, -2.0], [1.0, 2.0]]}, "finite positive"),
    ({"sizes": [2, 1]}, "sizes must be a non-empty increasing"),
    ({"lengths": []}, "lengths must be"),
    ({"step_extra_ms": [1.0]}, "step_extra_ms must hold 2"),
    ({"colour": "red"}, "unknown colour"),
])
def test_a_table_that_cannot_be_read_is_refused_in_user_terms(change, words):
    data = {"lengths": [8, 32], "sizes": [1, 4], "draft_ms": [[1.0, 2.0], [1.5, 2.5]],
            "target_ms": [[5.0, 6.0], [7.0, 9.0]], **change}
    with pytest.raises(ValueError, match=words):
        LatencyTable.from_json(json.dumps(data))


def test_the_machines_table_is_measured_once_per_pair_and_machine(monkeypatch, tmp_path):
    """`--latency machine`: the first call measures and caches (saying so first), the next reads the cache; another
    pair, or a cached file that is not a table of this pair and machine, is measured anew."""
    from decode.cost.measure import MACHINE_SIZES, machine_table
    from decode.models.machine_cache import machine_identity

    target, draft = _recording_pair(monkeypatch)
    heard = []
    table, path = machine_table(target, draft, "f" * 64, tmp_path, heard.append)
    assert len(heard) == 1 and str(path) in heard[0] and path.parent == tmp_path
    assert table.pair == "f" * 64 and table.machine == machine_identity(target, draft)
    assert table.sizes == list(MACHINE_SIZES)
    passes = len(target.blocks)
    again, same = machine_table(target, draft, "f" * 64, tmp_path, heard.append)
    assert (again, same, len(heard), len(target.blocks)) == (table, path, 1, passes)  # read, not measured
    other, other_path = machine_table(target, draft, "0" * 64, tmp_path, heard.append)
    assert other_path != path and len(heard) == 2 and other.pair == "0" * 64
    path.write_text("{not json", encoding="utf-8")
    machine_table(target, draft, "f" * 64, tmp_path, heard.append)
    assert len(heard) == 3 and LatencyTable.from_json(path.read_text(encoding="utf-8")).pair == "f" * 64
    assert "measured again" in heard[2] and "measured again" not in heard[0]  # one line says why it measures


# --- what a batch's passes cost beyond the table (BatchCost) --------------------------------------------------------
def _batch_cost(target_at_4: float = 2.0, draft_at_4: float = 1.5):
    """Ratios 1 at one sequence; at four, ``target_at_4``/``draft_at_4`` at the longer context, half as much more at
    the shorter."""
    def grid(at_4: float) -> list:
        return [[[1.0, 1.0], [1.0, 1.0]], [[1 + (at_4 - 1) / 2] * 2, [at_4] * 2]]

    return BatchCost([1, 4], [64, 256], [1, 16], grid(draft_at_4), grid(target_at_4))


def test_a_batch_cost_prices_a_pass_beside_other_requests():
    table = LatencyTable(**{**TABLE.__dict__, "batch": _batch_cost()})
    assert table.batch_target(100, 5, 1) == pytest.approx(TABLE.target(100, 5))  # one sequence: the table's pass
    assert table.batch_target(256, 5, 4) == pytest.approx(2.0 * TABLE.target(256, 5))
    assert table.batch_draft(256, 5, 4) == pytest.approx(1.5 * TABLE.draft(256, 5))
    assert table.batch_target(64, 5, 4) == pytest.approx(1.5 * TABLE.target(64, 5))
    assert table.batch_target(256, 5, 2) == pytest.approx((1 + 1 / 3) * TABLE.target(256, 5))  # linear in R
    assert table.batch_target(256, 5, 8) == pytest.approx(2.0 * TABLE.target(256, 5))  # held past the grid
    assert TABLE.batch_target(256, 5, 4) == TABLE.target(256, 5)  # a table without batch costs prices none


def test_a_batch_cost_rides_in_the_tables_json_and_older_tables_still_read():
    table = LatencyTable(**{**TABLE.__dict__, "batch": _batch_cost()})
    again = LatencyTable.from_json(table.to_json())
    assert again == table and isinstance(again.batch, BatchCost)
    old = json.dumps({k: v for k, v in json.loads(TABLE.to_json()).items() if k != "batch"})  # written before it
    assert LatencyTable.from_json(old) == TABLE and LatencyTable.from_json(old).batch is None
    assert BatchCost.from_json(_batch_cost().to_json()) == _batch_cost()


@pytest.mark.parametrize("change, words", [
    ({"sequences": [2, 4]}, "start at 1"),
    ({"sizes": [4, 1]}, "sizes must be"),
    ({"target_ratio": [[[1.0, 1.0]]]}, "target_ratio must be 2 × 2 × 2"),
    ({"draft_ratio": [[[1.0, 1.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]}, "finite positive"),
    ({"colour": "red"}, "colour"),
])
def test_a_batch_cost_that_cannot_be_read_is_refused_in_user_terms(change, words):
    data = {**json.loads(_batch_cost().to_json()), **change}
    with pytest.raises(ValueError, match=words):
        BatchCost.from_json(json.dumps(data))


def test_measure_batch_cost_times_the_shared_caches_own_passes():
    target = CachedLM(tiny_llama(seed=1, vocab=32, hidden=32, layers=2))
    draft = CachedLM(tiny_llama(seed=2, vocab=32, hidden=32, layers=1))
    ticks = []
    cost = measure_batch_cost(target, draft, sequences=[2, 3], lengths=[8, 20], sizes=[1, 3, 4], repeats=2,
                              warmup=1, pair="p" * 64, tick=lambda: ticks.append(1))
    assert (cost.sequences, cost.lengths, cost.sizes, cost.pair) == ([1, 2, 3], [8, 20], [1, 3, 4], "p" * 64)
    assert cost.draft_ratio[0] == [[1.0] * 3] * 2 and cost.target_ratio[0] == [[1.0] * 3] * 2  # one sequence: 1
    assert all(v > 0 for plane in cost.target_ratio for row in plane for v in row)
    assert len(ticks) == 2 * 3 * 2  # each model's sweep at each length, per repeat (warm-up included)
    assert target.length == 0 and draft.length == 0 and target.slots.length == 0  # plain caches again
    target.prefill([1, 2, 3])  # the models decode on their own afterwards
    assert target.length == 3


def test_the_machines_batch_cost_is_measured_once_beside_its_table(monkeypatch, tmp_path):
    from decode.cost import measure as latency
    from decode.models.machine_cache import cache_file, machine_identity

    target = CachedLM(tiny_llama(seed=1, vocab=32, hidden=32, layers=2))
    draft = CachedLM(tiny_llama(seed=2, vocab=32, hidden=32, layers=1))
    monkeypatch.setattr(latency, "BATCH_LENGTHS", (8,))
    calls = []
    real = latency.measure_batch_cost
    monkeypatch.setattr(latency, "measure_batch_cost",
                        lambda *a, **k: calls.append(1) or real(*a, **{**k, "repeats": 1, "warmup": 0,
                                                                       "sequences": [2], "sizes": [1, 2]}))
    heard = []
    cost, path = latency.machine_batch_cost(target, draft, "f" * 64, tmp_path, heard.append)
    identity = machine_identity(target, draft)
    assert path == cache_file(tmp_path, "batch cost", "f" * 64, identity) and path.name.startswith("batch-")
    assert path != cache_file(tmp_path, "latency table", "f" * 64, identity)  # a file of its own beside the table
    assert cost.machine == identity and len(heard) == 1 and "batch cost" in heard[0]
    again, same = latency.machine_batch_cost(target, draft, "f" * 64, tmp_path, heard.append)
    assert (again, same, len(calls), len(heard)) == (cost, path, 1, 1)  # read, not measured


def test_a_table_is_keyed_by_the_attention_that_ran():
    """A table measured with stock sdpa (keys and values repeated per head under a mask) is not read for models that
    run ddte's grouped-heads attention, whose multi-row passes cost less; the kernel choice ignores it."""
    from decode.models.machine_cache import machine_identity

    target = CachedLM(tiny_llama(seed=1, vocab=32, hidden=32, layers=1))
    draft = CachedLM(tiny_llama(seed=2, vocab=32, hidden=32, layers=1))
    ours, choice = machine_identity(target, draft), machine_identity(target, draft, kernels=False)
    target.config._attn_implementation = "sdpa"
    assert machine_identity(target, draft) != ours and "ddte_sdpa" in ours
    assert machine_identity(target, draft, kernels=False) == choice
