"""Train a selector on a collected data set (Lightning), tracked in MLflow.

The config (:class:`~selector.root.train_config.TrainConfig`, its sections and checks) lives in
selector/root/train_config.py.
:func:`train` takes a :class:`TrainConfig` and returns a
:class:`TrainResult`; :func:`train_selector` reads the YAML first.

Several devices or nodes (``trainer.devices=2 trainer.strategy=ddp``, ``trainer.num_nodes``) give one job: rank 0
alone creates its MLflow run and writes its outputs, each rank trains on its own share of the training split
(a DistributedSampler), and every rank evaluates the whole validation and test splits, so the checkpoint choice and
the figures are those of one device's evaluation.

Logged to MLflow: the resolved config (artifact config.yaml and params config/...), the data fingerprint, the git
commit, per epoch the offline metrics of the validation split (throughput ratio vs the best static action per
sampling config, vs the per-root oracle, regret; selector/root/metrics.py), the test metrics of the best checkpoint,
plots, the best checkpoint and summary.json. At the end a table of the test metrics and the run id are printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddte_core.distributed import is_rank_zero
from ddte_core.signals import training_interrupts
from ddte_core.tracking import flatten_params, git_commit, lightning_logger, quiet_lightning, resolve_tracking_uri
from selector.root.evaluation import fit_guard, log_head_room, log_plots
from selector.root.info import DataFacts, SelectorInfo
from selector.root.train_config import DEFAULT_CONFIG, TrainConfig, check_train_config, config_yaml, load_train_config


@dataclass
class TrainResult:
    """What a training run produced: its files and MLflow run, the selector's typed facts (what ``ddte pipeline``
    reads: ``info.data.sampling``, ``info.data.static_ranking``), and its test figures. :meth:`summary` is what
    summary.json holds.

    ``metrics``: the test split's offline metrics, the guarded rule's included; ``head_room``: per sampling
    configuration (its index as a string), the honest head-room figures; ``baselines``: per sklearn baseline, its
    test metrics and MLflow run.
    """

    checkpoint_path: Path
    run_id: str
    metrics: dict[str, float]
    summary_path: Path
    tracking_uri: str
    info: SelectorInfo
    train_seconds: float
    best_epoch_metric: dict[str, float]
    head_room: dict[str, dict] = field(default_factory=dict)
    baselines: dict[str, dict[str, float]] = field(default_factory=dict)
    git_commit: str | None = None

    def summary(self) -> dict[str, Any]:
        """What summary.json holds (JSON-ready)."""
        facts, data = self.info.data, self.info.data.to_dict()
        return {
            "run_id": self.run_id,
            "tracking_uri": self.tracking_uri,
            "checkpoint": str(self.checkpoint_path),
            "best_epoch_metric": self.best_epoch_metric,
            "verifier": facts.verifier,
            "objective": self.info.objective,
            "decision": self.info.decision,
            "data_dir": facts.data_dir,
            "data_fingerprint": facts.data_fingerprint,
            "pair_fingerprint": facts.pair_fingerprint,
            "git_commit": self.git_commit,
            "static_actions": data["static_actions"],
            "static_ranking": data["static_ranking"],
            "fallbacks": self.info.to_dict().get("fallbacks"),
            "sampling": data["sampling"],
            "split_rows": facts.split_rows,
            "split_prompts": facts.split_prompts,
            "train_seconds": round(self.train_seconds, 2),
            "test": self.metrics,
            "head_room": self.head_room,
            "baselines": self.baselines,
        }


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class _Run:
    """One run's parts: the data module, the network built for its shapes, the MLflow run and the trainer."""

    config: TrainConfig
    datamodule: Any
    model: Any
    logger: Any  # lightning's MLFlowLogger: its run is created with it; None on ranks other than 0
    tracking_uri: str
    out_dir: Path | None  # None on ranks other than 0 (their checkpoint callback gets rank 0's folder)
    checkpoint: Any = None
    trainer: Any = None


def _data_and_model(config: TrainConfig):
    """Seed, read the data set, build the network for its shapes: a bad folder or verifier fails here, before any
    MLflow run or output folder exists."""
    import lightning.pytorch as pl

    from selector.root.data import SelectorDataModule
    from selector.root.model import SelectorModule

    pl.seed_everything(config.seed_everything, workers=True, verbose=False)
    dm = SelectorDataModule(**dataclasses.asdict(config.data))
    model = SelectorModule(hidden_sizes=dm.hidden_sizes, num_actions=dm.num_actions,
                           **dataclasses.asdict(config.model))
    return dm, model


