"""The selector's training config: typed YAML with ``KEY=VALUE`` overrides, as for every ddte command
(ddte_core/yamlconfig.py; default configs/train/default.yaml). :class:`TrainConfig`, five sections key for key:

  seed_everything   the seed of everything (splits have their own data.split_seed)
  trainer           lightning.pytorch.Trainer arguments (max_epochs, accelerator, devices, num_nodes, strategy,
                    ...): TrainerOptions
  model             selector.root.model.SelectorModule: objective (policy | be), d_proj, mlp_hidden, dropout, lr,
                    weight_decay, lam (λ), alpha (α) of Eq. 12, min_lr_ratio: ModelOptions
  data              selector.root.data.SelectorDataModule: data_dir, verifier (one selector per verifier), val_fraction,
                    test_fraction, split_seed, batch_size, log1p_scalars, num_workers: DataOptions
  run               output_dir (checkpoints + summary.json), tracking_uri (default: $MLFLOW_TRACKING_URI, else
                    sqlite:///mlflow.db resolved to an absolute path, artifacts in mlartifacts/ beside it),
                    experiment, run_name, baselines (also fit the sklearn baselines), monitor (checkpoint metric),
                    threads: RunOptions

Any key is overridden as KEY=VALUE (lists take YAML: model.mlp_hidden=[256,32]); an unknown key is an error.
:func:`load_train_config` reads and checks one; the job (selector/root/train.py) runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddte_core.paths import folder_is_writable, refuse_file_in_the_way
from ddte_core.tracking import resolve_tracking_uri
from ddte_core.yamlconfig import load_yaml_config
from decode.policies.files.selector_file import OBJECTIVES

DEFAULT_CONFIG = "configs/train/default.yaml"


@dataclass
class TrainerOptions:
    """``lightning.pytorch.Trainer`` arguments (the ``trainer`` section); the logger and callbacks are ddte's.
    ``devices`` per node, ``num_nodes`` and ``strategy`` (auto, ddp, ddp_spawn, ...) spread one job over several
    processes."""

    accelerator: str = "cpu"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"
    max_epochs: int = 40
    log_every_n_steps: int = 10
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = False
    enable_model_summary: bool = True
    deterministic: bool = False


@dataclass
class ModelOptions:
    """:class:`selector.root.model.SelectorModule`'s arguments (the ``model`` section). The network's input and output
    widths come from the data set, never from the config."""

    objective: str = "policy"
    d_proj: int = 128
    mlp_hidden: list[int] = field(default_factory=lambda: [512, 32])
    dropout: float = 0.1
    lr: float = 1e-3
    weight_decay: float = 1e-4
    lam: float = 1.0
    alpha: float = 0.1
    min_lr_ratio: float = 0.1


@dataclass
class DataOptions:
    """:class:`selector.root.data.SelectorDataModule`'s arguments (the ``data`` section)."""

    data_dir: str = "data/collect/default"
    verifier: str = "specinfer"
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    split_seed: int = 0
    batch_size: int = 64
    log1p_scalars: list[str] | None = None  # null: selector.root.data.DEFAULT_LOG1P_SCALARS
    num_workers: int = 0


@dataclass
class RunOptions:
    """Where results go and how the run is tracked (the ``run`` section of the config).

    Args:
        output_dir: checkpoints and summary.json go to ``output_dir/<verifier>-<objective>-<run id>/``.
        tracking_uri: MLflow tracking URI; null = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db (made absolute).
        experiment: MLflow experiment name.
        run_name: MLflow run name (default: ``<verifier>-<objective>``).
        baselines: also fit the sklearn baselines, each logged as its own MLflow run.
        baseline_max_samples: (root, action) samples the gradient-boosted baseline trains on.
        monitor: validation metric that picks the best checkpoint.
        monitor_mode: ``max`` or ``min`` for ``monitor``.
        threads: torch CPU threads while training (null: torch's default). The MLP is small: one thread is
            nearly as fast, and more threads beside another job oversubscribe a shared machine (docs/selector.md).
        parent_run_id: an MLflow run (of the same experiment) to nest this run under, e.g. a pipeline's.
        progress: print one line per epoch (train and validation loss, validation ratio vs the best static action).
    """

    output_dir: str = "runs/selector"
    tracking_uri: str | None = None
    experiment: str = "ddte-selector"
    run_name: str | None = None
    baselines: bool = False
    baseline_max_samples: int = 60000
    monitor: str = "val/ratio_vs_static"
    monitor_mode: str = "max"
    threads: int | None = 1
    parent_run_id: str | None = None
    progress: bool = True


@dataclass
class TrainConfig:
    """One training run: the YAML of ``ddte train``, key for key."""

    seed_everything: int = 0
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    run: RunOptions = field(default_factory=RunOptions)


def load_train_config(path: str | Path | None = DEFAULT_CONFIG, overrides: Sequence[str] = ()) -> TrainConfig:
    """The YAML at ``path`` (None: the defaults) with ``KEY=VALUE`` overrides on top, in order; ValueError naming
    the first bad file, key or value."""
    config = load_yaml_config(TrainConfig, path, list(overrides))
    check_train_config(config)
    return config


def check_train_config(config: TrainConfig) -> None:
    """The values a type cannot check (the data folder and its verifier are checked when the data set is read)."""
    resolve_tracking_uri(config.run.tracking_uri)  # a scheme MLflow cannot store under, or an unwritable folder
    if config.model.objective not in OBJECTIVES:
        raise ValueError(f"model.objective must be one of {', '.join(OBJECTIVES)}, got {config.model.objective!r}")
    if config.run.monitor_mode not in ("max", "min"):
        raise ValueError(f"run.monitor_mode must be max or min, got {config.run.monitor_mode!r}")
    # Lightning reads max_epochs=-1 as "train forever", which the learning-rate schedule cannot span
    for key in ("max_epochs", "num_nodes", "log_every_n_steps"):
        if getattr(config.trainer, key) < 1:
            raise ValueError(f"trainer.{key} must be >= 1, got {getattr(config.trainer, key)}")
    if config.data.batch_size < 1:
        raise ValueError(f"data.batch_size must be >= 1, got {config.data.batch_size}")
    val, test = config.data.val_fraction, config.data.test_fraction
    if not (0 < val < 1 and 0 < test < 1 and val + test < 1):
        raise ValueError(f"data.val_fraction ({val}) and data.test_fraction ({test}) must be in (0, 1) with a sum "
                         "below 1")
    refuse_file_in_the_way(config.run.output_dir, "run.output_dir")
    if not folder_is_writable(Path(config.run.output_dir)):
        raise ValueError(f"run.output_dir {config.run.output_dir}: no file can be written there")
    if not config.model.lr > 0:
        raise ValueError(f"model.lr must be > 0, got {config.model.lr}")
    if config.trainer.accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"trainer.accelerator={config.trainer.accelerator}: torch sees no CUDA device here "
                             "(trainer.accelerator=cpu, or run on a GPU machine)")


def config_yaml(config: TrainConfig) -> str:
    """The resolved config as YAML (``ddte train --print-config``, and the run's config.yaml artifact)."""
    import yaml

    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
