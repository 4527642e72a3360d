"""Train a selector on a collected data set (Lightning), tracked in MLflow.

The config is a LightningCLI YAML (default configs/train/default.yaml) with five sections:

  seed_everything   the seed of everything (splits have their own data.split_seed)
  trainer           lightning.pytorch.Trainer arguments (max_epochs, accelerator, devices, ...)
  model             selector.model.SelectorModule: objective (policy | be), d_proj, mlp_hidden, dropout, lr,
                    weight_decay, lam (λ), alpha (α) of Eq. 12
  data              selector.data.SelectorDataModule: data_dir, verifier (one selector per verifier), val_fraction,
                    test_fraction, split_seed, batch_size, log1p_scalars
  run               output_dir (checkpoints + summary.json), tracking_uri (default: $MLFLOW_TRACKING_URI, else
                    sqlite:///mlflow.db resolved to an absolute path, artifacts in mlartifacts/ beside it),
                    experiment, run_name, baselines (also fit the sklearn baselines), monitor (checkpoint metric)

Any key is overridden as KEY=VALUE (lists and dicts take YAML: model.mlp_hidden=[256,32]); LightningCLI's own
``--key value`` flags pass through after ``--``.

Logged to MLflow: the resolved config (artifact config.yaml and params config/...), the data fingerprint, the git
commit, per epoch the offline metrics of the validation split (throughput ratio vs the best static action per
sampling config, vs the per-root oracle, regret; selector/metrics.py), the test metrics of the best checkpoint,
plots, the best checkpoint and summary.json. At the end a table of the test metrics and the run id are printed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddte_core.tracking import artifact_location, git_commit, quiet_lightning, resolve_tracking_uri
from selector.reporting import fit_guard, log_head_room, log_plots

DEFAULT_CONFIG = "configs/train/default.yaml"
OWN_FLAGS = ("--baselines", "--print-config")


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
            nearly as fast and cannot oversubscribe a shared machine (2 threads beside another job ran 15x slower).
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
    monitor_mode: Literal["max", "min"] = "max"
    threads: int | None = 1
    parent_run_id: str | None = None
    progress: bool = True


@dataclass
class TrainResult:
    """What a training run produced."""

    checkpoint_path: Path
    run_id: str | None
    metrics: dict[str, float]
    summary_path: Path
    tracking_uri: str
    baselines: dict[str, dict[str, float]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- the CLI


def _cli_class():
    """LightningCLI subclass (built lazily: `ddte --help` must not import lightning)."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import MLFlowLogger

    class EpochLine(Callback):
        """One line per epoch (the progress bar is off in CI logs): loss and the validation throughput ratio."""

        def on_validation_epoch_end(self, trainer, module) -> None:
            if trainer.sanity_checking:
                return
            m = trainer.callback_metrics
            parts = [f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"]
            for key, label in (("train/loss", "train loss"), ("val/loss", "val loss"),
                               ("val/ratio_vs_static", "val ratio vs static")):
                if key in m:
                    parts.append(f"{label} {float(m[key]):.4f}")
            print(", ".join(parts), flush=True)

    class SelectorCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.add_class_arguments(RunOptions, "run")
            # The network's input and output widths come from the data set, never from the config.
            parser.link_arguments("data.hidden_sizes", "model.hidden_sizes", apply_on="instantiate")
            parser.link_arguments("data.num_actions", "model.num_actions", apply_on="instantiate")

        def instantiate_trainer(self, **kwargs: Any):
            run = self.config_init["run"]
            verifier, objective = self.datamodule.hparams.verifier, self.model.hparams.objective
            self.tracking_uri = resolve_tracking_uri(run.tracking_uri)
            self.mlflow_logger = MLFlowLogger(
                experiment_name=run.experiment,
                run_name=run.run_name or f"{verifier}-{objective}",
                tracking_uri=self.tracking_uri,
                artifact_location=artifact_location(self.tracking_uri),
                tags={"ddte.verifier": verifier, "ddte.objective": objective,
                      **({"mlflow.parentRunId": run.parent_run_id} if run.parent_run_id else {})},
            )
            run_id = self.mlflow_logger.run_id  # creates the run now: its id names the checkpoint folder
            self.out_dir = Path(run.output_dir) / f"{verifier}-{objective}-{run_id}"
            self.checkpoint = ModelCheckpoint(
                dirpath=self.out_dir, filename="best", monitor=run.monitor, mode=run.monitor_mode, save_top_k=1,
                auto_insert_metric_name=False, enable_version_counter=False,
            )
            callbacks = list(self.config_init["trainer"].get("callbacks") or []) + [self.checkpoint]
            if run.progress:
                callbacks.append(EpochLine())
            return super().instantiate_trainer(logger=self.mlflow_logger, callbacks=callbacks, **kwargs)

    return SelectorCLI


def normalise_overrides(items: Sequence[str]) -> list[str]:
    """KEY=VALUE items -> LightningCLI's ``--KEY=VALUE``; ``--flag value`` pairs, and everything after ``--``, pass."""
    out: list[str] = []
    raw = flag_wants_value = False
    for item in items:
        if item == "--" and not raw:
            raw = True
        elif raw or flag_wants_value:
            out.append(item)
            flag_wants_value = False
        elif item.startswith("-"):
            out.append(item)
            flag_wants_value = "=" not in item
        elif "=" in item:
            out.append("--" + item)
        else:
            raise ValueError(f"override '{item}' is not KEY=VALUE (e.g. model.lr=0.001)")
    return out


def build_cli_args(config: str | Path, overrides: Sequence[str]) -> list[str]:
    """The argument list for LightningCLI: the config file, then the overrides in order (later ones win)."""
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"config file '{config}' not found")
    return ["--config", str(path), *normalise_overrides(overrides)]


