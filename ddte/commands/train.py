"""Train a selector on a collected data set (Lightning), tracked in MLflow.

The config is typed YAML (default configs/train/default.yaml) with sections seed_everything, trainer (Lightning's
max_epochs, accelerator, ...), model (objective policy | be, widths, lr, λ and α of Eq. 12), data (data_dir,
verifier, splits by prompt) and run (output_dir, tracking_uri, experiment, baselines, monitor). Any key is
overridden as KEY=VALUE, as in every ddte command (lists take YAML: model.mlp_hidden=[256,32]); an unknown key is
an error.

After training it fits the never-lose guard (the margin on validation prompts, per sampling configuration),
stores it with the best checkpoint and prints the test split's offline figures.

Examples:
  ddte train --config configs/train/default.yaml --data data/collect/default --verifier traversal
  ddte train --data data/collect/default --baselines model.objective=be trainer.max_epochs=40
  ddte train --print-config
  ddte train --data data/collect/default trainer.devices=2 trainer.strategy=ddp    # one job on two processes
  ddte train --data data/collect/default --tracking-uri http://127.0.0.1:5000      # a shared MLflow server

Several devices or nodes (trainer.devices, trainer.num_nodes, trainer.strategy) make one job: one MLflow run,
logged and written by rank 0; each rank trains on its own share of the training split.
"""

from __future__ import annotations

import argparse
import sys

from ddte.commands.common import add_overrides_argument, user_errors

DEFAULT_CONFIG = "configs/train/default.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="training config YAML")
    parser.add_argument("--data", default=None, help="a collected data set (shortcut for data.data_dir=...)")
    parser.add_argument("--verifier", default=None, help="shortcut for data.verifier=... (one selector per verifier)")
    parser.add_argument("--tracking-uri", default=None, help="shortcut for run.tracking_uri=... (any MLflow URI)")
    parser.add_argument("--baselines", action="store_true", help="also fit the sklearn baselines (run.baselines)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    add_overrides_argument(parser, "model.lr=0.001 trainer.max_epochs=20")


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    items: list[str] = []
    for key, value in (("data.data_dir", args.data), ("data.verifier", args.verifier),
                       ("run.tracking_uri", args.tracking_uri)):
        if value is not None:
            items.append(f"{key}={value}")
    if args.baselines:
        items.append("run.baselines=true")
    return items + list(args.overrides)


def run(args: argparse.Namespace) -> int:
    from selector.root.train import format_summary, train
    from selector.root.train_config import config_yaml, load_train_config

    with user_errors(ValueError, FileNotFoundError):
        config = load_train_config(args.config, overrides_from_args(args))
        if args.print_config:
            print(config_yaml(config), end="")
            return 0
        result = train(config)
    if result is None:  # a rank other than 0 of a multi-process job: rank 0 reports
        return 0
    print(format_summary(result))
    sys.stdout.flush()
    return 0
