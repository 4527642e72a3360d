"""Build prompt sets, written as JSONL: code prompts from held-out stdlib modules, or chat prompts (--chat).

A prompt is the text of a module up to and including the header of a function or class and its docstring, i.e. the
point where the body's code should begin. Every record has the ``prompt`` plus provenance: module path, line
numbers, the def/class name, python version and split. Only held-out modules are used unless ``--split train`` is
given (for data collection): held-out prompts never contain text from a training module of the pair whose recipe
--recipe names (the shipped pair's, models/recipe.json, by default). The output is deterministic.

With --chat SET the records are chat messages (``{"messages": [{"role": "user", "content": ...}]}``) for a real
chat model, built from ../shared/data (spec_bench questions, gsm8k, humaneval; $DDTE_SHARED_DATA overrides where):
gsm8k's train/test files are its split; humaneval and the trained spec_bench categories are held out by a hash of
their ids (20 %); spec_bench's extraction, stem and humanities questions are never trained on (held out, group
"unlike"). SET is train, heldout, heldout-like or heldout-unlike. Commands render these rows with the tokenizer's
chat template; the same sets are also read directly as prompt sources chat:SET.

--workload mixed (with --chat) builds the Qwen2.5-Coder pair's mixed workload (prompt sources mixed:SET): the same
split rule over every spec_bench category, RAG included, interleaved by category so that the first 13 held-out
prompts cover all 13 categories (each record's "category" names its own).

Examples:
  ddte build-prompts --output prompts.jsonl
  ddte build-prompts --output train_prompts.jsonl --split train --num-prompts 500 --max-chars 800
  ddte build-prompts --chat heldout-unlike --output chat_unlike.jsonl
  ddte build-prompts --chat heldout --workload mixed --num-prompts 26 --output mixed_heldout.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddte.commands.common import UserError, check_output_file, user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from data_gen.corpus import SPLITS
    from data_gen.prompts import DEFAULT_COUNT, DEFAULT_MAX_CHARS

    parser.add_argument("--output", required=True, help="output JSONL path")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_COUNT, help="prompts to build")
    parser.add_argument("--split", choices=SPLITS, default=None,
                        help="modules to draw from ('train' only for data collection, never for evaluation; default "
                        "heldout); code prompts only: a chat set names its split in --chat")
    parser.add_argument("--max-chars", type=int, default=None,
                        help=f"prompt length cap (code prompts only; default {DEFAULT_MAX_CHARS})")
    parser.add_argument("--chat", default=None, metavar="SET",
                        help="chat prompt set from ../shared/data instead of stdlib code: train, heldout, heldout-like "
                        "or heldout-unlike")
    parser.add_argument("--workload", choices=("chat", "mixed"), default="chat",
                        help="with --chat: the chat workload (SmolLM2's) or the mixed one (every spec_bench category "
                        "by turns; the Qwen2.5-Coder pair's)")
    parser.add_argument("--recipe", default=None, metavar="FOLDER",
                        help="code prompts held out from the pair this folder's recipe.json trained (`ddte train-pair`"
                        "'s output; its corpus split); default: the shipped pair, models/")


def run(args: argparse.Namespace) -> int:
    from data_gen.corpus import python_version
    from data_gen.prompts import DEFAULT_MAX_CHARS, build_prompts, write_jsonl

    if args.num_prompts < 1:
        raise UserError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    code_only = {"--split": args.split, "--max-chars": args.max_chars, "--recipe": args.recipe}
    given = [name for name, value in code_only.items() if value is not None]
    if args.chat is not None and given:
        raise UserError(f"{given[0]} applies to code prompts; a chat set names its own split (--chat train, heldout, "
                        "heldout-like or heldout-unlike)")
    args.split = args.split or "heldout"
    args.max_chars = DEFAULT_MAX_CHARS if args.max_chars is None else args.max_chars
    if args.max_chars < 40:
        raise UserError(f"--max-chars must be at least 40, got {args.max_chars}")
    heldout_fraction = None if args.chat is not None else _recipe_heldout_fraction(args.recipe)
    if args.workload != "chat" and args.chat is None:
        raise UserError("--workload applies to chat prompt sets: give --chat SET as well")
    output = check_output_file(args.output)
    if args.chat is not None:
        return _write_chat(args, Path(output))
    records = build_prompts(args.num_prompts, args.split, args.max_chars, heldout_fraction)
    if not records:
        raise UserError("no prompts could be built (no documented def/class fits --max-chars)")
    write_jsonl(records, Path(output))
    modules = len({r["module"] for r in records})
    print(f"wrote {len(records)} {args.split} prompts from {modules} modules (python {python_version()}) to {output}")
    if len(records) < args.num_prompts:
        print(f"note: only {len(records)} candidates exist, fewer than --num-prompts {args.num_prompts}")
    return 0


def _recipe_heldout_fraction(folder: str | None) -> float:
    """The corpus split of the pair whose recipe ``folder`` holds (the shipped pair's by default): held-out prompts
    must come from modules that pair never trained on."""
    from ddte.train_pair.config import read_recipe, recipe_heldout_fraction
    from ddte_core.paths import INSTALL_ROOT

    path = Path(folder) if folder is not None else INSTALL_ROOT / "models"
    if not (path / "recipe.json").is_file():
        raise UserError(f"--recipe: {str(path)!r} holds no recipe.json (a folder `ddte train-pair` wrote)")
    with user_errors(prefix="--recipe: "):
        return recipe_heldout_fraction(read_recipe(path))


def _write_chat(args: argparse.Namespace, output: Path) -> int:
    from collections import Counter

    from data_gen.chat_prompts import build_chat_prompts
    from data_gen.prompts import write_jsonl

    try:
        records = build_chat_prompts(args.chat, count=args.num_prompts, workload=args.workload)
    except (ValueError, OSError) as err:
        raise UserError(str(err).splitlines()[0]) from err
    write_jsonl(records, output)
    sources = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r["source"] for r in records).items()))
    print(f"wrote {len(records)} {args.workload} prompts of set {args.chat} ({sources}) to {output}")
    if len(records) < args.num_prompts:
        print(f"note: set {args.chat} has only {len(records)} prompts, fewer than --num-prompts {args.num_prompts}")
    return 0
