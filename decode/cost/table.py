"""The latency model of algorithms.md §3.5: measured pass times and the step time T̂ of an action.

A :class:`LatencyTable` holds, on a grid of context lengths l and block sizes n, the median wall time of one
draft pass and one target pass that run n new tokens over a cache of l tokens. The step time of an action
(K, L1, L2) at context length l is Eq. 11 with the block size made explicit, summed over the draft passes the loop
runs, plus one per-step term:

    T̂ = c(l) + Σ_{j<S} t_q(l + j, 1) + Σ_{j<B} t_q(l + S + j·K, K) + t_p(l, 1 + L1 + K·L2)

The draft runs the root and the trunk one token at a time (S = 1 + L1 passes with branches, max(1, L1) without),
then the K branches as one block per level that has children (B = L2 − 1); :func:`draft_passes` says how this
differs from the paper's count. The target runs the root and the whole tree in one pass. Between grid points the
table interpolates linearly; beyond the grid it holds the edge value. c(l) is what the loop pays once per step on
top (its cache-cold first draft pass); decode/cost/measure.py says how every time is measured.

A batch (decode/batch.py) runs its passes through one cache that holds every request, where each query attends over
every request's slots: a :class:`BatchCost`, measured once per machine through that cache's own passes and cached
beside the table, says how much dearer such a pass is than the table's one-sequence pass of as many tokens, by the
requests in the cache, their context and the pass size (``LatencyTable.batch``, read by the shared budget).

This module needs numpy only: reading a table or pricing a step imports no torch.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from decode.drafting.actions import Action


@dataclass
class LatencyTable:
    """Median pass times in milliseconds: ``draft_ms[i][j]``/``target_ms[i][j]`` at ``lengths[i]``, ``sizes[j]``;
    ``step_extra_ms[i]`` is c(l) at ``lengths[i]``, the per-step cost of the cache-cold first draft pass (empty in
    tables measured before it was: c = 0)."""

    lengths: list[int]
    sizes: list[int]
    draft_ms: list[list[float]]
    target_ms: list[list[float]]
    device: str = "cpu"
    step_extra_ms: list[float] = field(default_factory=list)
    pair: str = ""  # the fingerprint of the pair it timed ("" in tables that did not record it)
    machine: str = ""  # what it was measured on: the CPU model (or GPU name), torch threads, the models' dtypes
    batch: BatchCost | None = None  # what a batch's pass costs beyond these (:class:`BatchCost`); None: nothing known

    def __post_init__(self) -> None:
        """ValueError, in user terms, for a table that cannot be read: the grids must be increasing integers (sizes
        >= 1) and each time table a lengths × sizes grid of finite positive milliseconds."""
        for name, low in (("lengths", 0), ("sizes", 1)):
            grid = getattr(self, name)
            if not isinstance(grid, list) or not grid or not all(isinstance(v, int) and v >= low for v in grid) \
                    or any(b <= a for a, b in zip(grid, grid[1:], strict=False)):
                raise ValueError(f"latency table: {name} must be a non-empty increasing list of integers >= {low}")
        shape = (len(self.lengths), len(self.sizes))
        for name in ("draft_ms", "target_ms"):
            table = getattr(self, name)
            if not isinstance(table, list) or len(table) != shape[0] or any(
                    not isinstance(row, list) or len(row) != shape[1] for row in table):
                raise ValueError(f"latency table: {name} must hold {shape[0]} rows (lengths) of {shape[1]} "
                                 "values (sizes)")
            if not all(isinstance(v, int | float) and 0 < v < float("inf") for row in table for v in row):
                raise ValueError(f"latency table: {name} must hold finite positive milliseconds")
        if self.step_extra_ms and (len(self.step_extra_ms) != shape[0] or not all(
                isinstance(v, int | float) and 0 <= v < float("inf") for v in self.step_extra_ms)):
            raise ValueError(f"latency table: step_extra_ms must hold {shape[0]} finite values >= 0 (one per length)")
        if isinstance(self.batch, dict):  # as JSON holds it
            self.batch = BatchCost(**self.batch)
        if self.batch is not None and not isinstance(self.batch, BatchCost):
            raise ValueError("latency table: batch must be a batch cost object or null")

    def draft(self, length: float, size: int = 1) -> float:
        return _interpolate_2d(self.lengths, self.sizes, self.draft_ms, length, size)

    def target(self, length: float, size: int = 1) -> float:
        return _interpolate_2d(self.lengths, self.sizes, self.target_ms, length, size)

    def batch_draft(self, length: float, size: int, sequences: int) -> float:
        """ms of a draft pass of ``size`` tokens through a cache that holds ``sequences`` requests of ``length``
        tokens each (a batch's, decode/models/shared_cache.py): the one-sequence pass times its :class:`BatchCost`
        ratio (1 for one sequence, or for a table without one)."""
        ratio = 1.0 if self.batch is None else self.batch.draft(sequences, length, size)
        return self.draft(length, size) * ratio

    def batch_target(self, length: float, size: int, sequences: int) -> float:
        """ms of a target pass of ``size`` tokens through ``sequences`` requests' cache, as :meth:`batch_draft`."""
        ratio = 1.0 if self.batch is None else self.batch.target(sequences, length, size)
        return self.target(length, size) * ratio

    def step_extra(self, length: float) -> float:
        """c(l): the per-step term of T̂ (0 for a table without one)."""
        if not self.step_extra_ms:
            return 0.0
        return float(np.interp(length, self.lengths, self.step_extra_ms))  # linear, held at the grid's edges

    def pass_times(self, length: int) -> tuple[float, float]:
        """(draft ms, target ms) of a one-token pass at this context length (a root feature)."""
        return self.draft(length, 1), self.target(length, 1)

    def step_ms(self, length: int, action: Action) -> float:
        """T̂ of one step with this action at context length ``length``."""
        return float(self.step_ms_many(length, [action])[0])

    def step_ms_many(self, length: int, actions: Sequence[Action] | DraftPasses) -> np.ndarray:
        """``(A,)`` T̂ of every action at context length ``length``, in one vectorised pass.

        A selector weighs all 324 actions at a root, where a Python lookup per draft pass costs milliseconds. A caller
        that asks often passes :func:`draft_passes` of its action list, built once.
        """
        passes = actions if isinstance(actions, DraftPasses) else draft_passes(actions)
        draft = _interpolate_many(self.lengths, self.sizes, self.draft_ms, length + passes.offsets, passes.sizes)
        drafting = np.bincount(passes.owner, weights=draft, minlength=len(passes.tree_sizes))
        at_root = np.full(len(passes.tree_sizes), length)
        verifying = _interpolate_many(self.lengths, self.sizes, self.target_ms, at_root, passes.tree_sizes)
        return self.step_extra(length) + drafting + verifying

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LatencyTable:
        """The table of a JSON text; ValueError naming what is wrong (not JSON, missing or unknown keys, a shape)."""
        data = _json_object(text, "latency table")
        needed = {"lengths", "sizes", "draft_ms", "target_ms"}
        known = needed | {"device", "step_extra_ms", "pair", "machine", "batch"}
        if not needed <= set(data) or not set(data) <= known:
            missing, unknown = sorted(needed - set(data)), sorted(set(data) - known)
            raise ValueError("latency table: " + "; ".join(
                part for part in (f"missing {', '.join(missing)}" if missing else "",
                                  f"unknown {', '.join(unknown)}" if unknown else "") if part))
        return cls(**data)

    def check_pair(self, fingerprint: str, where: str = "latency table") -> None:
        """ValueError when the table records another pair than ``fingerprint`` (a table that records none passes)."""
        if self.pair and self.pair != fingerprint:
            raise ValueError(f"{where}: measured on another pair (fingerprint {self.pair[:12]}…, this pair's "
                             f"{fingerprint[:12]}…)")


@dataclass
class BatchCost:
    """What a pass costs through a batch's cache, as a ratio to the table's one-sequence pass of as many tokens.

    A batch keeps its requests as sequences of one cache (decode/models/shared_cache.py): each pass attends over every
    request's slots (masked), so a pass of n tokens beside R requests of l tokens each costs more than the table's
    pass of n tokens after one request of l. ``draft_ratio[r][i][j]``/``target_ratio[r][i][j]``: the median over
    repeats of (a pass of ``sizes[j]`` tokens spread over ``sequences[r]`` requests of ``lengths[i]`` tokens each) ÷
    (the same pass after one request of ``lengths[i]``), both through the shared cache's own run path and timed as
    the table times a pass (:func:`measure_batch_cost`). ``sequences`` starts at 1, whose ratios are 1. Between grid
    points the ratios interpolate linearly; beyond the grid they hold the edge value (so past the largest batch
    measured they underprice).
    """

    sequences: list[int]
    lengths: list[int]
    sizes: list[int]
    draft_ratio: list[list[list[float]]]
    target_ratio: list[list[list[float]]]
    pair: str = ""
    machine: str = ""

    def __post_init__(self) -> None:
        """ValueError, in user terms, for ratios that cannot be read: increasing integer grids (``sequences`` from 1)
        and each ratio grid sequences × lengths × sizes of finite positive values."""
        for name, low in (("sequences", 1), ("lengths", 0), ("sizes", 1)):
            grid = getattr(self, name)
            if not isinstance(grid, list) or not grid or not all(isinstance(v, int) and v >= low for v in grid) \
                    or any(b <= a for a, b in zip(grid, grid[1:], strict=False)):
                raise ValueError(f"batch cost: {name} must be a non-empty increasing list of integers >= {low}")
        if self.sequences[0] != 1:
            raise ValueError("batch cost: sequences must start at 1 (the one-sequence pass every ratio divides by)")
        shape = (len(self.sequences), len(self.lengths), len(self.sizes))
        for name in ("draft_ratio", "target_ratio"):
            grid = getattr(self, name)
            if not isinstance(grid, list) or len(grid) != shape[0] or any(
                    not isinstance(plane, list) or len(plane) != shape[1]
                    or any(not isinstance(row, list) or len(row) != shape[2] for row in plane) for plane in grid):
                raise ValueError(f"batch cost: {name} must be {shape[0]} × {shape[1]} × {shape[2]} (sequences × "
                                 "lengths × sizes)")
            if not all(isinstance(v, int | float) and 0 < v < float("inf") for plane in grid for row in plane
                       for v in row):
                raise ValueError(f"batch cost: {name} must hold finite positive ratios")

    def draft(self, sequences: int, length: float, size: float) -> float:
        """The draft pass's ratio with ``sequences`` requests in the cache, ``length`` tokens each, ``size`` new."""
        return _interpolate_3d(self.sequences, self.lengths, self.sizes, self.draft_ratio, sequences, length, size)

    def target(self, sequences: int, length: float, size: float) -> float:
        """The target pass's ratio, as :meth:`draft`."""
        return _interpolate_3d(self.sequences, self.lengths, self.sizes, self.target_ratio, sequences, length, size)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BatchCost:
        """The ratios of a JSON text; ValueError naming what is wrong."""
        data = _json_object(text, "batch cost")
        try:
            return cls(**data)
        except TypeError as err:
            raise ValueError(f"batch cost: {err}") from err


def _json_object(text: str, what: str) -> dict:
    """The JSON object ``text`` holds; ValueError starting with ``what`` for anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what}: not JSON ({err.msg})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object")
    return data


def _interpolate_3d(sequences, lengths, sizes, grid, count, length, size) -> float:
    """:func:`_interpolate_2d` on the two planes around ``count`` sequences, then linearly between them."""
    r0, r1, wr = _bracket(sequences, count)
    low = _interpolate_2d(lengths, sizes, grid[r0], length, size)
    return low + (_interpolate_2d(lengths, sizes, grid[r1], length, size) - low) * wr


def _bracket(xs: list[int], x: float) -> tuple[int, int, float]:
    """Indices (i0, i1) of the grid points around x and the weight of i1; held at the edges."""
    if x <= xs[0]:
        return 0, 0, 0.0
    if x >= xs[-1]:
        return len(xs) - 1, len(xs) - 1, 0.0
    i = bisect_left(xs, x)
    return i - 1, i, (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _interpolate_2d(lengths, sizes, grid, length, size) -> float:
    """Bilinear interpolation of ``grid[length index][size index]``, reading only the four cells around the point
    (the size grid is dense, 41 points by default, and T̂ of 324 actions needs thousands of lookups)."""
    i0, i1, wi = _bracket(lengths, length)
    j0, j1, wj = _bracket(sizes, size)

    def at(j: int) -> float:
        return grid[i0][j] + (grid[i1][j] - grid[i0][j]) * wi

    return at(j0) + (at(j1) - at(j0)) * wj


@dataclass(frozen=True)
class DraftPasses:
    """The draft passes of an action list, flattened: pass i of action ``owner[i]`` runs ``sizes[i]`` tokens at
    ``offsets[i]`` tokens past the root's context; ``tree_sizes[a]`` is action a's target block, root included."""

    offsets: np.ndarray  # (P,) int
    sizes: np.ndarray  # (P,) int
    owner: np.ndarray  # (P,) int
    tree_sizes: np.ndarray  # (A,) int


def draft_passes(actions: Sequence[Action]) -> DraftPasses:
    """The draft passes the decoding loop runs for each action, flattened for :meth:`LatencyTable.step_ms_many`.

    One token at a time: the root (the last step's pending token, whose q the first draw needs) and every trunk
    node with a child, so 1 + L1 passes when L2 > 0 and max(1, L1) when L2 = 0. Then one K-token pass per branch
    level with children: L2 − 1 (the last level is leaves). Eq. 11 counts L1 one-token and L2 K-token passes: the same
    number for trees with branches, with a K-wide pass where the loop runs the trunk's tip alone; for a chain it
    leaves out the root's pass, which a 2-token draft pass does not price as a one-token one.
    """
    offsets: list[int] = []
    sizes: list[int] = []
    owner: list[int] = []
    for a, action in enumerate(actions):
        singles = 1 + action.l1 if action.l2 > 0 else max(1, action.l1)
        levels = max(0, action.l2 - 1)
        offsets += list(range(singles)) + [singles + j * action.k for j in range(levels)]
        sizes += [1] * singles + [action.k] * levels
        owner += [a] * (singles + levels)
    tree_sizes = [1 + action.size for action in actions]
    return DraftPasses(*(np.array(xs, dtype=np.int64) for xs in (offsets, sizes, owner, tree_sizes)))


def _brackets(xs: list[int], x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_bracket` for an array of points: indices (i0, i1) and weights of i1, held at the edges."""
    grid = np.asarray(xs, dtype=np.float64)
    if len(grid) == 1:
        zero = np.zeros(np.shape(x), dtype=np.int64)
        return zero, zero, np.zeros(np.shape(x))
    x = np.clip(np.asarray(x, dtype=np.float64), grid[0], grid[-1])
    i1 = np.clip(np.searchsorted(grid, x, side="left"), 1, len(grid) - 1)
    i0 = i1 - 1
    return i0, i1, (x - grid[i0]) / (grid[i1] - grid[i0])


def _interpolate_many(lengths, sizes, grid, length: np.ndarray, size: np.ndarray) -> np.ndarray:
    """:func:`_interpolate_2d` at arrays of points (same bilinear rule, same edge holding)."""
    table = np.asarray(grid, dtype=np.float64)
    i0, i1, wi = _brackets(lengths, length)
    j0, j1, wj = _brackets(sizes, size)
    low = table[i0, j0] + (table[i1, j0] - table[i0, j0]) * wi
    high = table[i0, j1] + (table[i1, j1] - table[i0, j1]) * wi
    return low + (high - low) * wj
