"""Build prompt sets from held-out stdlib modules, written as JSONL.

A prompt is the text of a module up to and including the header of a function or class and its docstring, i.e. the
point where the body's code should begin. Every record has the ``prompt`` plus provenance: module path, line
numbers, the def/class name, python version and split. Only held-out modules are used unless ``--split train`` is
given (for data collection): held-out prompts never contain text from a training module. The output is
deterministic.

Examples:
  ddte build-prompts --output prompts.jsonl
  ddte build-prompts --output train_prompts.jsonl --split train --num-prompts 500 --max-chars 800
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddte.commands.common import UserError, check_output_file, deprecated


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from data_gen.corpus import HELDOUT_FRACTION, SPLITS
    from data_gen.prompts import DEFAULT_COUNT, DEFAULT_MAX_CHARS

    parser.add_argument("--output", "-o", default=None, help="output JSONL path (required)")
    deprecated(parser, "--out", "--output", "output")
    parser.add_argument("--num-prompts", "-n", type=int, default=DEFAULT_COUNT, help="prompts to build")
    deprecated(parser, "--count", "--num-prompts", "num_prompts", type=int)
    parser.add_argument("--split", choices=SPLITS, default="heldout",
                        help="modules to draw from ('train' only for data collection, never for evaluation)")
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS, help="prompt length cap")
    parser.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION,
                        help="held-out fraction of the corpus split (must match the pair's recipe)")


def run(args: argparse.Namespace) -> int:
    from data_gen.corpus import python_version
    from data_gen.prompts import build_prompts, write_jsonl

    if args.output is None:
        raise UserError("--output is required")
    if args.num_prompts < 1:
        raise UserError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.max_chars < 40:
        raise UserError(f"--max-chars must be at least 40, got {args.max_chars}")
    if not 0.0 < args.heldout_fraction < 1.0:
        raise UserError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    output = check_output_file(args.output)
    records = build_prompts(args.num_prompts, args.split, args.max_chars, args.heldout_fraction)
    if not records:
        raise UserError("no prompts could be built (no documented def/class fits --max-chars)")
    write_jsonl(records, Path(output))
    modules = len({r["module"] for r in records})
    print(f"wrote {len(records)} {args.split} prompts from {modules} modules (python {python_version()}) to {output}")
    if len(records) < args.num_prompts:
        print(f"note: only {len(records)} candidates exist, fewer than --num-prompts {args.num_prompts}")
    return 0