def make_cli(args: list[str]):
    """Parse and instantiate (model, data module, trainer, logger) without running anything."""
    from jsonargparse import ArgumentError

    from selector.data import SelectorDataModule
    from selector.model import SelectorModule

    try:
        return _cli_class()(
            SelectorModule, SelectorDataModule, args=args, run=False, save_config_callback=None,
            auto_configure_optimizers=False, load_from_checkpoint_support=False, seed_everything_default=0,
            parser_kwargs={"exit_on_error": False, "prog": "ddte train"},
        )
    except ArgumentError as err:
        raise ValueError(one_line(str(err))) from err


def one_line(message: str) -> str:
    """jsonargparse errors span several lines (key, union subtypes, per-type errors, value): keep one line."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return message.strip()
    parts = [lines[0].rstrip(":")]
    subtypes = next((ln for ln in lines if ln.startswith("Subtypes:")), None)
    expected = next((ln for ln in lines if ln.startswith("Expected")), None)
    given = next((ln for ln in lines if ln.startswith("Given value:")), None)
    if subtypes:
        parts.append("expected one of " + subtypes.split(":", 1)[1].strip())
    elif expected:
        parts.append(expected)
    if given and (not expected or "Got value" not in expected):
        parts.append(given)
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------- the run


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value
    return out


def _log_run_facts(cli, config_yaml: str, info: dict[str, Any]) -> None:
    """Config (artifact; params for the sections Lightning does not log itself), the data set as the run's input,
    the environment, data fingerprint, git commit, split sizes, static baselines."""
    import yaml

    from ddte_core.tracking import log_data_set_input, log_environment

    logger, run_id = cli.mlflow_logger, cli.mlflow_logger.run_id
    cli.out_dir.mkdir(parents=True, exist_ok=True)
    config_path = cli.out_dir / "config.yaml"
    config_path.write_text(config_yaml)
    logger.experiment.log_artifact(run_id, str(config_path))
    resolved = yaml.safe_load(config_yaml)
    # model and data hyper-parameters are logged by Lightning under their own names: not twice
    params = _flatten("config", {k: v for k, v in resolved.items() if k not in ("model", "data")}, {})
    log_data_set_input(logger.experiment, run_id, info["data_dir"], info["data_fingerprint"])
    log_environment(logger.experiment, run_id)
    commit = git_commit()
    params.update({
        "data_fingerprint": info["data_fingerprint"],
        "pair_fingerprint": info["pair_fingerprint"],
        "git_commit": commit,
        "verifier": info["verifier"],
        **{f"split_rows/{k}": v for k, v in info["split_rows"].items()},
        **{f"split_prompts/{k}": v for k, v in info["split_prompts"].items()},
        **{f"static_action/cfg{k}": v for k, v in info["static_actions"].items()},
    })
    logger.log_hyperparams(params)
    if commit:
        logger.experiment.set_tag(run_id, "mlflow.source.git.commit", commit)


def _run_baselines(cli, max_samples: int) -> dict[str, dict[str, float]]:
    from selector.baselines import run_baselines

    logger = cli.mlflow_logger
    results = run_baselines(cli.datamodule, tracking_uri=cli.tracking_uri, experiment_id=logger.experiment_id,
                            parent_run_id=logger.run_id, max_samples=max_samples,
                            seed=int(cli.config.get("seed_everything") or 0))
    return {r.name: r.metrics["test"].as_dict() | {"run_id": r.run_id} for r in results}


def _write_summary(cli, model, test_metrics: dict[str, float], baselines: dict, train_s: float,
                   head_room: dict) -> Path:
    info = model.ddte_info
    summary = {
        "run_id": cli.mlflow_logger.run_id,
        "tracking_uri": cli.tracking_uri,
        "checkpoint": str(Path(cli.checkpoint.best_model_path).resolve()),
        "best_epoch_metric": {cli.checkpoint.monitor: float(cli.checkpoint.best_model_score or float("nan"))},
        "verifier": info["verifier"],
        "objective": info["objective"],
        "decision": info["decision"],
        "data_dir": info["data_dir"],
        "data_fingerprint": info["data_fingerprint"],
        "pair_fingerprint": info["pair_fingerprint"],
        "git_commit": git_commit(),
        "static_actions": info["static_actions"],
        "static_ranking": info["static_ranking"],
        "fallbacks": info["fallbacks"],
        "sampling": info["sampling"],
        "split_rows": info["split_rows"],
        "split_prompts": info["split_prompts"],
        "train_seconds": round(train_s, 2),
        "test": test_metrics,
        "head_room": head_room,
        "baselines": baselines,
    }
    path = cli.out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def _resolve_config(config: dict | str | Path | None, stack: contextlib.ExitStack) -> Path:
    """A config path; a dict is written to a temporary YAML that lives as long as ``stack``."""
    if config is None:
        return Path(DEFAULT_CONFIG)
    if isinstance(config, dict):
        import yaml

        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddte-train-"))) / "config.yaml"
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        return tmp
    return Path(config)


def train_selector(config: dict | str | Path | None = None, overrides: Sequence[str] = (),
                   verbose: bool = True) -> TrainResult:
    """Train one selector; the Python twin of ``ddte train``.

    Args:
        config: a config path or dict (None: configs/train/default.yaml).
        overrides: ``KEY=VALUE`` strings applied on top, in order (e.g. ``"data.verifier=traversal"``).
        verbose: let Lightning print its progress (model summary, epochs); False for quiet library use.

    Raises:
        ValueError: bad config, override, data folder or verifier (one line, for the user).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_lightning())
        if not verbose:
            lightning_log = logging.getLogger("lightning.pytorch")
            old_level = lightning_log.level
            lightning_log.setLevel(logging.WARNING)
            stack.callback(lightning_log.setLevel, old_level)
        quiet = [] if verbose else ["run.progress=false"]
        args = build_cli_args(_resolve_config(config, stack), [*overrides, *quiet])
        cli = make_cli(args)
        try:
            return _train(cli)
        except BaseException:
            # the MLflow run exists from instantiation on: never leave it RUNNING after a failure
            cli.mlflow_logger.experiment.set_terminated(cli.mlflow_logger.run_id, "FAILED")
            raise


