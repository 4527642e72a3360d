"""sklearn baselines on the same splits, decisions and offline metrics as the neural selector.

Both predict Ê[τ+1] per action and decide like the ``be`` objective: argmax over valid actions of
predicted_be / step_ms. Features: the standardised scalars (same log1p + mean/std as the selector, fitted on the
training split) plus a PCA of the three hidden blocks concatenated (fitted on the training split).

* ``ridge``: one multi-output Ridge regression, features -> Ê for every action at once.
* ``hgb``: one HistGradientBoostingRegressor over (features, K, L1, L2) -> Ê, trained on a random subsample of
  (root, valid action) pairs so it fits in seconds.

Each baseline is logged as its own MLflow run (child of the selector's run: tag ``mlflow.parentRunId``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from decode.policies.features import HIDDEN_NAMES
from selector.root.data import Normalisation
from selector.root.metrics import OfflineMetrics, offline_metrics
from selector.root.root_data import RootArrays

BASELINES = ("ridge", "hgb")


@dataclass
class BaselineResult:
    """Offline metrics of one baseline per evaluated split, with its parameters and MLflow run."""

    name: str
    metrics: dict[str, OfflineMetrics]
    params: dict[str, Any]
    fit_seconds: float
    run_id: str | None = None


class FeatureMap:
    """Standardised scalars + PCA of the concatenated hidden states, both fitted on training rows."""

    def __init__(self, normalisation: Normalisation, n_components: int = 8, seed: int = 0):
        self.normalisation = normalisation
        self.n_components = n_components
        self.seed = seed
        self.pca = None

    @staticmethod
    def _hidden(arrays: RootArrays) -> np.ndarray:
        return np.concatenate([arrays.hidden[name] for name in HIDDEN_NAMES], axis=1)

    def fit(self, train: RootArrays) -> FeatureMap:
        from sklearn.decomposition import PCA

        hidden = self._hidden(train)
        k = min(self.n_components, hidden.shape[1], max(1, len(train) - 1))
        self.pca = PCA(n_components=k, random_state=self.seed).fit(hidden)
        return self

    def transform(self, arrays: RootArrays) -> np.ndarray:
        """(N, S + n_components) float32."""
        pcs = self.pca.transform(self._hidden(arrays))
        return np.concatenate([self.normalisation.apply(arrays.scalars), pcs], axis=1).astype(np.float32)


def choose_by_throughput(predicted_be: np.ndarray, arrays: RootArrays) -> np.ndarray:
    """(N,) argmax over valid actions of predicted_be / step_ms."""
    valid = arrays.valid
    value = np.where(valid, predicted_be / np.where(valid, arrays.step_ms, 1.0), -np.inf)
    return np.argmax(value, axis=1)


def evaluate(predicted_be: np.ndarray, arrays: RootArrays) -> OfflineMetrics:
    """Offline metrics of the throughput decision on predicted Ê (N, A)."""
    chosen = choose_by_throughput(predicted_be, arrays)
    return offline_metrics(chosen, arrays.be, arrays.step_ms, arrays.sampling_index, arrays.base_index,
                           arrays.per_step)


# ---------------------------------------------------------------------------------------------------- models


def fit_ridge(x: np.ndarray, train: RootArrays, alpha: float = 1.0):
    """Multi-output Ridge: features (N, F) -> Ê (N, A). Missing labels are filled with the action's mean."""
    from sklearn.linear_model import Ridge

    be = train.be.astype(np.float64)
    column_mean = np.nanmean(np.where(train.valid, be, np.nan), axis=0)
    column_mean = np.where(np.isfinite(column_mean), column_mean, 1.0)  # an action with no label at all
    target = np.where(train.valid, be, column_mean[None, :])
    return Ridge(alpha=alpha).fit(x, target)


def _action_table(actions: list[str]) -> np.ndarray:
    """(A, 3) float32 of (K, L1, L2)."""
    return np.array([[int(v) for v in a.split(",")] for a in actions], dtype=np.float32)


