"""The never-lose guard: leave the fallback (best static) action only where the predicted gain clears a margin.

A selector's decision value for an action is its score (``policy``) or its predicted Ê over T̂ (``be``). The
guarded rule drafts the best-valued action only where ``value[best] > (1 + margin) · value[fallback]`` and the
fallback elsewhere. Per sampling configuration, the margin is fitted on VALIDATION prompts (never on the roots a
figure is scored on): the margin of the grid whose guarded rule has the highest stream throughput there. If even
that rule does not beat the fallback by ``min_gain`` (default 2.5 %: what the policy phase costs in the loop), the
margin is ``None`` and the decoder drafts the fallback without running the selector at all, so the shipped policy
is then exactly the static one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decode.cost.throughput import stream_throughput

MARGINS = (0.0, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
# What the policy phase (root features, the network call, the decision) costs in the loop where a guard lets the
# network decide (docs/selector.md, "The never-lose guard"); a validation gain below that cannot pay for it.
MIN_GAIN = 0.025


def decision_values(scores: np.ndarray, step_ms: np.ndarray, valid: np.ndarray, decision: str) -> np.ndarray:
    """``(N, A)`` decision value of every action: scores (``argmax``) or scores / step_ms (``throughput``); -inf
    where the action has no label."""
    value = scores / np.where(valid, step_ms, 1.0) if decision == "throughput" else scores.astype(np.float64)
    return np.where(valid, value, -np.inf)


def guarded_choice(value: np.ndarray, fallback: np.ndarray, margin: float | None) -> np.ndarray:
    """``(N,)`` the guarded decision: argmax of ``value`` where it beats ``fallback`` ``(N,)`` by the margin."""
    if margin is None:
        return fallback.astype(np.int64)
    best = np.argmax(value, axis=1)
    rows = np.arange(len(value))
    leave = value[rows, best] > (1.0 + margin) * value[rows, fallback]
    return np.where(leave, best, fallback).astype(np.int64)


@dataclass
class MarginFit:
    """The fitted guard of one sampling configuration and the validation curve behind it.

    Attributes:
        margin: the chosen margin, or None (never leave the fallback).
        curve: (margin, validation throughput ratio vs the fallback, share of roots that leave it) per grid point.
    """

    margin: float | None
    curve: list[tuple[float, float, float]]

    @property
    def best_ratio(self) -> float:
        return max(ratio for _, ratio, _ in self.curve)


def fit_margin(value: np.ndarray, be: np.ndarray, step_ms: np.ndarray, fallback: int,
               margins: tuple[float, ...] = MARGINS, min_gain: float = MIN_GAIN, per_step: bool = False) -> MarginFit:
    """The margin of one sampling configuration, from its validation roots.

    Args:
        value: ``(N, A)`` decision values (:func:`decision_values`) on validation roots.
        be, step_ms: ``(N, A)`` their labels (NaN be: no label).
        fallback: the configuration's fallback action index (best static on the training split).
        per_step: the roots sample a loop's step starts, else trajectory positions: how the stream throughput
            reads them (decode/cost/throughput.py).
    """
    rows = np.full(len(value), fallback, dtype=np.int64)
    static = stream_throughput(be, step_ms, rows, per_step)
    curve = []
    for margin in margins:
        chosen = guarded_choice(value, rows, margin)
        ratio = stream_throughput(be, step_ms, chosen, per_step) / static
        curve.append((float(margin), float(ratio), float(np.mean(chosen != fallback))))
    best_margin, best_ratio, _ = max(curve, key=lambda point: (point[1], point[0]))
    return MarginFit(best_margin if best_ratio >= 1.0 + min_gain else None, curve)


def margin_figure(fits: dict[int, MarginFit], labels: list[str], verifier: str = ""):
    """Validation throughput ratio vs the fallback against the margin, one line per sampling configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.8), dpi=100)
    for c, fit in fits.items():
        if not fit.curve:
            continue
        margins, ratios, _ = zip(*fit.curve, strict=True)
        chosen = "never leaves the fallback" if fit.margin is None else f"margin {fit.margin:g}"
        ax.plot(range(len(margins)), ratios, marker="o", label=f"{labels[c]}: {chosen}")
        ax.set_xticks(range(len(margins)), [f"{m:g}" for m in margins], rotation=60, fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.axhline(1.0 + MIN_GAIN, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="margin (relative predicted gain needed to leave the fallback)",
           ylabel="validation throughput / fallback",
           title=f"{verifier + ': ' if verifier else ''}never-lose guard, margin on validation prompts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
