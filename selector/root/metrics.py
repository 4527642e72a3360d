"""Offline metrics of a selector on labelled roots, and the plots that go with them.

Throughput of an action on a root = Ê[τ+1] / T̂ = ``be / step_ms`` (tokens per ms). Over a set of roots we use the
**stream throughput** of a rule that picks ``chosen[i]`` on root i (``decode/cost/throughput.py``, which says why),
read as the collection placed its roots (``per_step``, from dataset.json's ``roots``):

    positions:  TP(chosen) = N / Σ_i step_ms[i, chosen[i]] / be[i, chosen[i]]
    steps:      TP(chosen) = Σ_i be[i, chosen[i]] / Σ_i step_ms[i, chosen[i]]

i.e. the tokens per ms of a decoding loop whose steps look like these roots. Per sampling configuration c:

* ``ratio_vs_static`` = TP(chosen) / TP(a_base(c)), a_base(c) = the best static action of that configuration;
* ``ratio_vs_oracle`` = TP(chosen) / TP(oracle), oracle = the per-root choice with the highest TP over the
  configuration's roots (``per_root_best``: over positions the per-root argmax of be / step_ms; over steps the
  argmax of be − λ·step_ms at the optimal rate λ);
* ``regret`` = 1 − ratio_vs_oracle.

(No rule beats the per-root oracle, so ratio_vs_oracle <= 1.) The overall numbers are the plain mean over sampling
configurations: every configuration is its own deployment setting, as in the paper's tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from decode.cost.throughput import per_root_best, stream_throughput


@dataclass(frozen=True)
class ConfigMetrics:
    """Stream throughputs (tokens/ms) of the chosen, static and oracle rules on one sampling configuration."""

    n_rows: int
    throughput: float
    static_throughput: float
    oracle_throughput: float

    @property
    def ratio_vs_static(self) -> float:
        return self.throughput / self.static_throughput

    @property
    def ratio_vs_oracle(self) -> float:
        return self.throughput / self.oracle_throughput

    @property
    def regret(self) -> float:
        return 1.0 - self.ratio_vs_oracle


@dataclass(frozen=True)
class OfflineMetrics:
    """Per-configuration metrics and their means (see the module docstring for the definitions)."""

    per_config: dict[int, ConfigMetrics]

    @property
    def ratio_vs_static(self) -> float:
        return float(np.mean([m.ratio_vs_static for m in self.per_config.values()]))

    @property
    def ratio_vs_oracle(self) -> float:
        return float(np.mean([m.ratio_vs_oracle for m in self.per_config.values()]))

    @property
    def regret(self) -> float:
        return 1.0 - self.ratio_vs_oracle

    @property
    def static_vs_oracle(self) -> float:
        """How far the best static action itself is from the oracle: the head-room a selector can win."""
        return float(np.mean([m.static_throughput / m.oracle_throughput for m in self.per_config.values()]))

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` for loggers; per-config keys end in ``/cfg<index>``."""
        out = {
            f"{prefix}ratio_vs_static": self.ratio_vs_static,
            f"{prefix}ratio_vs_oracle": self.ratio_vs_oracle,
            f"{prefix}regret": self.regret,
            f"{prefix}static_vs_oracle": self.static_vs_oracle,
        }
        for c, m in sorted(self.per_config.items()):
            out[f"{prefix}ratio_vs_static/cfg{c}"] = m.ratio_vs_static
            out[f"{prefix}ratio_vs_oracle/cfg{c}"] = m.ratio_vs_oracle
        return out


