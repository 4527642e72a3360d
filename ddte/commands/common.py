"""What every command shell shares: the one user-facing error type, the flag conventions and their helpers.

Conventions, the same in every subcommand (tests/ddte/test_cli.py checks them):

* ``--output`` names what a command writes (a file or a folder);
* ``--data`` names a collected data set it reads;
* ``KEY=VALUE`` positionals override config keys (dotted for sections), anywhere among the options;
* ``--threads`` sets torch's CPU threads, default 1 (one thread gives stable speed figures and never
  oversubscribes a shared machine; 0 = torch's default);
* ``--device`` is where the models run, default cpu everywhere (``collect``: its config's ``device``, also cpu);
* ``--max-new-tokens``, ``--num-prompts``, ``--temperature``, ``--top-p``, ``--seed``, ``--device``, ``--dtype``
  (the models'), ``--trees`` (a count), ``--shapes`` (tree shapes), ``--repeats`` (runs per prompt) and
  ``--timed-calls`` (timed calls per figure) mean the same thing wherever they appear; no command has short flags.

Libraries raise plain exceptions; :func:`user_errors` turns the expected ones into :class:`UserError`, which
``ddte`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ddte_core.yamlconfig import MAX_SEED


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2, no traceback."""


@contextlib.contextmanager
def user_errors(*kinds: type[BaseException], prefix: str = "") -> Iterator[None]:
    """Turn library exceptions of ``kinds`` (default ValueError, OSError, KeyError) into a one-line UserError."""
    kinds = kinds or (ValueError, OSError, KeyError)
    try:
        yield
    except UserError:
        raise
    except kinds as err:
        raise UserError(prefix + one_line(err)) from err


def one_line(err: BaseException) -> str:
    """The first line of an exception's message (KeyError's quotes removed; the type name if it has none)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    if isinstance(err, OSError) and err.strerror:
        text = f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    text = str(text).strip().splitlines()[0] if str(text).strip() else type(err).__name__
    return text


# Every command's --device default (collect's comes from its config, whose default is the same): CPU, where the
# shipped selectors' step times were measured and the figures are stable; cuda or auto (cuda when present) opt in.
DEFAULT_DEVICE = "cpu"
DEVICE_HELP = "where the models run (auto: cuda when available, else cpu)"


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0: torch's own choice)")




def seed_argument(text: str) -> int:
    """argparse ``type`` of every ``--seed``: an integer in [0, MAX_SEED], refused at parse time otherwise."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer in [0, {MAX_SEED}], got '{text}'") from None
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"an integer in [0, {MAX_SEED}], got {seed}")
    return seed


def apply_threads(threads: int) -> None:
    if threads < 0:
        raise UserError(f"--threads must be >= 0, got {threads}")
    cores = os.cpu_count() or 1
    if threads > cores:
        raise UserError(f"--threads {threads} is more than this machine's {cores} cores (0: torch's own choice)")
    if threads:
        import torch

        torch.set_num_threads(threads)


def add_overrides_argument(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", default=[],
                        help=f"config overrides, dotted for sections, anywhere on the command line (e.g. {example})")


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """--pair / --target / --draft / --tokenizer / --device / --dtype: which models, on what."""
    from decode.pair import DEFAULT_DRAFT, DEFAULT_TARGET

    parser.add_argument("--pair", default=None, help="a pair: a name under configs/pair/ (shipped, smollm2, "
                        "qwen-coder) or a YAML with keys target, draft, tokenizer, target_dtype, draft_dtype (instead "
                        "of --target/--draft/--tokenizer)")
    parser.add_argument("--target", default=None,
                        help=f"target model: an HF folder or a .gguf file (default: {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=None,
                        help=f"draft model: an HF folder or a .gguf file (default: {DEFAULT_DRAFT})")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: found beside the target)")
    parser.add_argument("--device", default=DEFAULT_DEVICE, choices=("cpu", "cuda", "auto"),
                        help=DEVICE_HELP)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="both models' dtype (auto: the pair's own dtypes, else float32 on CPU and "
                        "bfloat16 on CUDA)")
    parser.add_argument("--draft-forward", default="fast", choices=("fast", "hf"),
                        help="the draft's forward: ddte's fast Llama path (same logits) or HF's")
    add_kernels_argument(parser)


def add_kernels_argument(parser: argparse.ArgumentParser, default_note: str = "the pair's, auto") -> None:
    """``--kernels``, meaning one thing in every command that loads a pair."""
    parser.add_argument("--kernels", default=None, metavar="auto|PATH|target=PATH,draft=PATH",
                        help=f"the linear layers' kernel path per model (default: {default_note}). auto measures "
                        "each path this CPU can run once (cached beside the latency tables) and takes the fastest: "
                        "for the target only paths exact in its own dtype (default, onednn, onednn-wide), for the "
                        "draft any (int8-dynamic, int8-weight: another q, which the verifier sees as sampled). "
                        "default opts out")


def check_kernels_argument(value: str | None) -> None:
    """UserError for a --kernels that does not parse (before any model loads)."""
    from decode.models.kernel_choice import KernelRequest

    if value is not None:
        with user_errors():
            KernelRequest.parse(value)


