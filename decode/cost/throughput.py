"""The decoding throughput that labelled roots predict: the one estimator behind every offline figure.

A rule that drafts ``chosen[i]`` at root i is scored by the tokens per ms of a stream whose steps look like the roots.
How a root stands for the stream depends on where the collector put it (``dataset.json``'s ``roots``):

- **steps**: roots at a uniform sample of a reference loop's step starts (data_gen/collector.py). Each root is one
  step, so TP = Σ_i Ê[i, chosen_i] / Σ_i T̂[i, chosen_i], tokens over time: exact for the reference loop, and for
  another tree as far as that tree's loop starts its steps where the reference's does.
- **positions**: roots every ``stride`` tokens of a target trajectory. Each root stands for as many tokens, which
  the loop crosses in about stride / Ê steps: TP = N / Σ_i T̂[i, chosen_i] / Ê[i, chosen_i], the inverse of the time
  per token averaged over positions.

Over step roots the plain mean of Ê tracks the loop's tokens per step closely; the harmonic form, and either form over
position roots, read it lower (results/NOTEBOOK.md, "Where the offline estimator's roots stand"). The loop starts its
steps right after the tokens the target drew, where the next token is seldom hard, so a uniform sample of positions is
not what it meets.

Either way TP is a ratio of sums of per-root terms (:func:`stream_terms`: tokens and ms). Over position roots the
per-root argmax of Ê / T̂ is the stream optimum; over step roots the optimum maximises Σ Ê / Σ T̂, where a root may
rather take a slower, longer action: the argmax of Ê − λ T̂ at the optimal rate λ (:func:`per_root_best`). No rule
beats that per-root oracle.
"""

from __future__ import annotations

import numpy as np

# where a collection puts its roots (dataset.json's "roots"; a folder written before the key: positions)
ROOT_PLACEMENTS = ("positions", "steps")


def time_per_token(be: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``step / be`` elementwise (ms per token), NaN where ``be`` has no label; ValueError for Ê < 1 (E[τ+1] >= 1)."""
    labelled = np.isfinite(be)
    if (be[labelled] < 1.0 - 1e-9).any():
        raise ValueError("an expected block efficiency below 1: labels are E[τ+1] >= 1")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(labelled, step / np.where(labelled, be, 1.0), np.nan)


def stream_terms(be: np.ndarray, step: np.ndarray, per_step: bool) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, ms) each root adds to the stream, elementwise over ``be`` and ``step`` (any equal shapes): per-step
    roots (Ê, T̂); position roots (1, T̂ / Ê). NaN where ``be`` has no label; ValueError for Ê < 1."""
    ms_per_token = time_per_token(be, step)
    if per_step:
        return np.where(np.isfinite(ms_per_token), be, np.nan), np.where(np.isfinite(ms_per_token), step, np.nan)
    return np.where(np.isfinite(ms_per_token), 1.0, np.nan), ms_per_token


def stream_throughput(be: np.ndarray, step: np.ndarray, chosen: np.ndarray, per_step: bool = False) -> float:
    """TP of a rule that picks ``chosen`` ``(N,)`` on roots with labels ``be`` and step times ``step`` ``(N, A)``.

    Raises ValueError if a chosen action has no label (NaN): invalid actions must be masked before choosing.
    """
    rows = np.arange(len(chosen))
    picked_be, picked_step = be[rows, chosen], step[rows, chosen]
    if not (np.isfinite(picked_be).all() and np.isfinite(picked_step).all()):
        raise ValueError("a chosen action has no label (NaN): invalid actions must be masked before choosing")
    tokens, ms = stream_terms(picked_be, picked_step, per_step)
    return float(tokens.sum() / ms.sum())


def static_throughputs(be: np.ndarray, step: np.ndarray, per_step: bool = False) -> np.ndarray:
    """``(A,)`` TP of every action used at every root; -inf for an action without a label on some root."""
    tokens, ms = stream_terms(be, step, per_step)
    usable = np.isfinite(ms).all(axis=0)
    total = np.where(usable, np.nan_to_num(ms).sum(axis=0), 1.0)
    return np.where(usable, np.nan_to_num(tokens).sum(axis=0) / total, -np.inf)


def best_static(be: np.ndarray, step: np.ndarray, per_step: bool = False) -> int:
    """Index of the action with the highest TP, among actions labelled on every root."""
    throughput = static_throughputs(be, step, per_step)
    if not np.isfinite(throughput).any():
        raise ValueError("no action has a label on every root")
    return int(np.argmax(throughput))


def per_root_best(be: np.ndarray, step: np.ndarray, per_step: bool = False) -> np.ndarray:
    """``(N,)`` the action of each root that together maximise the stream throughput, among labelled actions of
    ``be``, ``step`` ``(N, A)``: the argmax of Ê / T̂ for position roots; for step roots Dinkelbach's iteration on
    Σ Ê / Σ T̂ (argmax Ê − λ T̂, λ the rate of the last choice), which never lowers the rate and stops where the
    choice repeats."""
    labelled = np.isfinite(be) & np.isfinite(step)
    chosen = np.argmax(np.where(labelled, be / np.where(labelled, step, 1.0), -np.inf), axis=1)
    if not per_step:
        return chosen
    rows = np.arange(len(be))
    for _ in range(100):
        rate = be[rows, chosen].sum() / step[rows, chosen].sum()
        better = np.argmax(np.where(labelled, be - rate * np.where(labelled, step, 0.0), -np.inf), axis=1)
        if np.array_equal(better, chosen):
            break
        chosen = better
    return chosen


def block_efficiency(be: np.ndarray, per_step: bool = False) -> float | np.ndarray:
    """The tokens per step the loop makes with an action whose per-root Ê is ``be`` ``(N, ...)``, over axis 0: the
    mean over step roots, N / Σ 1/Ê over position roots (a float for ``(N,)``, else one value per column)."""
    out = be.mean(axis=0) if per_step else len(be) / (1.0 / be).sum(axis=0)
    return float(out) if np.ndim(out) == 0 else out

