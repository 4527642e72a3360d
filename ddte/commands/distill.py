"""Distil a draft from its target: maximise the draft's acceptance under speculative sampling (DistillSpec).

The draft learns the target's next-token laws on windows of the stdlib training split and, after a warm start, on
sequences it samples itself (on-policy: the contexts it meets when drafting). The loss is a divergence between the
two laws at the sampling temperatures: fkl, rkl, tvd (whose minimisation maximises β = 1 − TV directly) or jsd.
Works for any pair of HF causal LMs sharing a vocabulary, from an existing draft or from scratch. Tracked in MLflow
(config, loss curves, held-out acceptance per validation, the model); the draft is written with save_pretrained
(safetensors) into a new folder, atomically.

Examples:
  ddte distill --config configs/distill/default.yaml
  ddte distill --output runs/distill/fkl divergence=fkl train.steps=400
  ddte distill --output runs/distill/scratch init=scratch shape.hidden_size=192 shape.num_hidden_layers=2
  ddte distill --output runs/distill/ddp trainer.devices=2 trainer.strategy=ddp    # one job on two processes
  ddte distill --tracking-uri http://127.0.0.1:5000                                # a shared MLflow server

Several devices or nodes (trainer.devices, trainer.num_nodes, trainer.strategy) make one job: one MLflow run and
one draft, written by rank 0; each rank trains on batches of its own.
"""

from __future__ import annotations

import argparse

from ddte.commands.common import add_overrides_argument, user_errors

DEFAULT_CONFIG = "configs/distill/default.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_overrides_argument(parser, "divergence=fkl")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="distill YAML")
    parser.add_argument("--output", default=None, help="folder for the distilled draft (overrides the config's)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI, e.g. http://host:5000 (shortcut for tracking.tracking_uri=...)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from distill.config import load_distill_config
    from distill.run import distill

    overrides = list(args.overrides) + ([f"output={args.output}"] if args.output else [])
    if args.tracking_uri:
        overrides.append(f"tracking.tracking_uri={args.tracking_uri}")
    with user_errors():
        config = load_distill_config(args.config, overrides)
    with user_errors():
        result = distill(config, progress=not args.no_progress)
    if result is None:  # a rank other than 0 of a multi-process job: rank 0 reports
        return 0
    temps = sorted(k for k in result.after if k.startswith("acceptance_T"))
    print(" ".join(f"{k}: {result.before[k]:.3f} -> {result.after[k]:.3f}" for k in temps)
          + f" (held-out windows; {result.summary['steps']} steps in {result.summary['train_seconds']:.0f} s)")
    print(f"wrote {result.output}; MLflow run {result.run_id} ({result.tracking_uri})")
    return 0
