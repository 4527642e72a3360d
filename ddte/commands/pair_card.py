"""Measure a pair for its model card: every number in models/README.md comes from here.

--pair names the pair as every command does (a name under configs/pair/, default shipped, or a pair YAML). A pair
laid out as `ddte train-pair` writes one (target/, draft/, tokenizer/ and recipe.json in one folder, like the shipped
pair in models/) gets the full card, with the models in fp32 on CPU: architecture, parameters and training figures
(from recipe.json); held-out loss and perplexity; per-token latency after a 256-token cache and for a 32-node tree
pass, with the target/draft ratios; acceptance 1 − TV(p, q) at T = 1 on target-sampled continuations of held-out
prompts; one T = 0.8 sample. It prints a markdown table and writes everything as JSON.

Any other pair (e.g. smollm2) gets, each model in the pair's own dtype: pass times in the decoding loop and their
ratios, and acceptance at T = 0.6 and 1 on the pair's held-out prompts (for chat prompts: those like the training
data and those unlike it, separately).

Examples:
  ddte pair-card --output models/card.json
  ddte pair-card --pair smollm2 --output models/smollm2-card.json
  ddte pair-card --pair /tmp/pair/pair.yaml --num-prompts 10 --timed-calls 5
"""

from __future__ import annotations

import argparse

from ddte.commands.common import UserError, add_threads_argument, check_output_file, seed_argument, user_errors


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
    parser.add_argument("--groups", nargs="+", default=[], metavar="GROUP",
                        help="measure acceptance on these prompt groups only (like, unlike for chat sets; the "
                        "categories of the mixed workload, e.g. coding math translation writing; default: all)")


def run(args: argparse.Namespace) -> int:
    from ddte.pair_card.shipped import CardSettings, markdown, measure, train_pair_folder
    from decode.pair import read_pair_config

    with user_errors():
        folder = train_pair_folder(read_pair_config(args.pair))
    defaults = {"tree_nodes": (32, 8), "timed_calls": (30, 10), "num_prompts": (100, 24)}
    for name, (folder_default, pair_default) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, folder_default if folder is not None else pair_default)
    for name in ("threads", "cache_len", "tree_nodes", "timed_calls", "num_prompts", "max_new_tokens", "sample_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.heldout_blocks is not None and args.heldout_blocks < 1:
        raise UserError("--heldout-blocks must be at least 1 (leave it out for the recipe's own count)")
    if folder is not None and args.groups:
        raise UserError("--groups picks prompt groups of a pair's chat or mixed prompt set; a `ddte train-pair` "
                        "folder's card measures its held-out code prompts")
    if folder is None and args.heldout_blocks is not None:
        raise UserError("--heldout-blocks measures a `ddte train-pair` folder's held-out loss; this pair's card "
                        "has none")
    output = check_output_file(args.output) if args.output else None
    if folder is None:
        from ddte.pair_card.any_pair import PairCardSettings, measure_pair, pair_markdown

        settings = PairCardSettings(args.pair, args.threads, args.cache_len, args.tree_nodes, args.timed_calls,
                                    args.num_prompts, args.max_new_tokens, args.sample_tokens, args.seed,
                                    tuple(args.groups))
        return _measure_and_print(measure_pair, settings, pair_markdown, output)
    settings = CardSettings(_shown(folder), args.threads, args.cache_len, args.tree_nodes, args.timed_calls,
                            args.num_prompts, args.max_new_tokens, args.heldout_blocks, args.sample_tokens, args.seed)
    return _measure_and_print(measure, settings, markdown, output)


def _shown(folder) -> str:
    """The pair folder as the card names it: relative to the current directory when inside it (models)."""
    from pathlib import Path

    folder, here = Path(folder).resolve(), Path.cwd().resolve()
    return str(folder.relative_to(here)) if folder.is_relative_to(here) else str(folder)


def _measure_and_print(measure_fn, settings, markdown_fn, output) -> int:
    """Measure, write the JSON (when asked), print the tables and the T = 0.8 sample."""
    from pathlib import Path

    from ddte.pair_card.shipped import write_json

    with user_errors():
        result = measure_fn(settings)
    if output is not None:
        write_json(result, Path(output))
    print(markdown_fn(result))
    sample = result["sample_T0.8"]
    print(f"T = 0.8 sample from {sample.get('prompt_id', 'the first held-out prompt')}:")
    print(sample["completion"])
    return 0
