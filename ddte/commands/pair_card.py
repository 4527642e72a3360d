"""Measure a pair for its model card (ddte/pair_card/): every number in models/README.md comes from here.

--pair names the pair as every command does (a name under configs/pair/, default shipped, or a pair YAML). Every
pair's card, each model loaded as the decoding loop runs it: the machine, architecture, parameters and dtypes; pass
times in the decoding loop and their ratios to a one-token target pass; the kernel paths; acceptance 1 − TV(p, q) at
T = 0.6 and 1 on target-sampled continuations of the pair's held-out prompts (for chat prompts: those like the
training data and those unlike it, separately; per category for the mixed workload); one T = 0.8 sample. A pair laid
out as `ddte train-pair` writes one (target/, draft/, tokenizer/ and recipe.json in one folder, like the shipped pair
in models/) adds, with the models in fp32 on the default kernel path: training figures (from recipe.json), held-out
loss and perplexity, HF-forward pass times, and the draft's calibration. It prints markdown tables and writes
everything as JSON; --threads, --cache-len and --sample-tokens beyond the machine or the pair's context are refused
before anything is measured. --kernels names the kernel paths as in every command (default: the pair's own; a
`ddte train-pair` folder's card: default).

Examples:
  ddte pair-card --output models/card.json
  ddte pair-card --pair smollm2 --output models/smollm2-card.json
  ddte pair-card --pair /tmp/pair/pair.yaml --num-prompts 10 --timed-calls 5
  ddte pair-card --pair smollm2 --kernels default --output /tmp/smollm2-default-card.json
"""

from __future__ import annotations

import argparse
import os

from ddte.commands.common import (
    UserError,
    add_kernels_argument,
    add_threads_argument,
    check_kernels_argument,
    check_output_file,
    seed_argument,
    user_errors,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", default="shipped", help="the pair: a name under configs/pair/ or a pair YAML (a "
                        "`ddte train-pair` folder's pair gets the full card)")
    parser.add_argument("--output", default=None, help="write all measurements to this JSON file")
    add_threads_argument(parser)
    parser.add_argument("--cache-len", type=int, default=256, help="KV cache length for latency")
    parser.add_argument("--tree-nodes", type=int, default=None, help="nodes of the timed tree pass (default: 32 for "
                        "the full card, else 8)")
    parser.add_argument("--timed-calls", type=int, default=None, help="timed calls per latency figure (default: 30 "
                        "for the full card, else 10)")
    parser.add_argument("--num-prompts", type=int, default=None, help="held-out prompts for acceptance (default: "
                        "100 for the full card, else 24 per group)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="sampled tokens per prompt")
    parser.add_argument("--heldout-blocks", type=int, default=None,
                        help="held-out blocks for the loss (default: the recipe's final_eval_blocks, else all)")
    parser.add_argument("--sample-tokens", type=int, default=80, help="length of the T=0.8 sample")
    parser.add_argument("--seed", type=seed_argument, default=0, help="sampling seed")
    add_kernels_argument(parser, "the pair's, auto; a `ddte train-pair` folder's card: default")
    parser.add_argument("--groups", nargs="+", default=[], metavar="GROUP",
                        help="measure acceptance on these prompt groups only (like, unlike for chat sets; the "
                        "categories of the mixed workload, e.g. coding math translation writing; default: all)")


def run(args: argparse.Namespace) -> int:
    from ddte.pair_card.card import CardSettings, with_defaults
    from ddte.pair_card.folder import train_pair_folder
    from decode.pair import check_kernel_request
    from decode.pair_spec import read_pair_config

    check_kernels_argument(args.kernels)  # a --kernels that does not parse: one line, before anything loads
    with user_errors():
        spec = read_pair_config(args.pair)
        folder = train_pair_folder(spec)
        # a path a model cannot run in the dtype the card loads it in (a train-pair folder: fp32, the default path)
        check_kernel_request(spec, "cpu", "float32" if folder is not None else None,
                             args.kernels or ("default" if folder is not None else None))
    settings = with_defaults(CardSettings(args.pair, args.threads, args.cache_len, args.tree_nodes, args.timed_calls,
                                          args.num_prompts, args.max_new_tokens, args.sample_tokens, args.seed,
                                          tuple(args.groups), args.heldout_blocks, args.kernels), folder is not None)
    _check(settings, folder is not None)
    output = check_output_file(args.output) if args.output else None
    return _measure_and_print(settings, output)


def _check(settings, folder: bool) -> None:
    """UserError for a flag out of range, or one this pair's card has no use for, before anything loads."""
    cores = os.cpu_count() or 1
    if settings.threads > cores:
        raise UserError(f"--threads {settings.threads} is more than this machine's {cores} cores")
    flags = {"threads": settings.threads, "cache_len": settings.cache_len, "tree_nodes": settings.tree_nodes,
             "timed_calls": settings.repeats, "num_prompts": settings.num_prompts,
             "max_new_tokens": settings.max_new_tokens, "sample_tokens": settings.sample_tokens}
    for name, value in flags.items():
        if value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if settings.heldout_blocks is not None and settings.heldout_blocks < 1:
        raise UserError("--heldout-blocks must be at least 1 (leave it out for the recipe's own count)")
    if folder and settings.groups:
        raise UserError("--groups picks prompt groups of a pair's chat or mixed prompt set; a `ddte train-pair` "
                        "folder's card measures its held-out code prompts")
    if not folder and settings.heldout_blocks is not None:
        raise UserError("--heldout-blocks measures a `ddte train-pair` folder's held-out loss; this pair's card "
                        "has none")


def _measure_and_print(settings, output) -> int:
    """Measure, write the JSON (when asked), print the tables and the T = 0.8 sample."""
    from pathlib import Path

    from ddte.pair_card.card import measure, write_json
    from ddte.pair_card.markdown import markdown

    with user_errors():
        result = measure(settings)
    if output is not None:
        write_json(result, Path(output))
    print(markdown(result))
    sample = result["sample_T0.8"]
    print(f"T = 0.8 sample from {sample.get('prompt_id', 'the shortest held-out prompt')}:")
    print(sample["completion"])
    return 0
