"""Export a trained selector to one ONNX file with metadata and a parity check against onnxruntime.

The file's inputs, output and metadata are the contract of :mod:`decode.policies.files.selector_file` (its
:class:`~decode.policies.files.selector_file.SelectorMetadata` is filled here and read back by the decoder). Actions
that never had a label for the verifier score ``invalid_score``.

The file is written to a temporary name beside the output and renamed only after the parity check passed
(max |torch − onnxruntime| ≤ 1e-5 on random and real rows), so a .onnx on disk is always whole and checked.
If the checkpoint knows its MLflow run (or --run-id is given), the model is also logged there with
mlflow.onnx.log_model.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddte_core.paths import staged_file
from decode.policies.files.selector_file import INPUT_NAMES, OUTPUT_NAME, SelectorMetadata

TOLERANCE = 1e-5


@dataclass
class ExportResult:
    """The written file, the parity check's worst difference, the metadata written, the MLflow model (if logged)."""

    path: Path
    max_abs_diff: float
    metadata: SelectorMetadata
    parity_rows: dict[str, int]
    mlflow_model_uri: str | None = None


def load_selector(checkpoint: str | Path):
    """A SelectorModule from a checkpoint written by ``ddte train``, in eval mode on CPU.

    Raises FileNotFoundError if the file is missing, ValueError if it is not a selector checkpoint.
    """
    from selector.root.model import SelectorModule

    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' not found")
    try:
        # weights_only: tensors and plain containers, never arbitrary pickled objects (a checkpoint is user input)
        module = SelectorModule.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch/pickle/Lightning raise many types for a foreign or truncated file
        raise ValueError(f"'{path}' is not a selector checkpoint ({type(err).__name__})") from err
    if module.info is None:
        raise ValueError(f"'{path}' has no ddte metadata (actions, verifier): was it written by `ddte train`?")
    return module.eval()


def selector_metadata(module, run_id: str | None = None) -> SelectorMetadata:
    """The metadata of the exported file, from what the checkpoint carries (:class:`selector.root.info.SelectorInfo`).

    Raises ValueError for a checkpoint trained before the never-lose guard (no fallbacks): retrain it.
    """
    return module.info.metadata(module.deployed().invalid_score, run_id or module.run_id or "")


# ---------------------------------------------------------------------------------------------------- inputs


def random_inputs(module, n: int, seed: int = 0) -> dict[str, Any]:
    """n random rows: N(0, 1) hidden states and raw scalars drawn around the training distribution."""
    import numpy as np

    rng = np.random.default_rng(seed)
    facts = module.info.data
    norm = module.info.normalisation
    z = rng.normal(0.0, 1.5, (n, len(norm["mean"])))
    x = z * np.asarray(norm["std"]) + np.asarray(norm["mean"])
    log_mask = np.array([name in norm["log1p"] for name in norm["scalar_names"]])
    # back to raw units, >= 0 where log1p applies; capped at e^60 (a heavy-tailed KL's draw would overflow float32)
    x = np.where(log_mask, np.expm1(np.clip(x, 0.0, 60.0)), x)
    out = {name: rng.normal(0.0, 1.0, (n, int(facts.hidden_sizes[name]))).astype(np.float32)
           for name in INPUT_NAMES[:3]}
    out["scalars"] = x.astype(np.float32)
    return out


def real_inputs(module, data_dir: str | Path | None, n: int) -> dict[str, Any] | None:
    """The first n rows of the data set (the checkpoint's own, unless ``data_dir`` is given); None if absent."""
    from data_gen.schema import METADATA_FILE, SHARD_GLOB
    from data_gen.store import read_shards
    from selector.root.root_data import list_column

    folder = Path(data_dir or module.info.data.data_dir or "")
    shards = sorted(folder.glob(SHARD_GLOB)) if (folder / METADATA_FILE).is_file() else []
    if not shards:
        if data_dir is not None:
            raise ValueError(f"--data '{data_dir}' has no data set ({METADATA_FILE} + {SHARD_GLOB})")
        return None
    table = read_shards(shards[:1], list(INPUT_NAMES)).slice(0, n)
    sizes = {**module.info.data.hidden_sizes, "scalars": len(module.info.data.scalar_names)}
    return {name: list_column(table, name, int(sizes[name])) for name in INPUT_NAMES}


