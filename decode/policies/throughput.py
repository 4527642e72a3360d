"""The decoding throughput that labelled roots predict: the one estimator behind every offline figure.

The collector samples roots at evenly spaced token positions of target trajectories (every ``stride`` tokens). The
decoding loop does not: it starts each step where the last one ended, so it takes more steps per token where
acceptance is low. Over a stream whose positions look like the sampled roots, a rule that drafts ``chosen[i]`` at
root i emits tokens at the rate

    TP(chosen) = N / Σ_i T̂[i, chosen_i] / Ê[i, chosen_i]        (tokens per ms)

the inverse of the time per token averaged over positions; its tokens per step is the harmonic mean of Ê over
positions. The ratio of sums Σ Ê / Σ T̂ would count every root as one step and overrate actions whose Ê varies much
from root to root, long chains above all. On the shipped pair's default collection the ratio of sums put (1,0,7)
1.28× above (1,0,3) in tokens per step; the decoding loop measured 1.16–1.22× and this estimator gives 1.20–1.21×.
On the Qwen2.5-Coder pair it does not hold: on the bench's own prompts it reads the loop's tokens per step 24 % low
and 35 % low for a 4-token trunk, where an arithmetic mean with each trajectory's first root weighted as one step of
a generation reads 7.6 % low (docs/selector.md): Ê there varies from token to token more than from region to region,
so the loop does not linger where Ê is low.

Because TP is a sum of per-root terms, the per-root argmax of Ê / T̂ is also the stream optimum: no rule beats the
per-root oracle.
"""

from __future__ import annotations

import numpy as np


def time_per_token(be: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``step / be`` elementwise (ms per token), NaN where ``be`` has no label; ValueError for Ê < 1 (E[τ+1] >= 1)."""
    labelled = np.isfinite(be)
    if (be[labelled] < 1.0 - 1e-9).any():
        raise ValueError("an expected block efficiency below 1: labels are E[τ+1] >= 1")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(labelled, step / np.where(labelled, be, 1.0), np.nan)


def stream_throughput(be: np.ndarray, step: np.ndarray, chosen: np.ndarray) -> float:
    """TP of a rule that picks ``chosen`` ``(N,)`` on roots with labels ``be`` and step times ``step`` ``(N, A)``.

    Raises ValueError if a chosen action has no label (NaN): invalid actions must be masked before choosing.
    """
    rows = np.arange(len(chosen))
    picked_be, picked_step = be[rows, chosen], step[rows, chosen]
    if not (np.isfinite(picked_be).all() and np.isfinite(picked_step).all()):
        raise ValueError("a chosen action has no label (NaN): invalid actions must be masked before choosing")
    return float(len(chosen) / time_per_token(picked_be, picked_step).sum())


def static_throughputs(be: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``(A,)`` TP of every action used at every root; -inf for an action without a label on some root."""
    per_root = time_per_token(be, step)
    usable = np.isfinite(per_root).all(axis=0)
    total = np.where(usable, np.nan_to_num(per_root).sum(axis=0), 1.0)
    return np.where(usable, len(be) / total, -np.inf)


def best_static(be: np.ndarray, step: np.ndarray) -> int:
    """Index of the action with the highest TP, among actions labelled on every root."""
    throughput = static_throughputs(be, step)
    if not np.isfinite(throughput).any():
        raise ValueError("no action has a label on every root")
    return int(np.argmax(throughput))


def harmonic_block_efficiency(be: np.ndarray) -> float:
    """The tokens per step the loop makes with one action whose per-root Ê is ``be`` ``(N,)``: N / Σ 1/Ê."""
    return float(len(be) / (1.0 / be).sum())
