"""Benchmark decoding methods side by side on held-out prompts: tokens/s, speedup, block efficiency.

Methods:
  ar                      the target alone, HF transformers `generate` (the baseline of every speedup)
  hf-assisted             HF assisted generation with the same pair and sampling (`assistant_model`), the draft in
                          the dtype it runs fastest in stock here: its own, or float32 where that is over 5 % faster
                          (a CPU without native bf16), timed once per bench; the rows' draft_dtype says which
  hf-assisted-own         the same with the draft in the dtype the pair loads it in
  ar-kernels              ar on the kernel paths the pair runs here (--kernels) instead of the stock models
  hf-assisted-kernels     hf-assisted-own on those kernel paths (the same q as ddte's draft)
  VERIFIER@K,L1,L2        ddte with a static delayed tree, e.g. traversal@2,2,4
  VERIFIER@adaptive       ddte with HF's +2/-1 draft-length schedule on a single path (adaptive:max-draft=N: up to
                          N tokens, default 8)
  VERIFIER@entropy        ddte with the entropy stop rule on a single path of up to 8 tokens, halting above 2 nats
                          (entropy:threshold=H,max-draft=N for others)
  VERIFIER@selector=FILE  ddte with a trained selector (ddte export) choosing the tree at every step
  VERIFIER@expander=FILE  ddte with a fitted expander (ddte expander) halting the trunk node by node while drafting
  VERIFIER@policy=FILE    ddte with the policy a `ddte pipeline` policy file chooses (also: --policy-file FILE)
  ...+draft=FOLDER        any ddte method above with another draft for the same target (a steered draft and its
                          parent in one interleaved run: traversal@2,0,1 traversal@2,0,1+draft=runs/distill/steered)

Static shapes that draft the same tree ((1,a,b), (K,a+b,0), ...) are benched once, under their canonical name. The
methods run interleaved, prompt by prompt in a rotating order, so the CPU's drift over minutes reaches every method
alike; each first runs one warm-up prompt. Tokens/s is total new tokens over total wall time, prefill included; ± is
the standard deviation over prompts; TPOT is the time per token after the first one (every row leaves out the time to
the first token and that token, as vLLM's TPOT does). Prompts default to the pair's held-out prompts (never seen in
training): stdlib modules for the shipped pair, chat prompts rendered with the chat template for smollm2. Several
--temperature values give one block of rows per temperature. Selector rows also report the median network call (µs)
and the share of wall time spent in the policy (features + call + decision); expander rows the median per-node
decision (µs: signal, head call, rule) and the same share. Every policy row (selector, expander, policy file,
adaptive, entropy) is then compared with its verifier's best static row in this run, with a paired bootstrap interval
that chooses that row again in every resample (bench/compare.py).

Example:
  ddte bench --num-prompts 20 --max-new-tokens 128 --methods ar hf-assisted traversal@2,2,4 --output bench.json
  ddte bench --pair smollm2 --temperature 0.6 1.0 --methods ar hf-assisted specinfer@1,0,4 specinfer@2,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ddte.commands.common import (
    MAX_SEED,
    UserError,
    add_latency_argument,
    add_pair_arguments,
    add_threads_argument,
    apply_threads,
    check_latency_argument,
    check_output_file,
    load_pair_from_args,
    seed_argument,
    shell_hooks,
    user_errors,
)
from ddte_core.paths import staged_file

if TYPE_CHECKING:
    from bench.method import Method
    from decode.policies.files.deployment import Deployment

DEFAULT_METHODS = [
    "ar", "hf-assisted", "traversal@adaptive", "traversal@entropy",
    "traversal@1,6,0", "traversal@4,0,3", "traversal@2,2,3",
    "specinfer@2,2,3", "spectr@2,2,3", "nss@2,2,3", "specinfer@4,0,3",
]


MAX_REPEATS, MAX_PROMPTS = 1000, 10**6
PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # what bench/display.py's plot writes, by the name's suffix


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, help="methods to compare (see above)")
    parser.add_argument("--policy-file", default=None, metavar="policy.json",
                        help="also bench VERIFIER@policy=FILE for every verifier the file names")
    parser.add_argument("--prompts", default=None,
                        help="JSONL/parquet file (prompt or chat messages rows), builtin:heldout, chat:heldout, "
                             "chat:heldout-unlike or hf:NAME, as in `ddte collect` (default: the pair's held-out "
                             "prompts: builtin:heldout for the shipped pair, chat:heldout for smollm2)")
    parser.add_argument("--field", default=None, help="text field of a --prompts file or hf: set (default: prompt)")
    parser.add_argument("--num-prompts", type=int, default=10, help="prompts to run (with --minutes: at most)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="time budget of the whole bench, split evenly over its temperatures: each block runs "
                             "the prompts that fit at its measured pace (at least 2), every method on the same ones")
    parser.add_argument("--skip-prompts", type=int, default=0, metavar="N",
                        help="start after the first N prompts (e.g. those a `ddte pipeline` bench chose on)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per prompt (different seeds)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="one or more temperatures")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold in (0, 1]")
    parser.add_argument("--seed", type=seed_argument, default=0, help="base seed of every prompt's run")
    add_threads_argument(parser)
    add_latency_argument(parser)
    parser.add_argument("--llama-cpp", default=None, metavar="PATH",
                        help="add a llama-cpp row: the llama-server binary at PATH (or in the folder PATH) decoding "
                             "the pair's target GGUF on --threads threads, interleaved with the other rows (never "
                             "fetched: docs/results.md says how to build it)")
    parser.add_argument("--output", default=None, help="write rows + settings + environment as JSON here")
    parser.add_argument("--plot", default=None, help="figure PNG (default: beside --output)")


def check_arguments(args: argparse.Namespace) -> tuple[list[Method], dict[str, Deployment]]:
    """Every option checked before any model loads; returns the parsed, de-duplicated methods and the policy files
    they name, each read and checked whole once (by path)."""
    from bench.method import Method, unique_methods
    from decode.policies.spec import PolicySpec

    if args.num_prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise UserError("--num-prompts, --repeats and --max-new-tokens must be >= 1")
    if args.minutes is not None and not 0 < args.minutes < float("inf"):
        raise UserError(f"--minutes must be a positive number of minutes, got {args.minutes}")
    if args.repeats > MAX_REPEATS or args.num_prompts + args.skip_prompts > MAX_PROMPTS:
        raise UserError(f"--repeats must be at most {MAX_REPEATS} and --num-prompts + --skip-prompts at most "
                        f"{MAX_PROMPTS} (every run is kept in memory)")
    if args.skip_prompts < 0:
        raise UserError("--skip-prompts must be >= 0")
    if args.field is not None and (args.prompts is None or args.prompts.startswith(("builtin:", "chat:", "mixed:"))):
        raise UserError("--field names the text field of a --prompts file or hf: set; the built-in and chat sets "
                        "have their own")
    args.field = args.field or "prompt"
    if any(not 0 <= t < float("inf") for t in args.temperature) or not 0 < args.top_p <= 1:
        raise UserError("--temperature must be finite and >= 0, and --top-p in (0, 1]")
    repeated = sorted({t for t in args.temperature if args.temperature.count(t) > 1})
    if repeated:
        raise UserError(f"--temperature {' '.join(f'{t:g}' for t in repeated)} is given twice: each temperature is "
                        "one block of rows")
    if args.plot is not None and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise UserError(f"--plot {args.plot}: name the figure *.png, *.svg or *.pdf (the format it is written in)")
    if not 0 <= args.seed <= MAX_SEED - 1000 * args.repeats - args.num_prompts - args.skip_prompts:
        raise UserError(f"--seed must be in [0, {MAX_SEED}] with room for every prompt's and repeat's seed, got "
                        f"{args.seed}")
    check_latency_argument(args.latency)
    with user_errors():
        methods, dropped = unique_methods(args.methods)
    for method in methods:
        if method.path is not None:
            with user_errors(ValueError, prefix=f"bad method '{method}': "):
                PolicySpec.file(method.kind, method.path).check_file()
        if method.draft is not None and not os.path.isdir(method.draft):
            raise UserError(f"bad method '{method}': draft folder {method.draft!r} does not exist")
    files = _read_policy_files(methods)
    methods = _with_llama_cpp(args, methods)
    if args.policy_file:
        from decode.policies.files.deployment import load_deployment

        with user_errors(prefix="--policy-file: "):
            deployment = files[args.policy_file] = load_deployment(args.policy_file)
        from_file = [Method.policy_file(v, args.policy_file) for v in dict.fromkeys(c.verifier for c in
                                                                                   deployment.choices)]
        dropped += [m.key for m in from_file if m in methods]
        methods += [m for m in from_file if m not in methods]
    if dropped:
        print(f"note: {', '.join(dropped)} draft the same trees as a method already listed; benched once",
              file=sys.stderr)
    return methods, files


def _with_llama_cpp(args: argparse.Namespace, methods: list[Method]) -> list[Method]:
    """``methods`` with the ``llama-cpp`` row where ``--llama-cpp`` names a llama-server (checked now)."""
    from bench.method import Method

    if args.llama_cpp is None:
        if any(m.kind == "llama-cpp" for m in methods):
            raise UserError("the llama-cpp row needs a llama-server: name it with --llama-cpp PATH")
        return methods
    from bench.llama_cpp import server_binary

    with user_errors():
        args.llama_cpp = str(server_binary(args.llama_cpp))
    return methods + [m for m in [Method("llama-cpp")] if m not in methods]


def _llama_cpp(args: argparse.Namespace, pair, prompts: list[list[int]]):
    """The llama-server of a ``--llama-cpp`` row, on the pair's target GGUF with the bench's threads and a context
    that holds the longest prompt and its new tokens (a started server as a context manager); else a null context."""
    import contextlib

    if args.llama_cpp is None:
        return contextlib.nullcontext()
    from bench.llama_cpp import LlamaCppServer, target_gguf

    context = -(-(max(map(len, prompts)) + args.max_new_tokens + 16) // 256) * 256
    return LlamaCppServer(Path(args.llama_cpp), target_gguf(pair.paths), args.threads or 1, context)


def _read_policy_files(methods: list[Method]) -> dict[str, Deployment]:
    """Every policy file a method names, read and checked whole once (by path), before any model loads."""
    from decode.policies.files.deployment import load_deployment

    files: dict[str, Deployment] = {}
    for method in methods:
        if method.kind == "policy" and method.path not in files:
            with user_errors(prefix=f"bad method '{method}': "):
                files[method.path] = load_deployment(method.path)
    return files


def run(args: argparse.Namespace) -> int:
    from bench.decoding import BenchSettings, run_bench

    methods, files = check_arguments(args)
    _note_unmeasured_sampling(args, methods, files)
    output = check_output_file(args.output) if args.output else None
    plot_path = check_output_file(args.plot, "--plot") if args.plot else None
    apply_threads(args.threads)
    pair = load_pair_from_args(args)
    prompts, categories = _prompts(args, pair)
    session = _session(args, pair, methods, files)
    with user_errors(), _llama_cpp(args, pair, prompts) as llama_cpp:
        seconds = None if args.minutes is None else 60.0 * args.minutes / len(args.temperature)
        settings = BenchSettings(args.max_new_tokens, args.repeats, args.seed, args.top_p, seconds)
        rows = run_bench(methods, session, prompts, settings, args.temperature, llama_cpp)
    timed = len({p["prompt"] for row in rows for p in row.get("per_prompt", [])}) or len(prompts)  # --minutes
    memory = memory_note(methods)
    title, by_category, comparisons = _report(args, pair, rows, timed, categories, memory)
    if output is not None:
        _write(output, args, methods, pair, session.latency_line, rows, by_category, comparisons, memory)
        plot_path = plot_path or output.with_suffix(".png")
    if plot_path is not None:
        from bench.display import plot

        plot(rows, plot_path, title)
    return 0


def _prompts(args: argparse.Namespace, pair) -> tuple[list, list | None]:
    """The bench's prompts as token ids and their categories (a warning on stderr for prompts cut to fit)."""
    from bench.decoding import bench_prompt_categories, bench_prompts, encode_prompts

    truncated: list[int] = []
    with user_errors():
        prompts = encode_prompts(pair, bench_prompts(args.prompts, args.field, args.num_prompts, args.skip_prompts,
                                                    pair.tokenizer, pair.spec.heldout_prompts), args.max_new_tokens,
                                 truncated)
        categories = bench_prompt_categories(args.prompts, args.num_prompts, args.skip_prompts,
                                             pair.spec.heldout_prompts)
    if truncated:
        print(f"warning: {len(truncated)} of {len(prompts)} prompts are longer than the "
              f"{pair.context_limit}-token context leaves beside --max-new-tokens {args.max_new_tokens}: their "
              f"first tokens are cut (prompts {', '.join(str(i) for i in truncated[:5])}"
              f"{', ...' if len(truncated) > 5 else ''})", file=sys.stderr)
    return prompts, categories