def check_pair_arguments(args: argparse.Namespace) -> None:
    """UserError for --pair beside --target or --draft: the pair names both, and one of them would go unread."""
    given = [flag for flag, value in (("--target", args.target), ("--draft", args.draft)) if value is not None]
    if args.pair and given:
        raise UserError(f"--pair names the target and the draft: do not combine it with {' or '.join(given)}")


def pair_request(args: argparse.Namespace):
    """The :class:`decode.session.PairRequest` --pair, or --target/--draft/--tokenizer, name (with --device, --dtype,
    --draft-forward)."""
    from decode.session import PairRequest

    return PairRequest(args.pair or None, args.target, args.draft, args.tokenizer, args.device, args.dtype,
                       getattr(args, "draft_forward", "fast") == "fast")


def load_pair_from_args(args: argparse.Namespace):
    """The pair named by --pair, or by --target/--draft/--tokenizer, on the default kernels (a command opens it on
    this machine's through decode/session.py once its own checks have passed); UserError when it cannot be loaded or
    --kernels does not parse."""
    check_pair_before_load(args)
    with user_errors():
        return pair_request(args).load()


def check_pair_before_load(args: argparse.Namespace) -> None:
    """UserError, before any model loads, for what the pair's loading and kernels would refuse after it: --pair beside
    --target/--draft, a pair config that does not read, and a --kernels (or the pair's kernels:) that does not parse
    or fixes a path a model cannot run in its dtype here (decode.pair.check_kernel_request), and a machine cache
    ($DDTE_LATENCY_CACHE, $DDTE_CACHE) where no folder can be kept."""
    from ddte_core.paths import latency_cache
    from decode.pair import check_kernel_request
    from decode.pair_spec import read_pair_config

    check_pair_arguments(args)
    check_kernels_argument(getattr(args, "kernels", None))
    with user_errors():
        latency_cache()
        spec = read_pair_config(args.pair) if args.pair else None
        check_kernel_request(spec, getattr(args, "device", DEFAULT_DEVICE), getattr(args, "dtype", None),
                             getattr(args, "kernels", None))


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def shell_hooks(args: argparse.Namespace, prefix: Callable[[str, object], str] | None = None, release: bool = False):
    """The session builder's :class:`decode.session.Hooks` for a command shell: each measurement announced and each
    result line printed on stderr as they come, a bar during a measurement, and each step's library error as one
    line: --kernels' and --latency's as such, the others after ``prefix(step, method)`` (the flag or method they
    came from; none by default). ``release``: the command never runs the stock models, whose weights then go as the
    kernels' copies are made (decode/models/release.py)."""
    from decode.session import Hooks

    def errors(step: str, method) -> contextlib.AbstractContextManager:
        if step == "kernels":
            return user_errors(OSError, ValueError)
        if step == "latency":
            return user_errors(OSError, ValueError, prefix=f"--latency {getattr(args, 'latency', 'machine')}: ")
        return user_errors(prefix=prefix(step, method) if prefix is not None else "")

    return Hooks(announce=to_stderr, report=to_stderr, errors=errors, progress=True, release=release)


def open_machine_pair(pair, args: argparse.Namespace):
    """:func:`decode.session.open_pair`: ``pair`` on the kernels --kernels names (default: the pair's, auto: this
    machine's fastest, measured once and cached beside the latency tables), the kernels line on stderr; the
    session."""
    from decode.session import open_pair

    return open_pair(pair, getattr(args, "kernels", None), shell_hooks(args))


def check_output_file(path: str | Path, what: str = "--output") -> Path:
    """Refuse, before any work, an output file that cannot be written. Nothing is created: its folders are made when
    the file is written (ddte_core.paths.staged_file), so a refusal after this check leaves no empty folder."""
    from ddte_core.paths import folder_is_writable, refuse_file_in_the_way, writable_file

    if not str(path).strip():
        raise UserError(f"{what} is empty; give a file name")
    try:
        path = writable_file(path)  # a link written through; a device, pipe or link loop refused
    except ValueError as err:
        raise UserError(f"{what} {err}") from err
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file name")
    try:
        refuse_file_in_the_way(path, what, folder=False)
    except ValueError as err:
        raise UserError(str(err)) from err
    if not folder_is_writable(path.parent):
        raise UserError(f"{what} {path}: its folder is not writable")
    return path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help (unless it has none or says it already); examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or default is False or default == []
                or "default" in text or action.option_strings == [] and action.nargs in ("*", "?")):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else default
        return f"{text} (default: {shown})"


def add_latency_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--latency", default="machine", metavar="machine|fitted|FILE",
        help="the step-time model of a --selector, --expander or --policy-file: 'machine' (default: this machine's "
             "latency table, measured once and cached under $DDTE_CACHE/latency, or $DDTE_LATENCY_CACHE; it picks "
             "each file's static fallback), 'fitted' (each file's choices as fitted, on the machine it was fitted "
             "on), or a latency table JSON of this pair")


def check_latency_argument(value: str) -> None:
    """UserError for a --latency that is neither a choice nor an existing file (before any model loads)."""
    from decode.session import LATENCY_SOURCES

    if value not in LATENCY_SOURCES and not Path(value).is_file():
        raise UserError(f"--latency: {value!r} is not machine, fitted or an existing latency table file")
