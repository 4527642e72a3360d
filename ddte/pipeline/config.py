"""The pipeline's config: its stages' typed sections, read and checked whole before the first stage runs
(:func:`load_pipeline`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from data_gen.config import CollectConfig, load_collect_config
from ddte_core.paths import refuse_file_in_the_way
from ddte_core.yamlconfig import load_yaml_config
from selector.root.train_config import TrainConfig, load_train_config


@dataclass
class CollectStage:
    config: str = "configs/collect/default.yaml"
    overrides: list[str] = field(default_factory=list)
    reuse: str | None = None  # an existing data set folder: skip collection


@dataclass
class TrainStage:
    config: str = "configs/train/default.yaml"
    verifiers: list[str] = field(default_factory=lambda: ["specinfer", "traversal"])
    overrides: list[str] = field(default_factory=list)


@dataclass
class BenchStage:
    num_prompts: int = 16  # the most held-out prompts; with ``minutes``, as many of them as fit
    minutes: float | None = None  # the bench's time budget, split evenly over its temperatures (None: every prompt)
    candidates: int = 3  # static trees per verifier and temperature: the training split's best distinct trees
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.6, 1.0])
    repeats: int = 1
    threads: int | None = 1
    seed: int = 0


@dataclass
class ExpanderStage:
    enabled: bool = True  # fit and bench an expander per verifier (needs a collection with trunk states)
    folds: int = 5  # prompt folds of the cross-fitting that chooses each configuration's rule
    min_gain: float = 0.01  # offline gain over the best static tree a rule needs (else the expander stays static)
    # an acceptance model (ddte acceptance) trained on other prompts than the collection's: adds its β̂ and the
    # marginal rule on it to the signals, and the expanders embed its graph
    acceptance: str | None = None


@dataclass
class PipelineConfig:
    output: str = "runs/pipeline"
    tracking_uri: str | None = None  # MLflow (any URI, e.g. http://host:5000); null: <output>/mlflow.db
    collect: CollectStage = field(default_factory=CollectStage)
    train: TrainStage = field(default_factory=TrainStage)
    bench: BenchStage = field(default_factory=BenchStage)
    expander: ExpanderStage = field(default_factory=ExpanderStage)


@dataclass
class PipelinePlan:
    """A checked pipeline config and the stage configs it names, each read once."""

    config: PipelineConfig
    collect: CollectConfig  # the collection's config, writing to <output>/data
    train: TrainConfig  # train.config with train.overrides; each verifier's run sets its data and tracking keys


def load_pipeline(path: str | Path | None, overrides: list[str], resume: bool = False) -> PipelinePlan:
    """The pipeline config and its stages' configs, every setting checked (ValueError naming the first bad one)."""
    return plan_pipeline(load_yaml_config(PipelineConfig, path, overrides, required=("collect", "train", "bench")),
                         resume)


def plan_pipeline(config: PipelineConfig, resume: bool = False) -> PipelinePlan:
    """Everything that can be checked before the first stage: a 6-minute collection must not end in a refusal.
    ``resume``: the output folder may hold an earlier run of this pipeline, whose collected shards are kept and
    whose selectors, policy.json and results are redone; without it the folder must be new or empty."""
    from data_gen.collection import check_output, check_verifiers

    _check_pipeline_output(config, resume)
    try:
        collect = load_collect_config(config.collect.config,
                                      [*config.collect.overrides, f"output={Path(config.output) / 'data'}"])
    except ValueError as err:
        raise ValueError(f"collect config: {err}") from err
    if not config.collect.reuse:
        check_output(Path(collect.output), resume=True)
    if config.collect.reuse and not (Path(config.collect.reuse) / "dataset.json").is_file():
        raise ValueError(f"collect.reuse: {config.collect.reuse} is not a collected data set")
    labelled = _labelled_verifiers(config, collect)
    trained = check_verifiers(config.train.verifiers)
    missing = [v for v in trained if v not in labelled]
    if missing:
        raise ValueError(f"train.verifiers {missing} have no labels in the collection (it labels "
                         f"{', '.join(labelled)}): add them to collect verifiers or drop them")
    try:
        train_config = load_train_config(config.train.config, config.train.overrides)
    except ValueError as err:
        raise ValueError(f"train config: {err}") from err
    bench = config.bench
    if min(bench.num_prompts, bench.max_new_tokens, bench.repeats, bench.candidates) < 1 or not bench.temperatures:
        raise ValueError("bench: num_prompts, max_new_tokens, repeats and candidates must be >= 1 and temperatures "
                         "non-empty")
    if bench.minutes is not None and not 0 < bench.minutes < float("inf"):
        raise ValueError(f"bench.minutes must be null or a positive number of minutes, got {bench.minutes}")
    if any(not t >= 0 for t in bench.temperatures):
        raise ValueError(f"bench.temperatures must be >= 0, got {bench.temperatures}")
    cores = os.cpu_count() or 1
    if bench.threads is not None and not 0 <= bench.threads <= cores:
        raise ValueError(f"bench.threads must be null or in [0, {cores}] (0: torch's choice), got {bench.threads}")
    if config.collect.reuse:  # every shard readable, with labels for every verifier to train, before stage 1
        from selector.root.root_data import inspect_dataset

        for verifier in trained:
            inspect_dataset(config.collect.reuse, verifier)
    if config.expander.folds < 2 or not 0.0 <= config.expander.min_gain < 1.0:
        raise ValueError(f"expander: folds must be >= 2 and min_gain in [0, 1), got {config.expander.folds} and "
                         f"{config.expander.min_gain}")
    if config.expander.acceptance and not Path(config.expander.acceptance).is_file():
        raise ValueError(f"expander.acceptance: no file {config.expander.acceptance}")
    return PipelinePlan(config, collect, train_config)


def _check_pipeline_output(config: PipelineConfig, resume: bool) -> None:
    """ValueError for an output folder that cannot be written, a --resume of nothing, an output holding another run
    (or other files) without --resume, and a tracking URI that does not resolve."""
    from ddte_core.paths import folder_is_writable
    from ddte_core.tracking import resolve_tracking_uri

    refuse_file_in_the_way(config.output)
    out = Path(config.output)
    if not folder_is_writable(out):
        raise ValueError(f"output {out}: no file can be written there; choose another output=")
    if config.tracking_uri:
        resolve_tracking_uri(config.tracking_uri)  # its scheme and folder, before the first stage
    if resume and not (out / "data").is_dir() and not (out / "mlflow.db").is_file():
        raise ValueError(f"--resume: {out} holds no pipeline run to continue; drop --resume to start one there")
    if not resume and out.is_dir() and any(out.iterdir()):
        held = ("a finished pipeline run (policy.json)" if (out / "policy.json").is_file()
                else "an unfinished pipeline run" if (out / "data").is_dir() or (out / "mlflow.db").is_file()
                else "other files")
        raise ValueError(f"{out} already holds {held}: pass --resume to continue or redo it (its collected data is "
                         "kept; selectors, policy.json and results are rewritten), or choose another --output")


def _labelled_verifiers(config: PipelineConfig, collect) -> list[str]:
    if config.collect.reuse:
        metadata = json.loads((Path(config.collect.reuse) / "dataset.json").read_text())
        return list(metadata["verifiers"])
    from data_gen.collection import check_verifiers

    return check_verifiers(collect.verifiers)
