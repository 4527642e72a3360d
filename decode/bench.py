"""Benchmark decoding methods side by side on held-out prompts: tokens/s, speedup, block efficiency.

Methods:
  ar                      the target alone, HF transformers `generate` (the baseline of every speedup)
  hf-assisted             HF assisted generation with the same pair and sampling (`assistant_model`)
  VERIFIER@K,L1,L2        ddte with a static delayed tree, e.g. traversal@2,2,4
  VERIFIER@adaptive       ddte with HF's +2/-1 draft-length schedule on a single path
  VERIFIER@entropy        ddte with the entropy stop rule on a single path of up to 8 tokens
  VERIFIER@selector=FILE  ddte with a trained selector (ddte export) choosing the tree at every step

Each method first runs one warm-up prompt. Then the methods run interleaved: prompt by prompt, every method
in turn (in an order that rotates per prompt), so the CPU's drift over minutes reaches all methods alike. Every
prompt runs `--repeats` times with fixed seeds (seed + 1000·repeat + prompt index). Tokens/s is total new
tokens over total wall time, prefill included. Prompts default to the held-out stdlib modules of the prompt
builder (never seen in training). Several --temperature values give one block of rows per temperature.
Selector rows also report the median network call (µs) and the share of wall time spent in the selector
(features + call).

Example:
  ddte bench --num-prompts 20 --max-new-tokens 128 --methods ar hf-assisted traversal@2,2,4 --output bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ddte.cli import UserError
from decode.cli import add_pair_arguments, load_pair_from_args, make_named_policy, make_selector_policy
from decode.drafting import Action
from decode.engine import SpeculativeDecoder, check_action
from decode.pair import LoadedPair
from decode.policies import StaticPolicy
from decode.rng import TorchRandom
from decode.sampling import SamplingConfig
from decode.stats import GenerationStats
from decode.verifiers import get_verifier

DEFAULT_METHODS = [
    "ar", "hf-assisted", "traversal@adaptive", "traversal@entropy",
    "traversal@1,6,0", "traversal@4,0,3", "traversal@2,2,3",
    "specinfer@2,2,3", "spectr@2,2,3", "nss@2,2,3", "specinfer@4,0,3",
]


@dataclass
class MethodResult:
    method: str
    stats: GenerationStats
    temperature: float = 1.0
    selector_call_us: float | None = None

    def row(self, ar_tps: float | None) -> dict:
        s = self.stats
        forwards = s.seconds["draft"] + s.seconds["target"] + s.seconds["prefill"]
        return {
            "method": self.method,
            "temperature": self.temperature,
            "tokens_per_s": s.tokens_per_second,
            "speedup": s.tokens_per_second / ar_tps if ar_tps else None,
            "block_efficiency": s.block_efficiency if s.steps else None,
            "acceptance_rate": s.acceptance_rate if s.steps else None,
            "new_tokens": s.new_tokens,
            "wall_seconds": s.wall_seconds,
            "outside_forwards_share": (1 - forwards / s.wall_seconds) if s.steps and s.wall_seconds else None,
            "seconds": dict(s.seconds),
            "action_histogram": {str(k): v for k, v in s.action_counts.items()},
            "selector_call_us_median": self.selector_call_us,
            "policy_share": s.seconds["policy"] / s.wall_seconds if s.steps and s.wall_seconds else None,
        }


def parse_method(text: str) -> tuple[str, str | None]:
    """'ar' | 'hf-assisted' | 'VERIFIER@K,L1,L2' | 'VERIFIER@adaptive|entropy' -> (verifier or kind, spec)."""
    if text in ("ar", "hf-assisted"):
        return text, None
    name, sep, spec = text.partition("@")
    if not sep:
        raise UserError(f"bad method '{text}': use ar, hf-assisted, VERIFIER@K,L1,L2 or VERIFIER@adaptive")
    try:
        verifier = get_verifier(name)
    except KeyError as err:
        raise UserError(err.args[0]) from err
    if spec.startswith("selector="):
        if not os.path.isfile(spec.split("=", 1)[1]):
            raise UserError(f"bad method '{text}': selector file {spec.split('=', 1)[1]!r} does not exist")
    elif spec not in ("adaptive", "entropy"):
        try:
            check_action(verifier, Action.parse(spec))
        except ValueError as err:
            raise UserError(f"bad method '{text}': {err}") from err
    return name, spec


def run_hf(pair: LoadedPair, ids: list[int], max_new: int, sampling: SamplingConfig, seed: int, assisted: bool):
    """One HF `generate` call (target alone, or assisted by the draft); returns (new tokens, seconds)."""
    torch.manual_seed(seed)
    kwargs = {"max_new_tokens": max_new, "do_sample": not sampling.greedy, "pad_token_id": pair.eos_token_id}
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=None)
    if assisted:
        kwargs["assistant_model"] = pair.draft.model
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.model.generate(torch.tensor([ids], device=pair.target.device), **kwargs)
    return out.shape[1] - len(ids), time.perf_counter() - start


@dataclass
class _Runner:
    """One method ready to run: ``one(ids, seed)`` generates one prompt; ``total`` accumulates its statistics."""

    method: str
    one: Callable[[list[int], int], GenerationStats]
    selector: object | None = None
    total: GenerationStats = field(default_factory=GenerationStats)


def make_runner(method: str, pair: LoadedPair, args: argparse.Namespace, sampling: SamplingConfig) -> _Runner:
    kind, spec = parse_method(method)
    if kind in ("ar", "hf-assisted"):
        def hf(ids: list[int], seed: int) -> GenerationStats:
            new, seconds = run_hf(pair, ids, args.max_new_tokens, sampling, seed, assisted=kind == "hf-assisted")
            return GenerationStats(new_tokens=new, wall_seconds=seconds)

        return _Runner(method, hf)
    decoder = SpeculativeDecoder(pair.target, pair.draft, get_verifier(kind), sampling, pair.eos_token_id)
    selector = None
    if spec.startswith("selector="):
        selector = make_selector_policy(spec.split("=", 1)[1], kind, pair, args)

    def speculative(ids: list[int], seed: int) -> GenerationStats:
        if selector is not None:
            policy = selector
        elif spec in ("adaptive", "entropy"):
            policy = make_named_policy(spec, Action(1, 1, 0))
        else:
            policy = StaticPolicy(Action.parse(spec))
        return decoder.generate(ids, args.max_new_tokens, policy, TorchRandom(seed)).stats

    return _Runner(method, speculative, selector)


def bench_methods(methods: list[str], pair, prompts, args, sampling) -> list[MethodResult]:
    """Run every method on every prompt, interleaved: prompt by prompt, each method in turn.

    A CPU's speed drifts by 10–20 % over minutes (thermal, other tenants). Running one method's prompts after
    another's would fold that drift into the comparison; interleaving spreads it over all methods alike, and the
    order of the methods rotates from one prompt to the next so no method always runs right after the same one.
    Each method first runs one warm-up prompt (not counted).
    """
    runners = [make_runner(m, pair, args, sampling) for m in methods]
    for runner in runners:
        runner.one(prompts[0], args.seed)  # warm-up: first-call costs and the selector's latency table
        if runner.selector is not None:
            runner.selector.call_seconds.clear()
    rounds = [(i, r) for i in range(len(prompts)) for r in range(args.repeats)]
    for n, (i, r) in enumerate(tqdm(rounds, desc=f"T={sampling.temperature}", unit="prompt", leave=False)):
        shift = n % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.total.merge(runner.one(prompts[i], args.seed + 1000 * r + i))
    return [
        MethodResult(
            runner.method, runner.total, sampling.temperature,
            runner.selector.median_call_us() if runner.selector is not None else None,
        )
        for runner in runners
    ]


def encode_prompts(pair: LoadedPair, texts: list[str], max_new: int) -> list[list[int]]:
    """Token ids of each prompt, left-truncated so prompt + max_new fits the context window."""
    if pair.tokenizer is None:
        raise UserError("the pair has no tokenizer; pass --tokenizer DIR")
    limit = min(pair.target.config.max_position_embeddings, pair.draft.config.max_position_embeddings)
    room = limit - max_new - 1
    if room < 2:
        raise UserError(f"--max-new-tokens {max_new} leaves no room for a prompt in a {limit}-token context")
    return [list(pair.tokenizer(t)["input_ids"])[-room:] for t in texts]


def load_bench_prompts(args: argparse.Namespace) -> list[str]:
    from ddte.pair.prompts import build_prompts, load_prompts

    if args.prompts:
        return load_prompts(args.prompts, field=args.field, limit=args.num_prompts)
    return [r["prompt"] for r in build_prompts(count=args.num_prompts, split="heldout")]


def format_table(rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [
        "| T | method | tokens/s | speedup vs ar | block efficiency | acceptance rate | outside forwards "
        "| selector call µs | policy share |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('temperature', '-')} | {r['method']} | {r['tokens_per_s']:.1f} | {num(r['speedup'], '.2f')}× | "
            f"{num(r['block_efficiency'], '.2f')} | {num(r['acceptance_rate'], '.2f')} | "
            f"{num(r['outside_forwards_share'], '.0%')} | {num(r.get('selector_call_us_median'), '.1f')} | "
            f"{num(r.get('policy_share'), '.1%')} |"
        )
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    import transformers

    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": platform.machine(), "processor": platform.processor(), "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
    }


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    labels = [f"{r['method']} T={r.get('temperature', '')}" for r in rows]
    ax.barh(labels[::-1], [r["tokens_per_s"] for r in rows][::-1], color="#4c72b0")
    ax.set_xlabel("tokens/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, help="methods to compare (see above)")
    parser.add_argument("--prompts", default=None, help="JSONL/parquet file or datasets spec (default: held-out)")
    parser.add_argument("--field", default="prompt", help="text field of --prompts (default: prompt)")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="runs per prompt (different seeds)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="one or more temperatures")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--output", default=None, help="write rows + environment as JSON here")
    parser.add_argument("--plot", default=None, help="tokens/s bar chart PNG (default: beside --output)")


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise UserError("--num-prompts, --repeats and --max-new-tokens must be >= 1")
    try:
        samplings = [SamplingConfig(t, args.top_p) for t in args.temperature]
    except ValueError as err:
        raise UserError(str(err)) from err
    for method in args.methods:
        parse_method(method)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        pair = load_pair_from_args(args)
    except ValueError as err:
        raise UserError(str(err)) from err
    prompts = encode_prompts(pair, load_bench_prompts(args), args.max_new_tokens)
    rows = []
    for sampling in samplings:
        results = bench_methods(args.methods, pair, prompts, args, sampling)
        ar = next((r.stats.tokens_per_second for r in results if r.method == "ar"), None)
        rows.extend(r.row(ar) for r in results)
    temps = ", ".join(f"{t:g}" for t in args.temperature)
    title = f"{len(prompts)} prompts x {args.repeats}, {args.max_new_tokens} new tokens, T={temps}, top-p={args.top_p}"
    print(title)
    print(format_table(rows))
    if args.output:
        settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        payload = {"settings": settings, "environment": environment(pair.target.device), "rows": rows}
        tmp = f"{args.output}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        os.replace(tmp, args.output)
        plot(rows, args.plot or os.path.splitext(args.output)[0] + ".png", title)
    elif args.plot:
        plot(rows, args.plot, title)
    return 0