def _pair_features(x: np.ndarray, shapes: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Rows of (root features, K, L1, L2) for the (root, action) pairs given by index arrays."""
    return np.concatenate([x[rows], shapes[cols]], axis=1)


def fit_hgb(x: np.ndarray, train: RootArrays, actions: list[str], max_samples: int, seed: int):
    """HistGradientBoostingRegressor on a subsample of (root, valid action) pairs -> Ê."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    rows, cols = np.nonzero(train.valid)
    rng = np.random.default_rng(seed)
    if rows.size > max_samples:
        keep = rng.choice(rows.size, max_samples, replace=False)
        rows, cols = rows[keep], cols[keep]
    shapes = _action_table(actions)
    model = HistGradientBoostingRegressor(max_iter=150, learning_rate=0.1, max_leaf_nodes=31, random_state=seed)
    return model.fit(_pair_features(x, shapes, rows, cols), train.be[rows, cols])


def predict_hgb(model, x: np.ndarray, actions: list[str]) -> np.ndarray:
    """Ê for every (root, action): (N, A)."""
    n, a = x.shape[0], len(actions)
    rows, cols = np.repeat(np.arange(n), a), np.tile(np.arange(a), n)
    return model.predict(_pair_features(x, _action_table(actions), rows, cols)).reshape(n, a)


# ---------------------------------------------------------------------------------------------------- running


def fit_and_evaluate(name: str, splits: dict[str, RootArrays], normalisation: Normalisation, actions: list[str],
                     max_samples: int = 60000, seed: int = 0) -> BaselineResult:
    """Fit baseline ``name`` on the training split; metrics on val and test."""
    start = time.perf_counter()
    features = FeatureMap(normalisation, seed=seed).fit(splits["train"])
    x = {split: features.transform(arrays) for split, arrays in splits.items()}
    if name == "ridge":
        model = fit_ridge(x["train"], splits["train"])
        predict = model.predict
        params = {"alpha": 1.0}
    elif name == "hgb":
        model = fit_hgb(x["train"], splits["train"], actions, max_samples, seed)
        predict = lambda features_: predict_hgb(model, features_, actions)  # noqa: E731
        params = {"max_iter": 150, "learning_rate": 0.1, "max_leaf_nodes": 31, "max_samples": max_samples}
    else:
        raise ValueError(f"unknown baseline '{name}' ({', '.join(BASELINES)})")
    fit_s = time.perf_counter() - start
    metrics = {split: evaluate(predict(x[split]), splits[split]) for split in ("val", "test")}
    params.update(features="scalars+pca", pca_components=features.pca.n_components_, decision="throughput")
    return BaselineResult(name=name, metrics=metrics, params=params, fit_seconds=fit_s)


def log_baseline(result: BaselineResult, tracking_uri: str, experiment_id: str, parent_run_id: str | None,
                 tags: dict[str, str]) -> str:
    """One MLflow run for a baseline: params, val/test metrics, fit time. Returns its run id."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run_tags = {"mlflow.runName": f"baseline-{result.name}", "ddte.baseline": result.name, **tags}
    if parent_run_id:
        run_tags.update({"mlflow.parentRunId": parent_run_id, "ddte.parent_run_id": parent_run_id})
    run = client.create_run(experiment_id, tags=run_tags)
    now = int(time.time() * 1000)
    metrics = {"fit_seconds": result.fit_seconds}
    for split, m in result.metrics.items():
        metrics.update(m.as_dict(f"{split}/"))
    client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in result.params.items()],
                     metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def run_baselines(dm, tracking_uri: str | None = None, experiment_id: str | None = None,
                  parent_run_id: str | None = None, max_samples: int = 60000, seed: int = 0,
                  names: tuple[str, ...] = BASELINES) -> list[BaselineResult]:
    """Fit every baseline on a set-up SelectorDataModule; log each as an MLflow run when a URI is given."""
    dm.setup("fit")
    results = []
    for name in names:
        result = fit_and_evaluate(name, dm.splits, dm.normalisation, dm.info.actions, max_samples, seed)
        if tracking_uri and experiment_id is not None:
            result.run_id = log_baseline(result, tracking_uri, experiment_id, parent_run_id,
                                         {"ddte.verifier": dm.info.verifier})
        results.append(result)
    return results