# ---------------------------------------------------------------------------------------------------- export


def _export_graph(net, path: Path, example: dict[str, Any]) -> None:
    """torch.onnx.export (dynamo) of the selector network to ONE file with a dynamic batch axis."""
    import torch

    args = tuple(torch.from_numpy(example[name][:2]) for name in INPUT_NAMES)  # batch 2: avoids 0/1 specialisation
    export_onnx(net, path, args, list(INPUT_NAMES), OUTPUT_NAME)


def export_onnx(net, path: Path, args: tuple, input_names: list[str], output_name: str) -> None:
    """torch.onnx.export (dynamo) of ``net`` called on ``args`` (batch of at least 2) to ONE file, each input's
    first axis a dynamic batch."""
    import torch

    batch = torch.export.Dim("batch")
    # "torchvision is not installed. Skipping torchvision::nms" and friends: harmless, logged at WARNING.
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter chatter (progress lines, deprecations); failures still raise
        torch.onnx.export(
            net, args, str(path), dynamo=True, external_data=False, verbose=False,
            input_names=input_names, output_names=[output_name],
            dynamic_shapes={name: {0: batch} for name in input_names},
        )
    registration.setLevel(level)


def attach_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Write ``metadata`` into the file's metadata_props (replacing keys of the same name)."""
    import onnx

    model = onnx.load(str(path))
    kept = [p for p in model.metadata_props if p.key not in metadata]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def check_parity(net, path: Path, inputs: dict[str, Any]) -> float:
    """Max |torch − onnxruntime (CPU)| over the scores of ``inputs`` (dict of (N, ·) float32 arrays)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT_NAME], {name: inputs[name] for name in INPUT_NAMES})[0]
    with torch.no_grad():
        want = net(*(torch.from_numpy(inputs[name]) for name in INPUT_NAMES)).numpy()
    if got.shape != want.shape:
        raise ValueError(f"ONNX output shape {got.shape} differs from torch {want.shape}")
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))


def log_to_mlflow(path: Path, tracking_uri: str, run_id: str, max_abs_diff: float, inputs: dict[str, Any],
                  outputs: Any, registered_name: str | None = None) -> str:
    """Log the ONNX file as an MLflow model (``selector``) under the training run, and register it as a new version
    of ``registered_name`` in the model registry; returns the model URI."""
    import mlflow
    import mlflow.onnx
    import onnx
    from mlflow.models import infer_signature

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    try:
        with warnings.catch_warnings(), mlflow.start_run(run_id=run_id):
            warnings.simplefilter("ignore")
            signature = infer_signature({k: v[:2] for k, v in inputs.items()}, {OUTPUT_NAME: outputs[:2]})
            # MLflow prints "Successfully registered model ..." and "Created version ..." straight to stderr (no
            # logger to quiet); the export's own line says where the model went
            with contextlib.redirect_stderr(io.StringIO()):
                info = mlflow.onnx.log_model(onnx.load(str(path)), name="selector", signature=signature,
                                             save_as_external_data=False, registered_model_name=registered_name)
            mlflow.log_metric("export/max_abs_diff", max_abs_diff)
            return info.model_uri
    finally:
        mlflow.set_tracking_uri(previous)


def check_run_exists(tracking_uri: str, run_id: str) -> None:
    """ValueError unless MLflow run ``run_id`` exists at ``tracking_uri`` (a sqlite store must exist already: it is
    not created to be asked)."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and not Path(tracking_uri[len(prefix):]).is_file():
        raise ValueError(f"no MLflow store at {tracking_uri} to log the model to run {run_id}")
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri).get_run(run_id)
    except Exception as err:  # MLflow raises its own (RESOURCE_DOES_NOT_EXIST) and SQLAlchemy/HTTP errors
        raise ValueError(f"no MLflow run {run_id} at {tracking_uri}") from err