def _train(cli) -> TrainResult:
    """The body of ``train_selector`` under the configured torch thread count (restored afterwards)."""
    import torch

    threads = cli.config_init["run"].threads
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _fit_and_report(cli)
    finally:
        torch.set_num_threads(previous)


def _fit_and_report(cli) -> TrainResult:
    """Fit, test the best checkpoint, log plots, baselines, checkpoint and summary."""
    model, dm, trainer = cli.model, cli.datamodule, cli.trainer
    dm.setup("fit")  # splits and baselines first: "too few prompts" fails before any run output
    config_yaml = cli.parser.dump(cli.config)
    model.ddte_info.update(run_id=cli.mlflow_logger.run_id, tracking_uri=cli.tracking_uri)
    _log_run_facts(cli, config_yaml, dm.describe())

    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    train_s = time.perf_counter() - start
    best = cli.checkpoint.best_model_path
    if not best:
        raise ValueError("no checkpoint was saved: is the monitored metric "
                         f"'{cli.checkpoint.monitor}' logged (validation split empty?)")
    trainer.test(model, datamodule=dm, ckpt_path=best, verbose=False)  # loads the best weights into `model`
    test_metrics = {k[len("test/"):]: float(v) for k, v in trainer.callback_metrics.items()
                    if k.startswith("test/")}
    test_metrics.update(fit_guard(cli, model, dm))
    head_room = log_head_room(cli, dm)
    trainer.save_checkpoint(best)  # the best weights, now with the guard in their ddte metadata
    log_plots(cli, model, dm.splits["test"])
    run = cli.config_init["run"]
    baselines = _run_baselines(cli, run.baseline_max_samples) if run.baselines else {}
    summary_path = _write_summary(cli, model, test_metrics, baselines, train_s, head_room)
    client, run_id = cli.mlflow_logger.experiment, cli.mlflow_logger.run_id
    client.log_artifact(run_id, best, "checkpoint")
    client.log_artifact(run_id, str(summary_path))
    client.log_metric(run_id, "train_seconds", train_s)
    summary = json.loads(summary_path.read_text())
    return TrainResult(checkpoint_path=Path(best).resolve(), run_id=run_id, metrics=test_metrics,
                       summary_path=summary_path.resolve(), tracking_uri=cli.tracking_uri, baselines=baselines,
                       summary=summary)