def _session(args: argparse.Namespace, pair, methods, files):
    """Every ddte method opened on the pair (decode/session.py): each policy checked against it first (one line
    naming the method), then the pair on this machine's kernels, the latency table measured once where a method reads
    one, and the policies and decoders built on it; the lines on stderr as they come."""
    from bench.decoding import open_bench

    by_request = {method.request: method for method in methods if not method.is_hf}

    def prefix(step: str, request) -> str:
        return f"bad method '{by_request[request]}': " if step == "policy" else ""

    return open_bench(pair, methods, args.kernels, args.latency, files,
                      shell_hooks(args, prefix, release=not stock_readers(methods)))


def stock_readers(methods) -> list[str]:
    """The HF rows that read the pair's stock weights or its draft's HF module: every HF kind but ``ar-kernels``,
    whose target runs on its kernels' copies (the llama-cpp row reads its own GGUF). With none, the stock weights go
    as the kernels' copies are made (decode/models/release.py); with one, the pair keeps them twice."""
    from bench.method import HF_KINDS

    return [method.key for method in methods if method.hf in HF_KINDS and method.hf != "ar-kernels"]


def memory_note(methods) -> dict:
    """What bench.json and the report say of the memory: the peak resident set of the run (the pair, its kernels
    and every row) and whether the stock weights were kept, and for which rows."""
    from ddte_core.memory import peak_rss_bytes

    readers = stock_readers(methods)
    weights = f"kept: {', '.join(readers)} read them" if readers else "given back: no row runs the stock models"
    return {"peak_rss_bytes": peak_rss_bytes(), "stock_weights": weights}


