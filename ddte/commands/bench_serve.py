"""`ddte serve` under concurrent load: aggregate output tokens/s, TPOT and TTFT per number of clients, one request at
a time (--max-batch 1) against continuous batching (--max-batch N).

For each --max-batch value a live `ddte serve` is started on a free loopback port (its kernel line kept), and for
each --clients level that many clients of the real `openai` package stream the level's --requests back to back
(each level the same requests, so one client's TPOT is comparable with many clients'). Prints a markdown table;
--output writes the levels as JSON (with the machine and the servers' lines) and a PNG plot beside it.
--against-generate N first times N requests direct (the decoder as `ddte serve` opens it) against the same requests
through a --max-batch 1 server. Time it alone on the machine: the server and the clients
share its cores.

Examples:
  ddte bench-serve --max-batch 1 4 --clients 1 2 4 8 --output results/serve/sweep_shipped.json
  ddte bench-serve --pair qwen-coder --threads 1 --max-batch 1 4 --clients 1 4 --requests 4
"""

from __future__ import annotations

import argparse
import functools
import json

from ddte.commands.common import (
    UserError,
    add_kernels_argument,
    check_kernels_argument,
    check_output_file,
    user_errors,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", default="shipped", help="the pair `ddte serve --pair` takes (default: shipped)")
    parser.add_argument("--method", default="traversal@1,3,0", metavar="VERIFIER@SPEC",
                        help="the method `ddte serve --method` takes (default: traversal@1,3,0)")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch CPU threads")
    add_kernels_argument(parser)
    parser.add_argument("--max-batch", type=int, nargs="+", default=[1, 4], help="the servers' --max-batch values")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrency levels")
    parser.add_argument("--requests", type=int, default=8,
                        help="requests per level, the same at every level (at least one per client)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--against-generate", type=int, default=0, metavar="N",
                        help="first, N requests direct against the same through a --max-batch 1 server (0: skip)")
    parser.add_argument("--output", default=None, help="the levels as JSON here, and a PNG plot beside it")


def run(args: argparse.Namespace) -> int:
    import math

    from bench.serve_load import LoadPlan, against_generate, as_json, check_plan, markdown_table, plot, sweep
    from ddte.serve.requests import MAX_TEMPERATURE
    from ddte_core.machine import environment
    from ddte_core.paths import staged_file

    if min(args.max_batch) < 1 or min(args.clients) < 1 or args.requests < 1 or args.max_new_tokens < 1:
        raise UserError("--max-batch, --clients, --requests and --max-new-tokens must be >= 1")
    if args.threads < 1 or args.against_generate < 0:
        raise UserError("--threads must be >= 1 and --against-generate >= 0")
    check_kernels_argument(args.kernels)
    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= MAX_TEMPERATURE):
        raise UserError(f"--temperature must be in [0, {MAX_TEMPERATURE:g}] (what the server takes), got "
                        f"{args.temperature}")
    output = check_output_file(args.output) if args.output is not None else None
    plan = LoadPlan(args.pair, args.method, args.threads, args.kernels, tuple(args.max_batch), tuple(args.clients),
                    args.requests, args.max_new_tokens, args.temperature)
    with user_errors(ValueError, OSError, KeyError):  # what the server would refuse once running, asked first
        check_plan(plan)
    out: dict = environment() | {"pair": args.pair, "method": args.method, "threads": args.threads,
                                 "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                 "requests_per_level": args.requests}
    if args.against_generate:
        import torch

        torch.set_num_threads(args.threads)
        with_server = against_generate(plan, args.against_generate, progress=print)
        print(f"one request at a time: direct {with_server['direct_tokens_per_s']:.1f} tokens/s, server "
              f"{with_server['server_tokens_per_s']:.1f}; server / direct {with_server['ratio']:.3f} "
              f"[{with_server['interval_95'][0]:.3f}, {with_server['interval_95'][1]:.3f}]", flush=True)
        out["server_vs_generate"] = with_server
    with_print = functools.partial(print, flush=True)
    print(markdown_table([]), flush=True)
    try:
        levels, printed = sweep(plan, progress=with_print)
    except RuntimeError as err:
        raise UserError(str(err)) from err
    print("\n" + markdown_table(levels))
    for max_batch, lines in printed.items():
        print(f"server --max-batch {max_batch}: " + " | ".join(lines))
    out |= {"levels": as_json(levels), "server_lines": {str(k): v for k, v in printed.items()}}
    if output is not None:
        with staged_file(output) as staged:
            staged.write_text(json.dumps(out, indent=2) + "\n")
        plot(levels, str(output.with_suffix(".png")), f"ddte serve, {args.pair}, {args.method}, {out['cpu']}")
        print(f"wrote {output} and {output.with_suffix('.png')}")
    return 0
