"""Train the acceptance model (selector/acceptance/acceptance.py) on a dense data set with Lightning, tracked in
MLflow, and export it to ONNX with its parity checked.

The config is typed YAML with ``KEY=VALUE`` overrides (ddte_core/yamlconfig.py; default
configs/acceptance/default.yaml): :class:`AcceptanceConfig`. Prompts are split three ways (every node of a prompt in
one split); the checkpoint kept is the best validation loss; the figures are the test split's, beside the draft's
entropy alone (an isotonic fit on the training split: the rule the model has to beat). Logged: the config, the data
set as the run's input, per-epoch losses, the test split's loss, R² and calibration, per category, a calibration plot,
the ONNX file and its parity.

``data.label`` picks what the model and the entropy baseline are fitted to: ``exact`` (the default) β = 1 − TV(p, q),
or ``realized``, the drawn token's min(1, p(x)/q(x)) (a schema-2 dense set drawn from the draft). The model reads no
x, and the realized label's mean over the draw is β, so both fit the same quantity; the realized one is what a chain
actually met. The test figures are always against β, the noise-free value of what either label estimates, and with
``realized`` the test cross-entropy against the realized label is logged beside them (``…/realized_cross_entropy``).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddte_core.yamlconfig import load_yaml_config
from selector.acceptance.acceptance import (
    AcceptanceGraph,
    AcceptanceNet,
    basis_statistics,
    calibration_bins,
    calibration_error,
    predict,
    r_squared,
    soft_cross_entropy,
)
from selector.acceptance.acceptance_data import LABELS, DenseArrays, load_dense, split_by_prompt
from selector.acceptance.acceptance_file import AcceptanceMetadata

DEFAULT_CONFIG = "configs/acceptance/default.yaml"


@dataclass
class AcceptanceModelOptions:
    width: int = 64
    dropout: float = 0.1
    lr: float = 0.002
    weight_decay: float = 0.0001


@dataclass
class AcceptanceDataOptions:
    data_dir: str = ""
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    split_seed: int = 0
    batch_size: int = 512
    label: str = "exact"  # what it fits: exact β, or the drawn token's realized min(1, p/q) (acceptance_data.LABELS)


@dataclass
class AcceptanceTrainerOptions:
    max_epochs: int = 30
    accelerator: str = "cpu"
    devices: int = 1


@dataclass
class AcceptanceRunOptions:
    output: str = "acceptance.onnx"
    tracking_uri: str | None = None
    experiment: str = "acceptance"
    run_name: str | None = None
    progress: bool = True


@dataclass
class AcceptanceConfig:
    seed: int = 0
    model: AcceptanceModelOptions = field(default_factory=AcceptanceModelOptions)
    data: AcceptanceDataOptions = field(default_factory=AcceptanceDataOptions)
    trainer: AcceptanceTrainerOptions = field(default_factory=AcceptanceTrainerOptions)
    run: AcceptanceRunOptions = field(default_factory=AcceptanceRunOptions)


@dataclass
class AcceptanceResult:
    """What :func:`train_acceptance` returns.

    Attributes:
        path: the ONNX file; run_id: its MLflow run.
        test: the test split's figures for the model and for the entropy alone (``model/…``, ``entropy/…``).
        per_category: per category, nodes and both R².
        parity: max |torch − onnxruntime| over test nodes; call_us: median of one node's onnxruntime call.
        label: what it was fitted to (``data.label``).
    """

    path: Path
    run_id: str
    test: dict[str, float]
    per_category: dict[str, dict[str, float]]
    parity: float
    call_us: float
    label: str = "exact"


def load_acceptance_config(path: str | Path | None = DEFAULT_CONFIG, overrides: Sequence[str] = ()
                           ) -> AcceptanceConfig:
    config = load_yaml_config(AcceptanceConfig, path, list(overrides))
    if not str(config.run.output).endswith(".onnx"):
        raise ValueError(f"run.output {config.run.output!r}: an .onnx file")
    for name in ("width", "max_epochs", "batch_size"):
        section = config.model if name == "width" else config.trainer if name == "max_epochs" else config.data
        if getattr(section, name) < 1:
            raise ValueError(f"{name} must be at least 1")
    if config.data.label not in LABELS:
        raise ValueError(f"data.label must be one of {', '.join(LABELS)}, got {config.data.label!r}")
    return config


def entropy_baseline(train: DenseArrays, test: DenseArrays, label: str = "exact") -> np.ndarray:
    """β̂ on ``test`` from the draft's entropy alone: a decreasing isotonic fit on ``train``'s ``label``."""
    from sklearn.isotonic import IsotonicRegression

    fit = IsotonicRegression(increasing=False, out_of_bounds="clip").fit(train.scalars[:, 0], train.label(label))
    return fit.predict(test.scalars[:, 0])


def score_test_split(predicted: np.ndarray, baseline: np.ndarray, test: DenseArrays, label: str = "exact"
                 ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(overall figures, per-category figures) of the model's and the entropy's β̂ ``(N,)`` on ``test``, against β
    (and, for a model fitted to the ``realized`` label, its cross-entropy against that label too)."""
    overall = {}
    for name, values in (("model", predicted), ("entropy", baseline)):
        overall[f"{name}/r2"] = r_squared(values, test.beta)
        overall[f"{name}/cross_entropy"] = soft_cross_entropy(values, test.beta)
        overall[f"{name}/calibration_error"] = calibration_error(values, test.beta)
        overall[f"{name}/mae"] = float(np.abs(values - test.beta).mean())
        if label == "realized":
            overall[f"{name}/realized_cross_entropy"] = soft_cross_entropy(values, test.label(label))
    per_category = {}
    for category in sorted(set(test.categories.tolist())):
        rows = test.categories == category
        per_category[str(category)] = {"nodes": int(rows.sum()), "mean_beta": float(test.beta[rows].mean()),
                                       "model_r2": r_squared(predicted[rows], test.beta[rows]),
                                       "entropy_r2": r_squared(baseline[rows], test.beta[rows]),
                                       "model_cross_entropy": soft_cross_entropy(predicted[rows], test.beta[rows])}
    return overall, per_category