def _open_run(config: TrainConfig, dm, model) -> _Run:
    """The MLflow run (its id names the checkpoint folder): rank 0's alone, one per job."""
    run = config.run
    verifier, objective = dm.hparams.verifier, model.hparams.objective
    tracking_uri = resolve_tracking_uri(run.tracking_uri)
    if not is_rank_zero():
        return _Run(config, dm, model, None, tracking_uri, None)
    logger = lightning_logger(tracking_uri, run.experiment, run.run_name or f"{verifier}-{objective}",
                              {"ddte.verifier": verifier, "ddte.objective": objective,
                               **({"mlflow.parentRunId": run.parent_run_id} if run.parent_run_id else {})})
    out_dir = Path(run.output_dir) / f"{verifier}-{objective}-{logger.run_id}"  # logger.run_id creates the run
    return _Run(config, dm, model, logger, tracking_uri, out_dir)


def _add_trainer(run: _Run) -> None:
    """The trainer, logging to the run, keeping the best checkpoint by ``run.monitor``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    class EpochLine(Callback):
        """One line per epoch (the progress bar is off in CI logs): loss and the validation throughput ratio."""

        def on_validation_epoch_end(self, trainer, module) -> None:
            if trainer.sanity_checking or not trainer.is_global_zero:
                return
            m = trainer.callback_metrics
            parts = [f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"]
            for key, label in (("train/loss", "train loss"), ("val/loss", "val loss"),
                               ("val/ratio_vs_static", "val ratio vs static")):
                if key in m:
                    parts.append(f"{label} {float(m[key]):.4f}")
            print(", ".join(parts), flush=True)

    options = run.config.run
    run.checkpoint = ModelCheckpoint(
        dirpath=run.out_dir, filename="best", monitor=options.monitor, mode=options.monitor_mode, save_top_k=1,
        auto_insert_metric_name=False, enable_version_counter=False,
    )
    callbacks = [run.checkpoint, *([EpochLine()] if options.progress else [])]
    # every rank evaluates whole splits: the training loader alone is shared out (SelectorDataModule)
    run.trainer = pl.Trainer(**dataclasses.asdict(run.config.trainer), logger=run.logger or False,
                             callbacks=callbacks, use_distributed_sampler=False)


def _log_run_facts(run: _Run, facts: DataFacts, commit: str | None) -> None:
    """Config (artifact; params for the sections Lightning does not log itself), the data set as the run's input,
    the environment, data fingerprint, git commit, split sizes, static baselines."""
    from ddte_core.tracking import log_data_set_input, log_environment

    logger, run_id = run.logger, run.logger.run_id
    run.out_dir.mkdir(parents=True, exist_ok=True)
    config_path = run.out_dir / "config.yaml"
    config_path.write_text(config_yaml(run.config))
    logger.experiment.log_artifact(run_id, str(config_path))
    # model and data hyper-parameters are logged by Lightning under their own names: not twice
    params = flatten_params("config", {k: v for k, v in dataclasses.asdict(run.config).items()
                                       if k not in ("model", "data")})
    log_data_set_input(logger.experiment, run_id, facts.data_dir, facts.data_fingerprint)
    log_environment(logger.experiment, run_id)
    params.update({
        "data_fingerprint": facts.data_fingerprint,
        "pair_fingerprint": facts.pair_fingerprint,
        "git_commit": commit,
        "verifier": facts.verifier,
        **{f"split_rows/{k}": v for k, v in facts.split_rows.items()},
        **{f"split_prompts/{k}": v for k, v in facts.split_prompts.items()},
        **{f"static_action/cfg{k}": v for k, v in facts.static_actions.items()},
    })
    logger.log_hyperparams(params)
    if commit:
        logger.experiment.set_tag(run_id, "mlflow.source.git.commit", commit)


def _run_baselines(run: _Run) -> dict[str, dict[str, float]]:
    from selector.root.baselines import run_baselines

    logger = run.logger
    results = run_baselines(run.datamodule, tracking_uri=run.tracking_uri, experiment_id=logger.experiment_id,
                            parent_run_id=logger.run_id, max_samples=run.config.run.baseline_max_samples,
                            seed=run.config.seed_everything)
    return {r.name: r.metrics["test"].as_dict() | {"run_id": r.run_id} for r in results}


def train(config: TrainConfig, verbose: bool = True) -> TrainResult | None:
    """Train one selector: the function behind ``ddte train`` and the pipeline's train stage. With several
    processes (``trainer.strategy``) it returns None on every rank but 0, which writes and returns the result.

    Args:
        config: the run (:func:`selector.root.train_config.load_train_config` reads one from YAML).
        verbose: let Lightning print its progress (model summary, epochs); False for quiet library use.

    Raises:
        ValueError: bad config value, data folder or verifier (one line, for the user).
    """
    check_train_config(config)
    if not verbose:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, progress=False))
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_lightning())
        if not verbose:
            lightning_log = logging.getLogger("lightning.pytorch")
            stack.callback(lightning_log.setLevel, lightning_log.level)
            lightning_log.setLevel(logging.WARNING)
        dm, model = _data_and_model(config)
        run = _open_run(config, dm, model)
        try:
            _add_trainer(run)
            return _train(run)
        except BaseException:
            # the MLflow run exists from here on: never leave it RUNNING after a failure
            if run.logger is not None:
                run.logger.experiment.set_terminated(run.logger.run_id, "FAILED")
            raise


def train_selector(config: str | Path | None = DEFAULT_CONFIG, overrides: Sequence[str] = (),
                   verbose: bool = True) -> TrainResult | None:
    """:func:`train` on the YAML at ``config`` (None: the defaults) with ``KEY=VALUE`` overrides (e.g.
    ``"data.verifier=traversal"``): the Python twin of ``ddte train``."""
    return train(load_train_config(config, overrides), verbose)


def _train(run: _Run) -> TrainResult | None:
    """The body of :func:`train` under the configured torch thread count (restored afterwards)."""
    import torch

    threads = run.config.run.threads
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _fit_and_report(run)
    finally:
        torch.set_num_threads(previous)


def _fit_and_report(run: _Run) -> TrainResult | None:
    """Fit, test the best checkpoint, log plots, baselines, checkpoint and summary (rank 0; None on the others)."""
    model, dm, trainer, logger = run.model, run.datamodule, run.trainer, run.logger
    dm.setup("fit")  # splits and baselines first: "too few prompts" fails before any run output
    commit = git_commit()
    if logger is not None:
        model.run_id, model.tracking_uri = logger.run_id, run.tracking_uri
        _log_run_facts(run, dm.facts(), commit)

    start = time.perf_counter()
    with training_interrupts(None if logger is None else logger.experiment):  # Ctrl-C: exit 130
        trainer.fit(model, datamodule=dm)
    train_s = time.perf_counter() - start
    best = run.checkpoint.best_model_path
    if not best:
        raise ValueError("no checkpoint was saved: is the monitored metric "
                         f"'{run.checkpoint.monitor}' logged (validation split empty?)")
    # loads the best weights into `model`; weights_only: no arbitrary pickled object is ever unpickled
    with training_interrupts(None if logger is None else logger.experiment):
        trainer.test(model, datamodule=dm, ckpt_path=best, verbose=False, weights_only=True)
    if logger is None:  # another rank: rank 0 fits the guard and writes the checkpoint (a collective call)
        trainer.save_checkpoint(best, weights_only=False)  # said outright: Lightning logs its default otherwise
        return None
    test_metrics = {k[len("test/"):]: float(v) for k, v in trainer.callback_metrics.items()
                    if k.startswith("test/")}
    test_metrics.update(fit_guard(logger, model, dm))
    head_room = log_head_room(logger, dm)
    trainer.save_checkpoint(best, weights_only=False)  # the best weights, now with the guard in their ddte metadata
    log_plots(logger, model, dm.splits["test"])
    baselines = _run_baselines(run) if run.config.run.baselines else {}
    best_score = float(run.checkpoint.best_model_score or float("nan"))
    result = TrainResult(
        checkpoint_path=Path(best).resolve(), run_id=logger.run_id, metrics=test_metrics,
        summary_path=(run.out_dir / "summary.json").resolve(), tracking_uri=run.tracking_uri, info=model.info,
        train_seconds=train_s, best_epoch_metric={run.checkpoint.monitor: best_score}, head_room=head_room,
        baselines=baselines, git_commit=commit)
    result.summary_path.write_text(json.dumps(result.summary(), indent=2) + "\n")
    client = logger.experiment
    client.log_artifact(result.run_id, best, "checkpoint")
    client.log_artifact(result.run_id, str(result.summary_path))
    client.log_metric(result.run_id, "train_seconds", train_s)
    return result


# ---------------------------------------------------------------------------------------------------- reporting


def format_summary(result: TrainResult) -> str:
    """The end-of-run table (markdown) of the test split's offline metrics, baselines and where things went."""
    facts, m = result.info.data, result.metrics
    lines = [
        f"selector {facts.verifier} / {result.info.objective} — test split: {facts.split_rows['test']} roots, "
        f"{facts.split_prompts['test']} prompts; trained in {result.train_seconds:.1f} s",
        "",
        "| sampling | static action | selector vs best static | guarded | vs same-tree oracle (biased) |",
        "|---|---|---|---|---|",
    ]
    for idx, cfg in enumerate(facts.sampling):
        key = f"ratio_vs_static/cfg{idx}"
        if key not in m:
            continue
        guarded = m.get(f"guarded_ratio_vs_static/cfg{idx}", float("nan"))
        lines.append(f"| T={cfg.temperature} top-p={cfg.top_p} | {facts.static_actions.get(idx, '-')} | "
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
    for idx, cfg in enumerate(facts.sampling):
        room = result.head_room.get(str(idx))
        if room:
            lines.append(f"| T={cfg.temperature} top-p={cfg.top_p} | {room['same_tree_oracle']:.3f} | "
                         f"{_ratio(room['cross_fitted_oracle'])} | {_ratio(room['cross_fitted_prompt_static'])} |")
    lines += ["", f"MLflow run: {result.run_id}  ({result.tracking_uri})",
              f"checkpoint: {result.checkpoint_path}", f"summary:    {result.summary_path}"]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "unavailable (needs per-tree labels of 2+ trees per root)" if value is None else f"{value:.3f}"
