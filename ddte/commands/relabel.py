"""Relabel a collected data set's costs for another machine: the step time T̂ of every action, and the pass-time
features, from a latency table measured here (or read from a file). Everything else is copied as it is.

Ê[τ+1] depends only on the two models' distributions, while T̂ depends on the hardware that runs them: labels
collected on one machine can train a selector for another. The measurement uses the data set's own collect config
(its pair, latency grid, device and threads) with any KEY=VALUE overrides; the pair must be the one the data set
was collected with. The output folder is written under a temporary name and renamed when complete.

Examples:
  ddte relabel --data data/collect/default --output data/collect/here                 # measure on this machine
  ddte relabel --data data/collect/default --output data/collect/dense latency.sizes=null
  ddte relabel --data data/collect/default --output data/gpu latency.file=gpu.json    # a table measured elsewhere
  ddte relabel --data data/collect/default --output data/gpu --save-latency gpu.json device=cuda
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ddte.commands.common import UserError, user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs="*", metavar="KEY=VALUE",
                        help="overrides of the data set's collect config, e.g. device=cuda latency.file=t.json")
    parser.add_argument("--data", default=None, help="a folder written by `ddte collect`")
    parser.add_argument("--output", default=None, help="new folder for the relabelled data set (must not exist)")
    parser.add_argument("--save-latency", default=None, metavar="FILE", help="also write the latency table as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def split_items(args: argparse.Namespace) -> tuple[Path, Path, list[str]]:
    """(data, output, overrides): a positional that is not KEY=VALUE is refused, naming the flags to use."""
    paths = [i for i in args.items if "=" not in i]
    if paths:
        raise UserError(f"unexpected argument {paths[0]!r}: give --data DIR and --output DIR (and KEY=VALUE "
                        "overrides)")
    if args.data is None or args.output is None:
        raise UserError("give --data DIR and --output DIR (and KEY=VALUE overrides)")
    return Path(args.data), Path(args.output), list(args.items)


def run(args: argparse.Namespace) -> int:
    from data_gen.relabel import check_same_pair, read_source, relabel, relabel_config, relabel_latency
    from ddte_core.paths import staged_file

    source, output, overrides = split_items(args)
    with user_errors(prefix="--data: "):
        metadata = read_source(source)
    check_places(output, args.save_latency)
    with user_errors():
        config = relabel_config(metadata, overrides)
        check_same_pair(metadata, config)
    start = time.perf_counter()
    if not config.latency.file:
        print("measuring the latency model on this machine ...", file=sys.stderr, flush=True)
    with user_errors():
        latency = relabel_latency(config)
        latency.check_pair(metadata.get("pair", {}).get("fingerprint") or latency.pair,
                           f"latency.file {config.latency.file}")
    if args.save_latency:
        with user_errors(OSError, prefix=f"--save-latency {args.save_latency}: "), \
                staged_file(args.save_latency) as tmp:
            tmp.write_text(latency.to_json(), encoding="utf-8")
    with user_errors():
        rows = relabel(source, output, metadata, latency, config, progress=not args.no_progress)
    print(f"relabelled {rows} roots into {output} in {time.perf_counter() - start:.1f} s "
          f"(step times from a {len(latency.lengths)}×{len(latency.sizes)} latency table on "
          f"{latency.machine or latency.device})")
    return 0


def check_places(output: Path, save_latency: str | None) -> None:
    """Refuse, before the measurement, an --output that exists, lies under a file or where nothing can be written,
    and a --save-latency file that cannot be written."""
    from ddte.commands.common import check_output_file
    from ddte_core.paths import folder_is_writable, refuse_file_in_the_way

    if output.exists():
        raise UserError(f"{output} exists; relabelling writes a new folder")
    with user_errors(ValueError):
        refuse_file_in_the_way(output, "--output")
    if not folder_is_writable(output.parent):
        raise UserError(f"--output {output}: its folder is not writable")
    if save_latency is not None:
        check_output_file(save_latency, "--save-latency")