def _report(args: argparse.Namespace, pair, rows: list[dict], count: int, categories, memory: dict):
    """Print the tables; returns (the title, the per-category rows, the policy comparisons)."""
    from bench.compare import format_comparisons, policy_comparisons
    from bench.decoding import category_rows
    from bench.display import format_category_table, format_table
    from bench.stock_draft import draft_dtypes_note
    from ddte_core.memory import gigabytes

    temps = ", ".join(f"{t:g}" for t in args.temperature)
    skipped = f" (after the first {args.skip_prompts})" if args.skip_prompts else ""
    heldout = args.prompts in (None, pair.spec.heldout_prompts) or str(args.prompts).endswith(":heldout")
    which = "held-out prompts" if heldout else f"prompts from {args.prompts}"
    title = (f"{count} {which}{skipped} × {args.repeats} repeat(s), {args.max_new_tokens} new tokens, "
             f"T = {temps}, top-p {args.top_p:g}")
    print(title)
    drafts = draft_dtypes_note(rows)
    print(f"{pair.kernel_choice.line()}; ar, hf-assisted and hf-assisted-own run the stock models (F.linear)"
          + (f"; {drafts}" if drafts else ""))
    print(format_table(rows))
    print(f"peak RSS {gigabytes(memory['peak_rss_bytes'])} (the pair, its kernels and every row; stock weights "
          f"{memory['stock_weights']})")
    by_category = category_rows(rows, categories) if categories and len(set(categories)) > 1 else []
    if by_category:
        print("\nPer prompt category:")
        print(format_category_table(by_category))
    comparisons = policy_comparisons(rows)
    if comparisons:
        print("\nPolicies against their verifier's best static tree in this run (the best of several near-tied rows is "
              "biased upward, so the ratio reads low; the interval chooses it again in every bootstrap resample of "
              "the prompts):")
        print(format_comparisons(comparisons))
    return title, by_category, comparisons


