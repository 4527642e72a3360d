"""Benchmark every verifier on CPU: microseconds per verification round and per exact-expectation call.

Trees are drafted from a synthetic pair with realistic, peaked distributions (decode.synthetic) at each
vocabulary size; p and q are passed in the dtype a decoder would use (float32 by default). Each figure is
the median over the sampled trees and repeats, after a warm-up. Verifiers that are not lossless on a tree's
regime are shown as '-'.

Example:
  ddte bench-verifiers --vocab 4096 32000 --trees 4,0,8 4,2,6 1,8,0 --output verifier_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from decode.rng import TorchRandom
from decode.synthetic import SyntheticPair, draft_delayed, draft_without_replacement
from decode.tree import DraftTree
from decode.verifiers import get_verifier, verifier_names

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
        from ddte.cli import UserError

        raise UserError(f"bad tree spec '{spec}': expected K,L1,L2 or wor:B1,B2,...") from err
    if kind not in ("delayed", "wor") or (kind == "delayed" and len(numbers) != 3) or min(numbers) < 0:
        from ddte.cli import UserError

        raise UserError(f"bad tree spec '{spec}': expected K,L1,L2 (K >= 1) or wor:B1,B2,...")
    if kind == "delayed" and numbers[0] < 1:
        from ddte.cli import UserError

        raise UserError(f"bad tree spec '{spec}': K must be >= 1")
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


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000], help="vocabulary sizes")
    parser.add_argument(
        "--trees", nargs="+", default=["4,0,8", "4,2,6", "1,8,0", "wor:4,1,1,1,1,1,1,1"],
        help="tree shapes: K,L1,L2 (delayed) or wor:B1,B2,... (per-node without replacement)",
    )
    parser.add_argument("--verifiers", nargs="+", default=None, help="verifier names (default: all)")
    parser.add_argument("--samples", type=int, default=10, help="trees drafted per case")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per tree")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="dtype of p and q")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: verification is many small vector ops that a thread pool slows down)",
    )
    parser.add_argument("--output", default=None, help="also write the rows and environment as JSON here")


def run(args: argparse.Namespace) -> int:
    from ddte.cli import UserError

    names = args.verifiers or verifier_names()
    for name in names:
        try:
            get_verifier(name)
        except KeyError as err:
            raise UserError(err.args[0]) from err
    for spec in args.trees:
        parse_tree_spec(spec)
    if min(args.vocab) < 2 or args.samples < 1 or args.repeats < 1 or args.threads < 1:
        raise UserError("--vocab must be >= 2 and --samples, --repeats, --threads >= 1")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cases = [(n, t, v) for v in args.vocab for t in args.trees for n in names]
    rows = [
        bench_case(n, t, v, args.samples, args.repeats, dtype) for n, t, v in tqdm(cases, desc="bench", unit="case")
    ]
    print(format_table(rows))
    worst = max((r.verify_us for r in rows if r.vocab == 32000 and r.verify_us is not None), default=None)
    if worst is not None:
        verdict = "meets" if worst <= GOAL_MS * 1000 else "misses"
        print(f"\nslowest verification at V=32000: {worst / 1000:.2f} ms ({verdict} the {GOAL_MS:.0f} ms goal)")
    if args.output:
        payload = {"environment": environment(), "dtype": args.dtype, "rows": [asdict(r) for r in rows]}
        tmp = f"{args.output}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2)
        os.replace(tmp, args.output)
    return 0
