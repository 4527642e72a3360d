"""The one `ddte` console script: a subcommand per job.

Each subcommand lives in its own module and exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int``. Register it in ``SUBCOMMANDS`` below;
``tests/test_cli.py`` keeps this map, the parser and the help texts in sync.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module path, one-line help). Modules are imported only when their subcommand runs
# (or when --help is built), so `ddte --help` stays fast and light.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("decode.cli", "generate text with lossless speculative decoding over delayed trees"),
    "bench": ("decode.bench", "benchmark decoding methods side by side on held-out prompts"),
    "bench-verifiers": ("decode.bench_verifiers", "time every verifier and its exact expectation on CPU"),
    "build-prompts": ("ddte.pair.prompts", "build JSONL prompt sets from held-out stdlib modules"),
    "train-pair": ("ddte.pair.recipe", "train the shipped draft/target pair and its tokenizer from a YAML recipe"),
    "pair-card": ("ddte.pair.card", "measure the pair's losses, latencies and acceptance for the model card"),
    "collect": ("data_gen.cli", "collect the selector's training set: root features and exact labels per action"),
    "relabel": ("data_gen.relabel", "relabel a data set's step times with a latency model measured on this machine"),
    "analyze": ("data_gen.analyze", "per-depth acceptance and p/q distance, best static action, from a data set"),
    "train": ("selector.train", "train a selector on a collected data set (Lightning, tracked in MLflow)"),
    "export": ("selector.export", "export a trained selector to one ONNX file with metadata and a parity check"),
    "pipeline": ("ddte.pipeline", "the main job: collect -> train -> export -> bench on held-out prompts"),
}


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddte",
        description="ddte: train and serve a neural expansion selector for lossless multi-path speculative decoding.",
    )
    from ddte import __version__

    parser.add_argument("--version", action="version", version=f"ddte {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_path)
        doc = (module.__doc__ or help_text).strip()
        sp = sub.add_parser(name, help=help_text, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except UserError as err:
        print(f"ddte {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ddte {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
