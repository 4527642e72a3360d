"""Benchmark every verifier on CPU: microseconds per verification round and per exact-expectation call.

Trees are drafted from a synthetic pair with realistic, peaked distributions at each vocabulary size; p and q
are passed in the dtype a decoder would use (float32 by default). Each figure is the median over the sampled
trees and repeats, after a warm-up. Verifiers that are not lossless on a tree's regime are shown as '-'.

Example:
  ddte bench-verifiers --vocab 4096 32000 --shapes 4,0,8 4,2,6 1,8,0 --output verifier_bench.json
"""

from __future__ import annotations

import argparse
import json

from ddte.commands.common import (
    UserError,
    add_threads_argument,
    apply_threads,
    check_output_file,
    user_errors,
)
from ddte_core.paths import staged_file

MAX_VOCAB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000], help="vocabulary sizes")
    parser.add_argument(
        "--shapes", nargs="+", default=["4,0,8", "4,2,6", "1,8,0", "wor:4,1,1,1,1,1,1,1"],
        help="tree shapes: K,L1,L2 (delayed) or wor:B1,B2,... (per-node without replacement)",
    )
    parser.add_argument("--verifiers", nargs="+", default=None, help="verifier names (default: all)")
    parser.add_argument("--samples", type=int, default=10, help="trees drafted per case")
    parser.add_argument("--timed-calls", type=int, default=5, help="timed calls per tree")
    parser.add_argument("--prob-dtype", choices=["float32", "float64"], default="float32",
                        help="dtype of the distributions p and q")
    add_threads_argument(parser)
    parser.add_argument("--output", default=None, help="also write the rows and environment as JSON here")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from bench.verifiers import GOAL_MS, bench_case, format_table, parse_tree_spec
    from ddte_core.machine import environment
    from decode.verifiers import get_verifier, verifier_names

    names = args.verifiers or verifier_names()
    with user_errors():
        for name in names:
            get_verifier(name)
        for spec in args.shapes:
            parse_tree_spec(spec)
    if min(args.vocab) < 2 or args.samples < 1 or args.timed_calls < 1:
        raise UserError("--vocab must be >= 2 and --samples, --timed-calls >= 1")
    if max(args.vocab) > MAX_VOCAB:  # the synthetic laws are dense (nodes × V): beyond this they outgrow memory
        raise UserError(f"--vocab must be at most {MAX_VOCAB} (the largest real vocabularies), got {max(args.vocab)}")
    for spec in args.shapes:  # distinct children cannot outnumber the vocabulary
        kind, numbers = parse_tree_spec(spec)
        if kind == "wor" and max(numbers) > min(args.vocab):
            raise UserError(f"--shapes {spec}: a without-replacement level draws at most --vocab {min(args.vocab)} "
                            f"distinct children, not {max(numbers)}")
    output = check_output_file(args.output) if args.output else None
    apply_threads(args.threads)
    dtype = getattr(torch, args.prob_dtype)
    cases = [(n, t, v) for v in args.vocab for t in args.shapes for n in names]
    rows = [
        bench_case(n, t, v, args.samples, args.timed_calls, dtype) for n, t, v in tqdm(cases, desc="bench", unit="case")
    ]
    print(format_table(rows))
    worst = max((r.verify_us for r in rows if r.vocab == 32000 and r.verify_us is not None), default=None)
    if worst is not None:
        verdict = "meets" if worst <= GOAL_MS * 1000 else "misses"
        print(f"\nslowest verification at V=32000: {worst / 1000:.2f} ms ({verdict} the {GOAL_MS:.0f} ms goal)")
    if output is not None:
        from dataclasses import asdict

        payload = {"environment": environment(), "dtype": args.prob_dtype, "rows": [asdict(r) for r in rows]}
        with staged_file(output) as tmp, tmp.open("w") as f:
            json.dump(payload, f, indent=2)
    return 0
