"""Where training runs are tracked (the MLflow tracking URI, its artifact folder, the git commit), and Lightning's
known noise kept out of their output."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


TRACKING_SCHEMES = ("sqlite:///", "file:", "http://", "https://", "databricks", "postgresql", "mysql", "mssql")


def resolve_tracking_uri(uri: str | None) -> str:
    """``uri``, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; a relative sqlite path is made absolute.
    ValueError for a scheme MLflow does not store runs under, or a sqlite database in a folder no file can be made in.

    MLflow resolves a relative sqlite path against the current directory of whichever process opens it; an absolute
    path makes the run findable from anywhere.
    """
    from ddte_core.paths import folder_is_writable

    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())
    if not uri.startswith(TRACKING_SCHEMES):
        raise ValueError(f"tracking URI '{uri}': give sqlite:///PATH.db, an http(s):// server, a database URI "
                         "(postgresql, mysql, mssql) or file:FOLDER")
    if uri.startswith(prefix) and not folder_is_writable(Path(uri[len(prefix):]).parent):
        raise ValueError(f"tracking URI {uri}: its folder is not writable (run from a writable folder, or give a "
                         "tracking URI such as sqlite:////a/writable/mlflow.db, or set $MLFLOW_TRACKING_URI)")
    return uri


def artifact_location(uri: str) -> str | None:
    """For a sqlite store: ``mlartifacts/`` beside the database file (as a file: URI); servers choose their own."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        return (Path(uri[len(prefix):]).parent / "mlartifacts").as_uri()
    return None


def open_store(uri: str) -> str:
    """``uri``, its sqlite database first created if it does not exist yet, with the artifact root beside it.

    Every new MLflow store holds a Default experiment (id 0) whose artifact location is fixed when the store is first
    opened: under ./mlruns of whichever folder the process ran in, unless the opener names a root. Our runs go to
    their own experiments (artifacts under :func:`artifact_location`), so Default stayed empty and pointed at a folder
    that never existed. Created here, it points at ``mlartifacts/0`` beside the database, made empty. Other stores
    (servers, an existing database) are left as they are.
    """
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or Path(uri[len(prefix):]).exists():
        return uri
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    database = Path(uri[len(prefix):])
    database.parent.mkdir(parents=True, exist_ok=True)
    with quiet_lightning():  # alembic's migration lines
        SqlAlchemyStore(uri, artifact_location(uri)).engine.dispose()
    (database.parent / "mlartifacts" / "0").mkdir(parents=True, exist_ok=True)
    return uri


def lightning_logger(uri: str, experiment: str, run_name: str, tags: dict[str, str]):
    """Lightning's MLflow logger for one run of ``experiment`` in the store at ``uri`` (created as
    :func:`open_store` does when new), its artifacts where :func:`artifact_location` puts them. Imports Lightning
    only when called."""
    from lightning.pytorch.loggers import MLFlowLogger

    return MLFlowLogger(experiment_name=experiment, run_name=run_name, tracking_uri=open_store(uri),
                        artifact_location=artifact_location(uri), tags=tags)


