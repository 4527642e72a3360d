"""Two checkouts of ddte decoding the same requests, interleaved prompt by prompt: does a change cost tokens/s?

Each checkout runs in a process of its own (its folder first on ``sys.path``), loads the pair once and answers
requests over stdin; the driver sends every prompt to both, the methods and checkouts in a rotating order, so the
CPU's drift reaches both alike. Each request is seeded by its prompt's index, so the two decode the same tokens
until their floats part. Prints each request's rate as it ends and, at the end, per method: both checkouts'
tokens/s (total new tokens over total wall time, prefill included), the ratio with a paired bootstrap interval over
prompts, and how many prompts gave the same tokens; ``--output`` keeps every request as JSON.

Example (the checkout before a change in a worktree beside this one):
  git worktree add /tmp/before HEAD~1
  taskset -c 1 python -m bench.checkouts /tmp/before . --methods traversal@1,3,0 --num-prompts 12 --output ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path


def serve_requests(pair: str, methods: list[str]) -> None:
    """The worker: open ``methods`` on ``pair`` (one torch thread), then answer one JSON request per stdin line."""
    import torch

    torch.set_num_threads(1)
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.session import PairRequest, open_sessions

    session = open_sessions(PairRequest(pair), methods, "auto", "machine")
    print(json.dumps({"lines": list(session.lines)}), flush=True)
    decodings = {m.text: d for m, d in session.decodings.items()}
    for line in sys.stdin:
        ask = json.loads(line)
        decoding = decodings[ask["method"]]
        start = time.perf_counter()
        generation = decoding.decoder.generate(ask["ids"], ask["max_new"], decoding.policy, TorchRandom(ask["seed"]),
                                               SamplingConfig(ask["temperature"]))
        print(json.dumps({"wall": time.perf_counter() - start, "tokens": generation.tokens,
                          "steps": generation.stats.steps}), flush=True)


class Checkout:
    """A worker process over one checkout."""

    def __init__(self, root: Path, pair: str, methods: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
        # this file runs as the worker whatever the checkout holds; its folder first on the path for ddte's packages
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--pair", pair,
                                         "--methods", *methods], cwd=root, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.lines = json.loads(self.process.stdout.readline())["lines"]

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())


def paired_ratio(rows: list[dict], method: str, seed: int = 0) -> dict:
    """New over old tokens/s for ``method`` over the prompts, with a 95 % paired bootstrap interval."""
    runs = {(r["checkout"], r["prompt"]): r for r in rows if r["method"] == method}
    prompts = sorted({p for _, p in runs})

    def rate(which: str, chosen: list[int]) -> float:
        return sum(len(runs[which, p]["tokens"]) for p in chosen) / sum(runs[which, p]["wall"] for p in chosen)

    rng = random.Random(seed)
    boots = sorted(rate("new", s) / rate("old", s) for s in ([rng.choice(prompts) for _ in prompts]
                                                              for _ in range(2000)))
    return {"method": method, "old_tokens_per_s": rate("old", prompts), "new_tokens_per_s": rate("new", prompts),
            "ratio": rate("new", prompts) / rate("old", prompts), "interval": [boots[50], boots[1949]],
            "same_tokens": sum(runs["old", p]["tokens"] == runs["new", p]["tokens"] for p in prompts),
            "prompts": len(prompts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("old", nargs="?", help="the checkout before the change")
    parser.add_argument("new", nargs="?", help="the checkout after it")
    parser.add_argument("--pair", default="qwen-coder")
    parser.add_argument("--methods", nargs="+", default=["traversal@1,3,0"])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        serve_requests(args.pair, args.methods)
        return 0
    if not (args.old and args.new) or not all(Path(p, "decode").is_dir() for p in (args.old, args.new)):
        parser.error("give two ddte checkouts: OLD NEW")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        parser.error("--num-prompts and --max-new-tokens must be >= 1")
    from data_gen.prompts import load_prompt_texts
    from decode.pair import load_pair_config

    tokenizer = load_pair_config(args.pair).tokenizer
    texts = load_prompt_texts("mixed:heldout", limit=args.num_prompts, tokenizer=tokenizer)
    checkouts = {"old": Checkout(Path(args.old).resolve(), args.pair, args.methods),
                 "new": Checkout(Path(args.new).resolve(), args.pair, args.methods)}
    order = [(c, m) for m in args.methods for c in checkouts]
    rows = []
    for index, text in enumerate(texts):
        ids = list(tokenizer(text)["input_ids"])
        for name, method in order[index % len(order):] + order[:index % len(order)]:
            out = checkouts[name].ask({"method": method, "ids": ids, "max_new": args.max_new_tokens, "seed": index,
                                       "temperature": args.temperature})
            rows.append({"prompt": index, "checkout": name, "method": method, **out})
            print(f"prompt {index} {name} {method}: {len(out['tokens']) / out['wall']:.2f} tokens/s", flush=True)
    summary = [paired_ratio(rows, m) for m in args.methods]
    for s in summary:
        print(f"{s['method']}: old {s['old_tokens_per_s']:.2f} tokens/s, new {s['new_tokens_per_s']:.2f}, "
              f"new/old {s['ratio']:.3f} [{s['interval'][0]:.3f}, {s['interval'][1]:.3f}], same tokens "
              f"{s['same_tokens']}/{s['prompts']}")
    if args.output:
        Path(args.output).write_text(json.dumps({"summary": summary, "lines": checkouts["new"].lines,
                                                 "old_lines": checkouts["old"].lines, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