def calibration_figure(predicted: np.ndarray, baseline: np.ndarray, label: np.ndarray):
    """Reliability diagram on the test split: mean β per bin of β̂, for the model and the entropy alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
    for name, values in (("acceptance model", predicted), ("entropy (isotonic)", baseline)):
        cells = calibration_bins(values, label)
        ax.plot([c[0] for c in cells], [c[1] for c in cells], marker="o", label=name)
    ax.set_xlabel("predicted β̂ (bin mean)")
    ax.set_ylabel("β = 1 − TV(p, q) (bin mean)")
    ax.set_title("acceptance calibration, test prompts")
    ax.legend()
    fig.tight_layout()
    return fig


def _module(net: AcceptanceNet, options: AcceptanceModelOptions, max_epochs: int, progress: bool):
    """The LightningModule around ``net``: soft binary cross-entropy, AdamW, cosine decay."""
    import lightning.pytorch as pl
    import torch

    class AcceptanceModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def _loss(self, batch):
            hidden, scalars, beta = batch
            return torch.nn.functional.binary_cross_entropy_with_logits(self.net(hidden, scalars), beta)

        def training_step(self, batch, _):
            loss = self._loss(batch)
            self.log("train/loss", loss, on_step=False, on_epoch=True, batch_size=len(batch[2]))
            return loss

        def validation_step(self, batch, _):
            self.log("val/loss", self._loss(batch), on_step=False, on_epoch=True, batch_size=len(batch[2]))

        def on_train_epoch_end(self) -> None:  # after the epoch's validation: both losses are in
            if progress:
                m = self.trainer.callback_metrics
                print(f"epoch {self.current_epoch + 1}/{max_epochs}, train loss {float(m['train/loss']):.4f}, "
                      f"val loss {float(m['val/loss']):.4f}", flush=True)

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=options.lr, weight_decay=options.weight_decay)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, max_epochs))
            return [optimizer], [schedule]

    return AcceptanceModule()


def _loader(arrays: DenseArrays, label: str, batch_size: int, shuffle: bool, seed: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.as_tensor(arrays.hidden), torch.as_tensor(arrays.scalars),
                         torch.as_tensor(arrays.label(label)))
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed) if shuffle else None)


def fit_base(net: AcceptanceNet, train: DenseArrays, steps: int = 100, label: str = "exact") -> None:
    """Fit the net's scalar ``base`` alone to ``train``'s ``label`` (full-batch L-BFGS on the soft cross-entropy;
    the residual is zero at initialisation), so that training starts at the entropy's model and the hidden state only
    adds to it."""
    import torch

    from selector.acceptance.acceptance import scalar_basis

    basis = (scalar_basis(torch.as_tensor(train.scalars)) - net.basis_mean) / net.basis_std
    beta = torch.as_tensor(train.label(label))
    optimizer = torch.optim.LBFGS(net.base.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net.base(basis).squeeze(-1), beta)
        loss.backward()
        return loss

    optimizer.step(closure)


def fit_net(config: AcceptanceConfig, train: DenseArrays, val: DenseArrays, logger) -> AcceptanceNet:
    """Train the net on ``train``, keep the state of the best validation loss."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddte_core.signals import training_interrupts

    pl.seed_everything(config.seed, workers=True, verbose=False)
    mean, std = basis_statistics(train.scalars)
    net = AcceptanceNet(train.hidden.shape[1], config.model.width, config.model.dropout, mean, std)
    fit_base(net, train, label=config.data.label)
    module = _module(net, config.model, config.trainer.max_epochs, config.run.progress)
    with tempfile.TemporaryDirectory(prefix="ddte-acceptance-") as folder:
        checkpoint = ModelCheckpoint(dirpath=folder, filename="best", monitor="val/loss", mode="min", save_top_k=1,
                                     auto_insert_metric_name=False, enable_version_counter=False)
        trainer = pl.Trainer(max_epochs=config.trainer.max_epochs, accelerator=config.trainer.accelerator,
                             devices=config.trainer.devices, logger=logger, callbacks=[checkpoint],
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             log_every_n_steps=10)
        label = config.data.label
        with training_interrupts(getattr(logger, "experiment", None)):  # Ctrl-C: exit 130, no store left locked
            trainer.fit(module, _loader(train, label, config.data.batch_size, True, config.seed),
                        _loader(val, label, config.data.batch_size, False, config.seed))
        state = torch.load(checkpoint.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
    net.load_state_dict({k[len("net."):]: v for k, v in state.items()})
    return net.eval()


def export_acceptance(net: AcceptanceNet, path: Path, temperatures: list[float], metadata: dict[str, str],
                      check: np.ndarray) -> tuple[float, float]:
    """Write the graph (:class:`AcceptanceGraph`) with ``metadata`` to ``path`` whole or not at all, an ordinary
    shared file (ddte_core.paths.staged_file); returns (max |torch − onnxruntime| on the node vectors ``check``
    ``(N, H + 3)``, median µs of a one-node onnxruntime call)."""
    import onnxruntime as ort
    import torch

    from ddte_core.paths import staged_file
    from selector.root.export import attach_metadata, export_onnx

    graph = AcceptanceGraph(net, net.norm.normalized_shape[0], temperatures).eval()
    with staged_file(path) as tmp:
        export_onnx(graph, tmp, (torch.as_tensor(check[:2]),), ["node"], "beta")
        attach_metadata(tmp, metadata)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(tmp), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {"node": check})[0]
        with torch.no_grad():
            want = graph(torch.as_tensor(check)).numpy()
        parity = float(np.max(np.abs(got.astype(np.float64) - want)))
        if not parity < 1e-4:
            raise ValueError(f"the ONNX graph differs from the torch model by {parity:.2e} (max |Δβ̂|)")
        one, times = check[:1], []
        for _ in range(200):
            start = time.perf_counter()
            session.run(None, {"node": one})
            times.append(time.perf_counter() - start)
    return parity, float(np.median(times) * 1e6)