def git_commit() -> str | None:
    """HEAD of the repository this code lives in, or None (not a checkout, or no git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


# Lightning's status lines on every run, none of which a user acts on: its advertising, the accelerators it found
# (the config says which one runs), its loader probe, why fit stopped (the epochs asked for), the best checkpoint's
# reload (ddte prints the checkpoint), the MLflow logger creating a new experiment, and its graceful shutdown's line.
_CHATTER = ("💡 Tip", "GPU available:", "TPU available:", "HPU available:", "Loading `train_dataloader`",
            "`Trainer.fit` stopped:", "Restoring states from the checkpoint",
            "Loaded model weights from the checkpoint", "Experiment with name",
            "\nDetected KeyboardInterrupt")  # an interrupt ends the command in ddte's one line


class _DropChatter(logging.Filter):
    """Drops the lines of :data:`_CHATTER`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_CHATTER)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence known noise while training: Lightning's status lines (:data:`_CHATTER`), torch-pytree FutureWarnings,
    SQLAlchemy deprecations, and MLflow's INFO lines."""
    tip_filter = _DropChatter()
    # rank_zero_info logs through these loggers; a logger-level filter sees records created there.
    loggers = [logging.getLogger(f"lightning.{pkg}.utilities.rank_zero") for pkg in ("pytorch", "fabric")]
    loggers.append(logging.getLogger("lightning.pytorch.loggers.mlflow"))
    for lg in loggers:
        lg.addFilter(tip_filter)
    alembic, mlflow_log = logging.getLogger("alembic"), logging.getLogger("mlflow")
    alembic_level, mlflow_level = alembic.level, mlflow_log.level
    alembic.setLevel(logging.WARNING)  # MLflow's first use of a sqlite store prints a dozen migration lines
    mlflow_log.setLevel(logging.WARNING)  # and its INFO lines: tables created, a model registered, a version made
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            warnings.filterwarnings("ignore", message=r".*noload.*")
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")
            warnings.filterwarnings("ignore", message=r".*exists and is not empty.*")  # config.yaml is there first
            # several processes: every rank evaluates whole splits, so its epoch metrics are already the job's
            warnings.filterwarnings("ignore", message=r".*sync_dist=True.*")
            yield
    finally:
        for lg in loggers:
            lg.removeFilter(tip_filter)
        alembic.setLevel(alembic_level)
        mlflow_log.setLevel(mlflow_level)


def flatten_params(prefix: str, value: Any) -> dict[str, Any]:
    """A nested dict as flat MLflow params: ``flatten_params("config", {"run": {"seed": 0}})`` is
    ``{"config/run/seed": 0}``; an empty ``prefix`` adds none."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(flatten_params(f"{prefix}/{k}" if prefix else str(k), v))
    return out


def environment() -> dict[str, str | int | None]:
    """What ran the job: the machine's record (:func:`ddte_core.machine.environment`) and the key libraries' versions
    (None where one is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    from ddte_core.machine import environment as machine_environment

    out: dict[str, str | int | None] = dict(machine_environment())
    for name in ("ddte", "lightning", "mlflow", "onnxruntime", "onnxruntime-gpu"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def log_environment(client, run_id: str) -> None:
    """The environment as an artifact (environment.json) and as ``env/<name>`` tags."""
    env = environment()
    client.log_dict(run_id, env, "environment.json")
    for key, value in env.items():
        if value is not None:
            client.set_tag(run_id, f"env/{key}", str(value))


def log_data_set_input(client, run_id: str, folder: str | Path, digest: str, context: str = "training") -> None:
    """Record a collected data set as the run's input (``mlflow.log_input``: name, digest, source folder)."""
    import json

    from mlflow.data.dataset_source_registry import get_dataset_source_from_json
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    # named as a local source outright: resolving a bare path matches two registered local sources and warns
    source = get_dataset_source_from_json(json.dumps({"uri": str(Path(folder).resolve())}), "local")
    dataset = MetaDataset(source, name=Path(folder).name, digest=digest[:36])
    tags = [InputTag(key="mlflow.data.context", value=context)]
    client.log_inputs(run_id, datasets=[DatasetInput(dataset=dataset._to_mlflow_entity(), tags=tags)])


def start_child_run(client, experiment_id: str, parent_run_id: str | None, name: str) -> str:
    """A run of ``experiment_id`` nested under ``parent_run_id`` (if any) in the MLflow UI; returns its id."""
    tags = {"mlflow.runName": name}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    return client.create_run(experiment_id, tags=tags).info.run_id


def experiment_id(client, name: str, tracking_uri: str) -> str:
    """The id of experiment ``name``, created (with artifacts beside a sqlite store) if new."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location(tracking_uri))