def export_selector(
    checkpoint: str | Path,
    output: str | Path,
    *,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    data_dir: str | Path | None = None,
    log_mlflow: bool = True,
    parity_rows: int = 64,
    tolerance: float = TOLERANCE,
) -> ExportResult:
    """Export ``checkpoint`` to ``output`` (one .onnx file), check parity, attach metadata, optionally log to MLflow.

    Args:
        checkpoint: a ``best.ckpt`` from ``ddte train``.
        output: the .onnx path; written atomically (temporary file + rename), never left half-written.
        tracking_uri, run_id: where to log the model (default: the run recorded in the checkpoint).
        data_dir: data set whose first rows join the parity batch (default: the checkpoint's own, if present).
        log_mlflow: False skips MLflow entirely.
        parity_rows: random rows, and real rows, in the parity batch.
        tolerance: largest accepted max |torch − onnxruntime|.

    Raises:
        FileNotFoundError: missing checkpoint. ValueError: bad checkpoint, parity failure. OSError: unwritable
        output.
    """
    import numpy as np

    from ddte_core.tracking import resolve_tracking_uri

    module = load_selector(checkpoint)
    net = module.deployed()  # the network + softmax for the policy objective: what the decoder runs
    output = Path(output)
    if output.is_dir():
        raise ValueError(f"output '{output}' is a directory; give a file name such as selector.onnx")
    rand = random_inputs(module, parity_rows)
    real = real_inputs(module, data_dir, parity_rows)
    batch = rand if real is None else {k: np.concatenate([rand[k], real[k]]) for k in INPUT_NAMES}
    explicit_run = bool(run_id or tracking_uri)
    run_id = run_id or module.run_id
    metadata = selector_metadata(module, run_id)
    uri = tracking_uri or module.tracking_uri
    if log_mlflow and explicit_run and run_id and uri:  # a run the user named must exist before anything is written
        check_run_exists(resolve_tracking_uri(uri), run_id)
    diff = _write_checked(net, output, batch, metadata, tolerance)
    result = ExportResult(path=output.resolve(), max_abs_diff=diff, metadata=metadata,
                          parity_rows={"random": parity_rows, "real": 0 if real is None else len(real["scalars"])})
    if log_mlflow and run_id and uri:
        result.mlflow_model_uri = _log_model(net, output, uri, run_id, diff, batch, metadata.verifier, explicit_run)
    return result


def _write_checked(net, output: Path, batch: dict, metadata: SelectorMetadata, tolerance: float) -> float:
    """Write the graph with its metadata to ``output`` whole or not at all, once its parity with torch on ``batch``
    is within ``tolerance``; returns the largest |torch − onnxruntime|."""
    with staged_file(output) as tmp:  # an ordinary shared file, renamed onto output once whole
        _export_graph(net, tmp, batch)
        attach_metadata(tmp, metadata.to_props())
        diff = check_parity(net, tmp, batch)
        if not diff <= tolerance:
            raise ValueError(f"ONNX parity check failed: max |torch - onnxruntime| = {diff:.3g} > {tolerance:g}")
    return diff


def _log_model(net, output: Path, uri: str, run_id: str, diff: float, batch: dict, verifier: str,
               explicit_run: bool) -> str | None:
    """The model's MLflow URI once logged to ``run_id``; a failure is an error for a run the user named, else a
    warning (the .onnx file is good either way)."""
    import torch

    from ddte_core.tracking import resolve_tracking_uri

    with torch.no_grad():
        scores = net(*(torch.from_numpy(batch[n]) for n in INPUT_NAMES)).numpy()
    try:
        return log_to_mlflow(output, resolve_tracking_uri(uri), run_id, diff, batch, scores,
                             f"ddte-selector-{verifier}")
    except Exception as err:  # MLflow raises its own and SQLAlchemy/HTTP errors: the .onnx is still good
        message = f"could not log the model to MLflow run {run_id} at {uri}: {type(err).__name__}: {err}"
        if explicit_run:
            raise ValueError(message.splitlines()[0]) from err
        print(f"warning: {message.splitlines()[0]}", file=sys.stderr)
        return None
