"""Train the acceptance model on a dense data set (Lightning, tracked in MLflow) and export it to ONNX.

β̂ at a trunk node, from what a per-node policy may read there: the draft's hidden state, its entropy and top
probability, the depth and the temperature (selector/acceptance/acceptance.py). The model starts from the entropy and
adds a residual on the hidden state; the best validation loss is kept. It prints the test prompts' R², cross-entropy and
calibration beside the entropy alone, overall and per category, and checks the ONNX file against torch.
An expander fitted with `ddte expander --acceptance FILE` reads β̂ from it. data.label=realized fits the drawn tokens'
realized acceptance min(1, p(x)/q(x)) instead of β (a dense set of schema 2; the test figures stay against β).

The config is typed YAML (default configs/acceptance/default.yaml); any key is overridden as KEY=VALUE.

Examples:
  ddte dense-labels --pair qwen-coder --output data/dense/qwen --num-prompts 200 --first-prompt 50
  ddte acceptance --data data/dense/qwen --output models/acceptance/qwen-coder.onnx
  ddte acceptance --data data/dense/qwen --output a.onnx model.width=32 trainer.max_epochs=10
  ddte acceptance --data data/dense/qwen --output realized.onnx data.label=realized
"""

from __future__ import annotations

import argparse

from ddte.commands.common import add_overrides_argument, check_output_file, user_errors

DEFAULT_CONFIG = "configs/acceptance/default.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="acceptance model config YAML")
    parser.add_argument("--data", default=None, help="a dense data set (ddte dense-labels; data.data_dir=...)")
    parser.add_argument("--output", default=None, help="the .onnx file to write (run.output=...)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (run.tracking_uri=...)")
    add_overrides_argument(parser, "model.width=32 trainer.max_epochs=10")


def run(args: argparse.Namespace) -> int:
    from selector.acceptance.acceptance_data import read_dense_metadata
    from selector.acceptance.acceptance_train import format_acceptance, load_acceptance_config, train_acceptance

    overrides = [f"{key}={value}" for key, value in (("data.data_dir", args.data), ("run.output", args.output),
                                                     ("run.tracking_uri", args.tracking_uri)) if value is not None]
    with user_errors(ValueError):
        config = load_acceptance_config(args.config, overrides + list(args.overrides))
        if not config.data.data_dir:
            raise ValueError("no data set: give --data DENSE_FOLDER (or data.data_dir=...)")
        read_dense_metadata(config.data.data_dir)
    check_output_file(config.run.output)
    with user_errors(ValueError, OSError):
        result = train_acceptance(config)
    print(format_acceptance(result))
    return 0
