"""Step pricing on a latency table (decode/cost/table.py): what a set of trees costs, as the loops run them.

:func:`mean_step_ms` is T̂ of each action averaged over context lengths (a policy file's profiles price their trees
with it on the running machine). :func:`passes_ms` prices one batch step from its passes and :func:`step_ms` one batch
step of chains beside other requests' trees:

    T = c(l) + t_q(l, R) + Σ_{j ≥ 1} t_q(l + j, n_j) + t_p(l, Σ_r (1 + L_r))

at the batch's mean context length l: the draft pass over the R requests' pending tokens, one draft pass per level j
over the n_j nodes the trees run there (a chain of L runs L − 1, its last token a leaf), and one target pass over
every root and node. Each pass runs through the batch's one cache of R requests, which costs more than the table's
one-sequence pass of as many tokens (every query attends over every request's slots, masked), so t_q and t_p are the
table's times its measured batch ratios at R (``LatencyTable.batch_draft``, ``batch_target``;
:class:`~decode.cost.table.BatchCost`). R = 1 is the single loop's step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from decode.cost.table import LatencyTable, draft_passes
from decode.drafting.actions import Action


def mean_step_ms(table: LatencyTable, lengths: Sequence[int], actions: Sequence[Action]) -> np.ndarray:
    """``(A,)`` T̂ of each action averaged over ``lengths`` under ``table``."""
    passes = draft_passes(list(actions))
    return np.mean([table.step_ms_many(int(length), passes) for length in lengths], axis=0)


def step_ms(lengths: Sequence[int], length: float, table: LatencyTable, fixed: Sequence[Action] = ()) -> float:
    """T of one batch step in ms: chains of ``lengths`` beside the trees ``fixed``, at context ``length``.

    Every pass runs through the batch's one cache, which holds all R requests however few of them a draft level
    runs, so each is priced as a pass beside R requests (:meth:`~decode.cost.table.LatencyTable.batch_draft`:
    the one-sequence time times the table's measured batch ratio; R = 1 is the single loop's step)."""
    widths = [[1] * n for n in lengths] + [[1] * a.l1 + [a.k] * a.l2 for a in fixed]
    runs = [w[:-1] for w in widths]  # the draft runs every level but the last (leaves)
    levels = max((len(w) for w in runs), default=0)
    level_rows = [sum(w[j] for w in runs if len(w) > j) for j in range(levels)]
    return passes_ms(len(widths), level_rows, sum(1 + sum(w) for w in widths), length, table)


def passes_ms(requests: int, level_rows: Sequence[int], target_rows: int, length: float, table: LatencyTable) -> float:
    """T of one batch step of ``requests`` requests in ms from its passes, at context ``length``: the per-step term,
    the draft pass over every request's pending token, one draft pass per drafting level j over ``level_rows[j]``
    nodes (none where 0), and one target pass over ``target_rows`` tokens (every root and node), each priced beside
    ``requests`` requests of one cache."""
    drafting = sum(table.batch_draft(length + j + 1, rows, requests) for j, rows in enumerate(level_rows) if rows)
    return table.step_extra(length) + table.batch_draft(length, requests, requests) + drafting + \
        table.batch_target(length, target_rows, requests)
