"""The latency model of algorithms.md §3.5: measured pass times and the step time T̂ of an action.

A :class:`LatencyTable` holds, on a grid of context lengths l and block sizes n, the median wall time of one
draft pass and one target pass that run n new tokens over a cache of l tokens. The step time of an action
(K, L1, L2) at context length l is (Eq. 11, with the block size made explicit):

    T̂ = Σ_{j<L1} t_q(l + j, 1) + Σ_{j<L2} t_q(l + L1 + j·K, K) + t_p(l, 1 + L1 + K·L2)

The draft runs the trunk one token at a time, then the K branches as one block per level. The target runs the
root and the whole tree in one pass. Between grid points the table interpolates linearly; beyond the grid it
holds the edge value.
"""

from __future__ import annotations

import json
import statistics
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass

import torch

from decode.drafting import Action
from decode.models import CachedLM


@dataclass
class LatencyTable:
    """Median pass times in milliseconds: ``draft_ms[i][j]``/``target_ms[i][j]`` at ``lengths[i]``, ``sizes[j]``."""

    lengths: list[int]
    sizes: list[int]
    draft_ms: list[list[float]]
    target_ms: list[list[float]]
    device: str = "cpu"

    def draft(self, length: float, size: int = 1) -> float:
        return _interpolate_2d(self.lengths, self.sizes, self.draft_ms, length, size)

    def target(self, length: float, size: int = 1) -> float:
        return _interpolate_2d(self.lengths, self.sizes, self.target_ms, length, size)

    def pass_times(self, length: int) -> tuple[float, float]:
        """(draft ms, target ms) of a one-token pass at this context length (a root feature)."""
        return self.draft(length, 1), self.target(length, 1)

    def step_ms(self, length: int, action: Action) -> float:
        """T̂ of one step with this action at context length ``length`` (Eq. 11)."""
        k = action.k if action.l2 > 0 else 0
        drafting = sum(self.draft(length + j, 1) for j in range(action.l1))
        drafting += sum(self.draft(length + action.l1 + j * k, k) for j in range(action.l2))
        return drafting + self.target(length, 1 + action.size)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LatencyTable:
        return cls(**json.loads(text))


def _interpolate_1d(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_left(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def _interpolate_2d(lengths, sizes, grid, length, size) -> float:
    by_size = [_interpolate_1d(lengths, [row[j] for row in grid], length) for j in range(len(sizes))]
    return _interpolate_1d(sizes, by_size, size)


def measure_latency(
    target: CachedLM,
    draft: CachedLM,
    lengths: list[int] = (32, 128, 256, 480),
    sizes: list[int] = (1, 4, 16, 33),
    repeats: int = 7,
    warmup: int = 2,
) -> LatencyTable:
    """Time one pass of each model per (context length, block size) with a warm-up; median over ``repeats``.

    Each timed pass appends a speculative block (a K-wide level for the draft, a tree block for the target) to a
    cache of ``length`` committed random tokens and is rolled back afterwards, so every repeat sees the same cache.
    """
    limit = min(_limit(target), _limit(draft))
    lengths = sorted({min(int(x), limit - max(sizes) - 1) for x in lengths})
    vocab = min(target.vocab_size, draft.vocab_size)
    g = torch.Generator().manual_seed(0)
    grids = {"draft": [], "target": []}
    for name, model in (("draft", draft), ("target", target)):
        for length in lengths:
            model.prefill(torch.randint(0, vocab, (length,), generator=g).tolist())
            row = []
            for size in sizes:
                tokens = torch.randint(0, vocab, (size,), generator=g).tolist()
                parents = [model.length - 1] * size  # a level of siblings: the same attention cost as a tree
                times = []
                for i in range(warmup + repeats):
                    start = time.perf_counter()
                    model.extend_tree(tokens, parents)
                    if model.device.type == "cuda":
                        torch.cuda.synchronize()
                    if i >= warmup:
                        times.append((time.perf_counter() - start) * 1e3)
                    model.commit([])
                row.append(statistics.median(times))
            grids[name].append(row)
        model.reset()
    return LatencyTable(list(lengths), list(sizes), grids["draft"], grids["target"], str(target.device))


def _limit(model: CachedLM) -> int:
    return int(getattr(model.config, "max_position_embeddings", 1 << 30))