def node_vectors(arrays: DenseArrays) -> np.ndarray:
    """``(N, H + 3)`` the exported graph's input for ``arrays``: hidden state, entropy, top probability, depth."""
    return np.concatenate([arrays.hidden, arrays.scalars[:, :3]], axis=1).astype(np.float32)


def train_acceptance(config: AcceptanceConfig) -> AcceptanceResult:
    """Read, split, train, score, export and log (see the module docstring)."""
    from ddte_core.tracking import (
        flatten_params,
        lightning_logger,
        log_data_set_input,
        log_environment,
        quiet_lightning,
        resolve_tracking_uri,
    )

    metadata, arrays = load_dense(config.data.data_dir)
    arrays.label(config.data.label)  # a set without the label is refused before anything is logged or trained
    train_rows, val_rows, test_rows = split_by_prompt(arrays.prompts, config.data.val_fraction,
                                                      config.data.test_fraction, config.data.split_seed)
    train, val, test = (arrays.take(rows) for rows in (train_rows, val_rows, test_rows))
    uri = resolve_tracking_uri(config.run.tracking_uri)
    with quiet_lightning():
        logger = lightning_logger(uri, config.run.experiment, config.run.run_name or Path(config.data.data_dir).name,
                                  {"ddte.kind": "acceptance"})
        client, run_id = logger.experiment, logger.run_id
        try:
            logger.log_hyperparams(flatten_params("", dataclasses.asdict(config)))
            client.log_dict(run_id, dataclasses.asdict(config), "config.json")
            log_data_set_input(client, run_id, config.data.data_dir, dense_fingerprint(config.data.data_dir))
            log_environment(client, run_id)
            net = fit_net(config, train, val, logger)
            result = _score_export_log(net, config, metadata, arrays, train, test, client, run_id)
        except BaseException:
            client.set_terminated(run_id, "FAILED")
            raise
    client.set_terminated(run_id)
    return result


