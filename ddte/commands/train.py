"""Train a selector on a collected data set (Lightning), tracked in MLflow.

The config is a LightningCLI YAML (default configs/train/default.yaml) with sections seed_everything, trainer,
model (objective policy | be, widths, lr, λ and α of Eq. 12), data (data_dir, verifier, splits by prompt) and run
(output_dir, tracking_uri, experiment, baselines, monitor). Any key is overridden as KEY=VALUE (lists and dicts
take YAML: model.mlp_hidden=[256,32]); after `--`, LightningCLI's own flags pass through.

After training it fits the never-lose guard (the margin on validation prompts, per sampling configuration),
stores it with the best checkpoint and prints the test split's offline figures.

Examples:
  ddte train --config configs/train/default.yaml --data data/collect/default --verifier traversal
  ddte train --data data/collect/default model.objective=be trainer.max_epochs=40 --baselines
  ddte train --print-config
"""

from __future__ import annotations

import argparse
import sys

from ddte.commands.common import UserError, deprecated

DEFAULT_CONFIG = "configs/train/default.yaml"
OWN_FLAGS = ("--baselines", "--print-config")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="training config YAML")
    parser.add_argument("--data", default=None, help="a collected data set (shortcut for data.data_dir=...)")
    deprecated(parser, "--data-dir", "--data", "data")
    deprecated(parser, "--set", "a trailing KEY=VALUE", "set_overrides", append=True, default=[])
    parser.add_argument("--verifier", default=None, help="shortcut for data.verifier=... (one selector per verifier)")
    parser.add_argument("--tracking-uri", default=None, help="shortcut for run.tracking_uri=... (any MLflow URI)")
    parser.add_argument("--baselines", action="store_true", help="also fit the sklearn baselines (run.baselines)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, metavar="KEY=VALUE",
                        help="config overrides, e.g. model.lr=0.001 trainer.max_epochs=20 (after the options)")


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    items = list(args.set_overrides)
    for key, value in (("data.data_dir", args.data), ("data.verifier", args.verifier),
                       ("run.tracking_uri", args.tracking_uri)):
        if value is not None:
            items.append(f"{key}={value}")
    if args.baselines or "--baselines" in args.overrides:
        items.append("run.baselines=true")
    return items + [o for o in args.overrides if o not in OWN_FLAGS]


def run(args: argparse.Namespace) -> int:
    from selector.train import format_summary, one_line, print_config, train_selector

    overrides = overrides_from_args(args)
    try:
        if args.print_config or "--print-config" in args.overrides:
            print_config(args.config, overrides)
            return 0
        result = train_selector(args.config, overrides)
    except (ValueError, FileNotFoundError) as err:
        raise UserError(one_line(str(err))) from err
    print(format_summary(result))
    sys.stdout.flush()
    return 0