# ---------------------------------------------------------------------------------------------------- reporting


def format_summary(result: TrainResult) -> str:
    """The end-of-run table (markdown) of the test split's offline metrics, baselines and where things went."""
    s = result.summary
    m = result.metrics
    lines = [
        f"selector {s['verifier']} / {s['objective']} — test split: {s['split_rows']['test']} roots, "
        f"{s['split_prompts']['test']} prompts; trained in {s['train_seconds']:.1f} s",
        "",
        "| sampling | static action | selector vs best static | guarded | vs same-tree oracle (biased) |",
        "|---|---|---|---|---|",
    ]
    for idx, cfg in enumerate(s["sampling"]):
        key = f"ratio_vs_static/cfg{idx}"
        if key not in m:
            continue
        guarded = m.get(f"guarded_ratio_vs_static/cfg{idx}", float("nan"))
        lines.append(f"| T={cfg['temperature']} top-p={cfg['top_p']} | {s['static_actions'].get(str(idx), '-')} | "
                     f"{m[key]:.3f} | {guarded:.3f} | {m[f'ratio_vs_oracle/cfg{idx}']:.3f} |")
    lines.append(f"| mean | | {m['ratio_vs_static']:.3f} | {m.get('guarded_ratio_vs_static', float('nan')):.3f} | "
                 f"{m['ratio_vs_oracle']:.3f} |")
    for name, bm in result.baselines.items():
        lines.append(f"| baseline {name} | | {bm['ratio_vs_static']:.3f} | | {bm['ratio_vs_oracle']:.3f} |")
    lines += ["", "Head-room over the best static action on the test split (per-root choices; the same-tree oracle is "
              "biased upward by label noise, the cross-fitted figures choose on one half of the trees and score on "
              "the other):", "",
              "| sampling | same-tree oracle (biased) | cross-fitted oracle | cross-fitted per-prompt static |",
              "|---|---|---|---|"]
    for idx, cfg in enumerate(s["sampling"]):
        room = s.get("head_room", {}).get(str(idx))
        if room:
            lines.append(f"| T={cfg['temperature']} top-p={cfg['top_p']} | {room['same_tree_oracle']:.3f} | "
                         f"{_ratio(room['cross_fitted_oracle'])} | {_ratio(room['cross_fitted_prompt_static'])} |")
    lines += ["", f"MLflow run: {result.run_id}  ({result.tracking_uri})",
              f"checkpoint: {result.checkpoint_path}", f"summary:    {result.summary_path}"]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "unavailable (schema-1 data: no per-tree labels)" if value is None else f"{value:.3f}"


def print_config(config: str | Path, overrides: Sequence[str]) -> None:
    """Parse (without instantiating anything) and print the resolved YAML; ValueError for a bad config or key."""
    from jsonargparse import ArgumentError

    try:
        with quiet_lightning():
            make_cli(build_cli_args(config, overrides) + ["--print_config"])
    except SystemExit:  # jsonargparse prints, then exits 0
        return
    except ArgumentError as err:
        raise ValueError(one_line(str(err))) from err