def _score_export_log(net: AcceptanceNet, config: AcceptanceConfig, metadata: dict, arrays: DenseArrays,
                      train: DenseArrays, test: DenseArrays, client, run_id: str) -> AcceptanceResult:
    """The test split's figures beside the entropy's, the ONNX file, and both logged to the run."""
    import matplotlib.pyplot as plt

    output = Path(config.run.output)
    label = config.data.label
    predicted, baseline = predict(net, test.hidden, test.scalars), entropy_baseline(train, test, label)
    figures, per_category = score_test_split(predicted, baseline, test, label)
    temperatures = sorted(float(t) for t in np.unique(arrays.scalars[:, 3]))
    props = acceptance_props(metadata, config, arrays, temperatures)
    parity, call_us = export_acceptance(net, output, temperatures, props, node_vectors(test)[:2048])
    for key, value in {**figures, "parity_max_abs": parity, "onnx_call_us": call_us,
                       "nodes/train": len(train), "nodes/test": len(test)}.items():
        client.log_metric(run_id, key if key in ("parity_max_abs", "onnx_call_us") or key.startswith("nodes/")
                          else f"test/{key}", float(value))
    client.log_dict(run_id, per_category, "per_category.json")
    figure = calibration_figure(predicted, baseline, test.beta)
    client.log_figure(run_id, figure, "plots/calibration.png")
    plt.close(figure)
    client.log_artifact(run_id, str(output))
    return AcceptanceResult(output, run_id, figures, per_category, parity, call_us, label)


def dense_fingerprint(folder: str | Path) -> str:
    """sha256 over dense.json's bytes and every shard's name and size (selector/root/root_data.py
    ``folder_fingerprint``)."""
    from selector.root.root_data import folder_fingerprint

    return folder_fingerprint(Path(folder) / "dense.json", sorted(Path(folder).glob("dense-*.parquet")))


def acceptance_props(metadata: dict, config: AcceptanceConfig, arrays: DenseArrays, temperatures: list[float]
                     ) -> dict[str, str]:
    """The file's ``metadata_props``: what it reads, which pair and data fitted it, which prompts it saw."""
    return AcceptanceMetadata(int(arrays.hidden.shape[1]), temperatures, metadata["pair"],
                              dense_fingerprint(config.data.data_dir),
                              sorted(set(arrays.prompts.tolist()), key=str), metadata["prompts"],
                              label=config.data.label).to_props()


def format_acceptance(result: AcceptanceResult) -> str:
    """The test split's table: the model beside the entropy, overall and per category."""
    t = result.test
    lines = [f"fitted to the {result.label} label; scored against β = 1 − TV(p, q)", "",
             "| test prompts | R² | cross-entropy | calibration error |", "|---|---:|---:|---:|"]
    for name, label in (("model", "acceptance model"), ("entropy", "entropy alone (isotonic)")):
        lines.append(f"| {label} | {t[f'{name}/r2']:.3f} | {t[f'{name}/cross_entropy']:.4f} | "
                     f"{t[f'{name}/calibration_error']:.3f} |")
    lines += ["", "| category | nodes | mean β | R² model | R² entropy |", "|---|---:|---:|---:|---:|"]
    for category, c in result.per_category.items():
        lines.append(f"| {category} | {c['nodes']} | {c['mean_beta']:.3f} | {c['model_r2']:.3f} | "
                     f"{c['entropy_r2']:.3f} |")
    lines.append(f"\nwrote {result.path} (onnxruntime parity {result.parity:.1e}, one node {result.call_us:.0f} µs); "
                 f"MLflow run {result.run_id}")
    return "\n".join(lines)
