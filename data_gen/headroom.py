"""How much a per-root choice could win over the best static action, measured honestly (cross-fitted).

Each root r has, per sampled union tree t, the exact Ê[τ+1] of every action a: ``be[r, t, a]``, and the step time
``step[r, a]``. A rule that picks ``chosen[r]`` has the stream throughput of ``decode/cost/throughput.py``, which
reads the roots as the collection placed them (``per_step``: roots at a loop's step starts, Σ Ê / Σ T̂; else at
trajectory positions, N / Σ_r step[r, chosen_r] / be[r, chosen_r]).

* **best static**: the one action with the highest stream throughput over the roots.
* **same-tree oracle** (biased): the per-root choice with the highest stream throughput on the mean-over-trees
  labels (:func:`~decode.cost.throughput.per_root_best`), scored on the same trees. It is the maximum of ~324
  noisy estimates per root, so it reads high even when every root has the same best action.
* **cross-fitted oracle**: choose per root on one half of the trees, score on the other half, both ways, averaged.
  The choice never sees the trees it is scored on, so noise cannot inflate it. The static baseline of each half is
  chosen on the other half the same way.
* **per-prompt static, cross-fitted**: one action per prompt, chosen and scored the same cross-fitted way.
* **per-group static, cross-fitted**: one action per group of prompts (a workload's categories: code, writing, ...),
  chosen and scored the same way: what a selector that only knew the task could win.

Every figure is a ratio to the best static action scored on the same trees. Roots need at least two trees for the
cross-fitted figures (a schema-1 data set keeps only the mean: they are then unavailable, and say so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from decode.cost.throughput import best_static, per_root_best, stream_throughput


def per_group_static(be: np.ndarray, step: np.ndarray, groups: np.ndarray, per_step: bool = False) -> np.ndarray:
    """``(N,)`` each root's group's best static action (e.g. one action per prompt)."""
    chosen = np.zeros(len(be), dtype=np.int64)
    for g in np.unique(groups):
        rows = groups == g
        chosen[rows] = best_static(be[rows], step[rows], per_step)
    return chosen


@dataclass(frozen=True)
class HeadRoom:
    """Throughput ratios to the best static action (see the module docstring); None where unavailable."""

    roots: int
    trees: int
    best_static: int
    same_tree_oracle: float
    cross_fitted_oracle: float | None
    cross_fitted_prompt_static: float | None
    cross_fitted_group_static: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def head_room(be_trees: np.ndarray | None, be_mean: np.ndarray, step: np.ndarray, prompts: np.ndarray,
              groups: np.ndarray | None = None, per_step: bool = False) -> HeadRoom:
    """All the figures for one set of roots (one verifier, one sampling configuration).

    Args:
        be_trees: ``(N, s, A)`` per-tree labels, or None (a schema-1 data set: means only).
        be_mean: ``(N, A)`` the mean over trees (NaN: no label).
        step: ``(N, A)`` step times.
        prompts: ``(N,)`` prompt id of each root.
        groups: ``(N,)`` each root's prompt group (category), or None.
        per_step: the roots sample a decoding loop's step starts (the collection's ``roots: steps``), else
            trajectory positions: how a root stands for the stream (decode/cost/throughput.py).
    """
    def rate(be: np.ndarray, chosen: np.ndarray) -> float:
        return stream_throughput(be, step, chosen, per_step)

    static = best_static(be_mean, step, per_step)
    base = rate(be_mean, np.full(len(be_mean), static))
    same = rate(be_mean, per_root_best(be_mean, step, per_step)) / base
    trees = 1 if be_trees is None else be_trees.shape[1]
    if be_trees is None or trees < 2:
        return HeadRoom(len(be_mean), trees, static, same, None, None)
    half = trees // 2
    first, second = be_trees[:, :half].mean(axis=1), be_trees[:, half : 2 * half].mean(axis=1)
    oracle, prompt_static, group_static = [], [], []
    for choose_on, score_on in ((first, second), (second, first)):
        reference = rate(score_on, np.full(len(be_mean), best_static(choose_on, step, per_step)))
        oracle.append(rate(score_on, per_root_best(choose_on, step, per_step)) / reference)
        prompt_static.append(rate(score_on, per_group_static(choose_on, step, prompts, per_step)) / reference)
        if groups is not None:
            group_static.append(rate(score_on, per_group_static(choose_on, step, groups, per_step)) / reference)
    return HeadRoom(len(be_mean), trees, static, same, float(np.mean(oracle)), float(np.mean(prompt_static)),
                    float(np.mean(group_static)) if group_static else None)