def _write(output, args: argparse.Namespace, methods, pair, which, rows, by_category, comparisons,
           memory: dict) -> None:
    """bench.json: the settings, the environment (its memory: :func:`memory_note`), the rows, the categories and the
    comparisons."""
    from bench.decoding import environment

    settings_out = {k: v for k, v in vars(args).items() if not k.startswith("_")} | {
        "methods": [m.key for m in methods]}
    env = environment(pair.target.device) | {"latency": which, "kernels": pair.kernel_choice.line()} | memory
    payload = {"settings": settings_out, "environment": env, "rows": rows, "categories": by_category,
               "comparisons": comparisons}
    with staged_file(output) as tmp, tmp.open("w") as f:
        json.dump(payload, f, indent=2, default=str)


def _note_unmeasured_sampling(args: argparse.Namespace, methods, files) -> None:
    """Say once per method and temperature where a selector, expander or policy file has no choice measured there:
    the nearest one stands in (decode/policies/files/sampling_table.py)."""
    from decode.drafting.sampling import SamplingConfig
    from decode.policies.build import measured_table

    for method in methods:
        if method.is_hf or not method.policy.reads_file:
            continue
        try:
            table = measured_table(method.policy, method.verifier, files.get(method.path))
        except Exception:  # an unreadable file: the run reports it when it loads the file
            continue
        for temperature in args.temperature if table is not None else ():
            note = table.note(SamplingConfig(temperature, args.top_p), noun=method.label)
            if note:
                print(note, file=sys.stderr)
