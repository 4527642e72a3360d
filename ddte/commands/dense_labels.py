"""Label every position of sampled continuations as a node: the draft's features there, 1 − TV(p, q), each
verifier's exact acceptance of K = 1..k_max one-token drafts, the drawn token's realized acceptance min(1, p(x)/q(x))
and the draw signals (data_gen/dense.py). Cheap per-node training data for an acceptance model: one draft pass per
token and one target pass per continuation, on the kernels the loop runs.

The output is a HF datasets parquet folder with its card (README.md) and dense.json, in a new or empty folder;
--resume continues a stopped run chunk by chunk, --shard i/N splits the prompts' chunks between processes sharing
the folder (a SLURM array: the shards may start in any order, with the same settings; a shard left without a chunk
says so and exits 0). Every check runs before anything is written.

Examples:
  ddte dense-labels --pair qwen-coder --output data/dense/qwen --num-prompts 200
  ddte dense-labels --output data/dense/shipped --num-prompts 8 --length 32 --continuations 2
  ddte dense-labels --pair qwen-coder --output data/dense/qwen-control --source target   # the target's own text
  ddte dense-labels --pair qwen-coder --output data/dense/qwen --resume --shard 1/2
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

from ddte.commands.common import (
    UserError,
    add_pair_arguments,
    add_threads_argument,
    apply_threads,
    load_pair_from_args,
    open_machine_pair,
    seed_argument,
    user_errors,
)

DEFAULT_VERIFIERS = ("specinfer", "traversal")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--output", required=True, help="a new or empty folder for the data set, or one holding this "
                        "data set (--resume, another --shard)")
    parser.add_argument("--prompts", default=None, help="prompt source (default: the pair's train_prompts)")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts to label from")
    parser.add_argument("--first-prompt", type=int, default=0,
                        help="skip the source's first prompts: e.g. those a tree collection used, so that an "
                             "acceptance model trained here is scored on prompts it never saw")
    parser.add_argument("--max-prompt-tokens", type=int, default=384,
                        help="left-truncate prompts to their last tokens (a long prompt's prefill is most of its cost)")
    parser.add_argument("--continuations", type=int, default=4, help="continuations per prompt and temperature")
    parser.add_argument("--length", type=int, default=48, help="tokens (nodes) per continuation")
    parser.add_argument("--k-max", type=int, default=3, help="label K = 1..k-max i.i.d. one-token drafts per node")
    parser.add_argument("--source", default="draft", choices=("draft", "target"),
                        help="which model samples the continuations (target: a control)")
    parser.add_argument("--depth-cycle", type=int, default=8, help="a node's depth is its position modulo this")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.6, 1.0], help="sampling temperatures")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--verifiers", nargs="+", default=list(DEFAULT_VERIFIERS), help="verifiers to label")
    parser.add_argument("--prompts-per-shard", type=int, default=4)
    parser.add_argument("--shard", default="0/1", help="i/N: label only the chunks c with c %% N == i")
    parser.add_argument("--resume", action="store_true",
                        help="continue the data set in --output (or start it): chunks written already are skipped")
    parser.add_argument("--seed", type=seed_argument, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check(args: argparse.Namespace):
    """Every check of the flags alone, before any model loads or anything is written."""
    from data_gen.collection import parse_shard
    from data_gen.dense import DenseSpec, check_verifiers
    from data_gen.dense_collection import check_dense_folder
    from ddte_core.paths import refuse_file_in_the_way
    from decode.verifiers import get_verifier

    for name in ("num_prompts", "prompts_per_shard", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.first_prompt < 0:
        raise UserError("--first-prompt must be at least 0")
    bad = [t for t in args.temperature if not math.isfinite(t) or t < 0]
    if bad or len(set(args.temperature)) != len(args.temperature):
        raise UserError(f"--temperature: give each temperature once, each a finite number >= 0 (got "
                        f"{' '.join(f'{t:g}' for t in args.temperature)})")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p:g}")
    if not args.output.strip():
        raise UserError("--output is empty: give a new folder for the data set")
    with user_errors(ValueError, KeyError):
        spec = DenseSpec(args.continuations, args.length, args.k_max, args.source, args.depth_cycle)
        verifiers = [get_verifier(name) for name in dict.fromkeys(args.verifiers)]
        check_verifiers(verifiers)
        shard = parse_shard(args.shard)
        output = refuse_file_in_the_way(args.output, "--output")
        check_dense_folder(output)  # a folder of the user's own files: refused before any model loads
    return spec, verifiers, shard, output


def _prompts(args: argparse.Namespace, pair, spec) -> tuple[list[list[int]], list[str], int]:
    """The prompts' token ids, their categories, and the room the context leaves a prompt (its ids are
    left-truncated to it)."""
    from bench.decoding import bench_prompt_categories
    from data_gen.prompts import load_prompt_texts

    source = args.prompts or pair.spec.train_prompts
    if pair.tokenizer is None:
        raise UserError("the pair has no tokenizer: prompts are text")
    with user_errors():
        texts = load_prompt_texts(source, limit=args.first_prompt + args.num_prompts, tokenizer=pair.tokenizer)
        categories = bench_prompt_categories(source, len(texts), 0, source) or ["none"] * len(texts)
    texts, categories = texts[args.first_prompt:], categories[args.first_prompt:]
    if not texts:
        raise UserError(f"--first-prompt {args.first_prompt}: {source} holds no prompts after it")
    room = min(pair.context_limit - spec.length - 1, args.max_prompt_tokens)
    if room < 1:
        raise UserError(f"--length {spec.length} leaves no room for a prompt in the pair's {pair.context_limit}-token "
                        "context")
    return [list(pair.tokenizer(text)["input_ids"])[-room:] for text in texts], categories, room


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from data_gen.dense_collection import collect_dense, dense_metadata
    from data_gen.store import shard_chunks

    spec, verifiers, shard, output = _check(args)
    apply_threads(args.threads)
    pair = load_pair_from_args(args)
    prompts, categories, room = _prompts(args, pair, spec)
    kernels = open_machine_pair(pair, args).kernel_choice  # this machine's kernels, the line on stderr
    command = "ddte " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with user_errors(ValueError):
        metadata = dense_metadata(pair.fingerprint(), kernels, spec, args.temperature, args.top_p,
                                  verifiers, args.prompts or pair.spec.train_prompts, len(prompts), args.seed, command,
                                  first_prompt=args.first_prompt, max_prompt_tokens=room,
                                  prompts_per_shard=args.prompts_per_shard)
    mine = shard_chunks(len(prompts), args.prompts_per_shard, shard)
    total = sum(min(args.prompts_per_shard, len(prompts) - c * args.prompts_per_shard) for c in mine)
    with tqdm(total=total, unit="prompt", disable=args.no_progress or not mine, desc="dense labels") as bar, \
            user_errors(ValueError, OSError):
        summary = collect_dense(pair.target, pair.draft, prompts, categories, output, metadata, spec, verifiers,
                                args.prompts_per_shard, shard, args.resume, progress=bar.update,
                                first_prompt=args.first_prompt)
    if not mine:  # checked like any shard, then nothing written: a SLURM array's spare task succeeds, and says so
        chunks = -(-len(prompts) // args.prompts_per_shard)
        print(f"shard {shard[0]}/{shard[1]} has no work: {len(prompts)} prompts make {chunks} chunk"
              f"{'s' if chunks != 1 else ''} of --prompts-per-shard {args.prompts_per_shard}, and shard i takes "
              f"chunks c with c % {shard[1]} == i; nothing written", file=sys.stderr)
        return 0
    print(summary.line())
    return 0