def row_throughput(be: np.ndarray, step_ms: np.ndarray) -> np.ndarray:
    """be / step_ms (N, A), −inf where the action has no label (so argmax never picks it)."""
    valid = np.isfinite(be) & np.isfinite(step_ms) & (step_ms > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(valid, be / np.where(valid, step_ms, 1.0), -np.inf)


def oracle_actions(be: np.ndarray, step_ms: np.ndarray, per_step: bool = False,
                   sampling_index: np.ndarray | None = None) -> np.ndarray:
    """(N,) the per-root oracle's action of each row, among labelled actions (finite be, positive finite step_ms):
    the choice with the highest stream throughput over the rows of each sampling configuration
    (``sampling_index``; None: one configuration). Over positions that is the argmax of be / step_ms per row; over
    steps it depends on the configuration's other rows (decode/cost/throughput.py ``per_root_best``)."""
    valid = np.isfinite(row_throughput(be, step_ms))
    be = np.where(valid, be, np.nan).astype(np.float64)
    step_ms = np.where(valid, step_ms, np.nan).astype(np.float64)
    if sampling_index is None:
        return per_root_best(be, step_ms, per_step).astype(np.int64)
    chosen = np.zeros(len(be), dtype=np.int64)
    for c in np.unique(sampling_index):
        rows = sampling_index == c
        chosen[rows] = per_root_best(be[rows], step_ms[rows], per_step)
    return chosen


def offline_metrics(
    chosen: np.ndarray,
    be: np.ndarray,
    step_ms: np.ndarray,
    sampling_index: np.ndarray,
    static: np.ndarray | Mapping[int, int],
    per_step: bool = False,
) -> OfflineMetrics:
    """Throughput ratios of ``chosen`` (N,) vs the static baseline and the per-root oracle, per sampling config.

    Args:
        chosen: (N,) action index picked on each root.
        be, step_ms: (N, A) labels; NaN in ``be`` marks an action without a label.
        sampling_index: (N,) sampling configuration of each root.
        static: the static action per row (N,) or per configuration ``{sampling_index: action}``.
        per_step: the roots sample a loop's step starts (``RootArrays.per_step``), else trajectory positions.
    """
    chosen = np.asarray(chosen, dtype=np.int64)
    sampling_index = np.asarray(sampling_index, dtype=np.int64)
    if isinstance(static, Mapping):
        static = np.array([static[int(c)] for c in sampling_index], dtype=np.int64)
    static = np.asarray(static, dtype=np.int64)
    oracle = oracle_actions(be, step_ms, per_step, sampling_index)
    per_config = {}
    for c in np.unique(sampling_index):
        rows = sampling_index == c
        per_config[int(c)] = ConfigMetrics(
            n_rows=int(rows.sum()),
            throughput=stream_throughput(be[rows], step_ms[rows], chosen[rows], per_step),
            static_throughput=stream_throughput(be[rows], step_ms[rows], static[rows], per_step),
            oracle_throughput=stream_throughput(be[rows], step_ms[rows], oracle[rows], per_step),
        )
    if not per_config:
        raise ValueError("no rows to score")
    return OfflineMetrics(per_config=per_config)


# ---------------------------------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window from training
    import matplotlib.pyplot as plt

    return plt


def predicted_vs_true_figure(predicted: np.ndarray, true: np.ndarray, title: str, xlabel: str = "true Ê[τ+1]",
                             ylabel: str = "predicted Ê[τ+1]", max_points: int = 5000, seed: int = 0):
    """Scatter of predicted vs true values (any shapes, flattened; non-finite pairs dropped), with y = x."""
    plt = _pyplot()
    x, y = np.ravel(true).astype(np.float64), np.ravel(predicted).astype(np.float64)
    keep = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if keep.size > max_points:
        keep = np.random.default_rng(seed).choice(keep, max_points, replace=False)
    fig, ax = plt.subplots(figsize=(4.8, 4.4), dpi=100)
    ax.scatter(x[keep], y[keep], s=4, alpha=0.4)
    if keep.size:
        lo, hi = min(x[keep].min(), y[keep].min()), max(x[keep].max(), y[keep].max())
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, ls="--")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    fig.tight_layout()
    return fig


def action_histogram_figure(chosen: np.ndarray, actions: Sequence[str], title: str,
                            oracle: np.ndarray | None = None, top: int = 30):
    """Bar chart of how often each action was chosen (and, if given, was the oracle), most frequent ``top``."""
    plt = _pyplot()
    n = len(actions)
    counts = np.bincount(np.asarray(chosen, dtype=np.int64), minlength=n)
    oracle_counts = np.bincount(np.asarray(oracle, dtype=np.int64), minlength=n) if oracle is not None else None
    ranking = counts + (oracle_counts if oracle_counts is not None else 0)
    shown = [i for i in np.argsort(-ranking, kind="stable")[:top] if ranking[i] > 0]
    fig, ax = plt.subplots(figsize=(max(4.8, 0.28 * len(shown) + 1.5), 3.6), dpi=100)
    pos = np.arange(len(shown))
    width = 0.4 if oracle_counts is not None else 0.8
    ax.bar(pos, counts[shown], width=width, label="chosen")
    if oracle_counts is not None:
        ax.bar(pos + width, oracle_counts[shown], width=width, label="oracle")
        ax.legend()
    ax.set_xticks(pos + (width / 2 if oracle_counts is not None else 0))
    ax.set_xticklabels([actions[i] for i in shown], rotation=90, fontsize=7)
    ax.set(xlabel="action K,L1,L2", ylabel="roots", title=title)
    fig.tight_layout()
    return fig
