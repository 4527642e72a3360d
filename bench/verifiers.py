"""Every verifier on synthetic trees: microseconds per verification round and per exact-expectation call.

Trees are drafted from a synthetic pair with realistic, peaked distributions (bench/synthetic_pair.py) at each
vocabulary size; p and q are passed in the dtype a decoder would use (float32 by default). Each figure is
the median over the sampled trees and repeats, after a warm-up. Verifiers that are not lossless on a tree's
regime get no figure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bench.synthetic_pair import SyntheticPair, draft_delayed, draft_without_replacement
from decode.drafting.rng import TorchRandom
from decode.drafting.tree import DraftTree
from decode.verifiers import get_verifier

GOAL_MS = 2.0  # issue goal: every verifier <= 2 ms per verification at V = 32000 on the 2-core CPU


@dataclass
class BenchRow:
    verifier: str
    tree: str
    vocab: int
    verify_us: float | None
    expected_us: float | None


def parse_tree_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """'K,L1,L2' for a delayed tree, or 'wor:4,1,1' for a without-replacement tree with that branching."""
    kind, _, rest = spec.partition(":") if ":" in spec else ("delayed", "", spec)
    try:
        numbers = tuple(int(x) for x in rest.split(","))
    except ValueError as err:
        raise ValueError(f"bad tree spec '{spec}': expected K,L1,L2 or wor:B1,B2,...") from err
    if kind not in ("delayed", "wor") or (kind == "delayed" and len(numbers) != 3) or min(numbers) < 0:
        raise ValueError(f"bad tree spec '{spec}': expected K,L1,L2 (K >= 1) or wor:B1,B2,...")
    if kind == "delayed" and numbers[0] < 1:
        raise ValueError(f"bad tree spec '{spec}': K must be >= 1")
    if kind == "wor" and min(numbers) < 1:
        raise ValueError(f"bad tree spec '{spec}': every level of a without-replacement tree needs B >= 1 children")
    return kind, numbers


def draft_tree(pair: SyntheticPair, spec: str, rng: TorchRandom) -> DraftTree:
    kind, numbers = parse_tree_spec(spec)
    if kind == "delayed":
        return draft_delayed(pair.next_q, *numbers, rng)
    return draft_without_replacement(pair.next_q, numbers, rng)


def time_call(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in microseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bench_case(name: str, spec: str, vocab: int, trees: int, repeats: int, dtype: torch.dtype) -> BenchRow:
    verifier = get_verifier(name)
    pair = SyntheticPair(vocab=vocab, seed=vocab)
    rng = TorchRandom(0)
    samples = []
    for _ in range(trees):
        tree = draft_tree(pair, spec, rng)
        if not verifier.supports(tree):
            return BenchRow(name, spec, vocab, None, None)
        p, q = pair.tree_rows(tree)
        samples.append((tree, p.to(dtype), q.to(dtype)))
    for tree, p, q in samples[:2]:  # warm-up
        verifier.verify(tree, p, q, rng)
        verifier.expected_block_efficiency(tree, p, q)
    verify_times, expected_times = [], []
    for tree, p, q in samples:
        verify_times.append(time_call(lambda t=tree, a=p, b=q: verifier.verify(t, a, b, rng), repeats))
        expected_times.append(time_call(lambda t=tree, a=p, b=q: verifier.expected_block_efficiency(t, a, b), repeats))
    return BenchRow(name, spec, vocab, statistics.median(verify_times), statistics.median(expected_times))


def format_table(rows: list[BenchRow]) -> str:
    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    lines = [
        "| verifier | tree | V | verify (µs) | exact E[τ+1] (µs) |",
        "|---|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.verifier} | {r.tree} | {r.vocab} | {cell(r.verify_us)} | {cell(r.expected_us)} |")
    return "\n".join(lines)
