"""Traversal verification's exact E[τ+1] for the collector: the same walk as ``TraversalState``, in scalars.

The reference walk (decode/verifiers/traversal.py) keeps updated vocabulary rows per node. Every update at a
node u has the form ``(p_un - c·q_un)_+`` with c ≥ 0, and q_un is the original q row with the rejected
children's tokens zeroed. So a token x that is still drafted at u carries ``(p(x) - C·q(x))_+`` where C is the
sum of the node's c so far, and a token rejected at fold j keeps ``(p(x) - C_j·q(x))_+`` from then on. Each
fold therefore needs one mass, ``Σ_x (p(x) - C·q(x))_+`` corrected on the few rejected tokens, and no row is
ever copied.

Across the action trees of one union sample most folds repeat exactly: a fold is fixed by its node and the
(token, weight) history of the folds before it at that node, and branches of every L2 (and the first branches
of every K) walk the same nodes with the same weights. A per-root cache of folds keyed that way computes each
distinct one once. The trunk above the branch point is folded the same way by every tree: its tail value is
computed once per sample (:class:`UnionTraversal`). Results equal the verifier's own walk up to float rounding
(tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# (node, ((token, w_old), ...) of the node's folds so far, ending with this one) -> (C, residual mass, weight)
FoldCache = dict[tuple[int, tuple[tuple[int, float], ...]], tuple[float, float, float]]


class NodeRows:
    """``float64`` target and draft rows of forest nodes, converted once per root and shared by all trees.

    Args:
        p, q: ``(n, V)`` arrays (any float dtype) indexed by forest node.
    """

    def __init__(self, p: np.ndarray, q: np.ndarray) -> None:
        self.p, self.q = p, q
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.folds: FoldCache = {}

    def rows(self, node: int) -> tuple[np.ndarray, np.ndarray]:
        if node not in self._cache:
            self._cache[node] = (self.p[node].astype(np.float64), self.q[node].astype(np.float64))
        return self._cache[node]

    def ratio(self, node: int, token: int) -> float:
        """``p(token) / q(token)`` at ``node`` under its original rows (0 where q is 0)."""
        p, q = self.rows(node)
        q_t = float(q[token])
        return float(p[token]) / q_t if q_t > 0.0 else 0.0

    def fold(self, node: int, history: tuple[tuple[int, float], ...], state: tuple[float, float, float]):
        """The fold at ``node`` whose history ends with (rejected token, w_old): ``(C, residual mass, weight)``.

        ``state`` is the node's ``(C, p mass, q mass)`` before this fold.
        """
        key = (node, history)
        hit = self.folds.get(key)
        if hit is not None:
            return hit
        c_total, p_mass, q_mass = state
        w_old = history[-1][1]
        p, q = self.rows(node)
        c_new = c_total + p_mass / (w_old * q_mass)
        res_mass = float(np.maximum(p - c_new * q, 0.0).sum())
        for i, (x, _) in enumerate(history[:-1]):  # rejected tokens keep the residual of the fold that removed them
            c_x = self.folds[(node, history[: i + 1])][0]
            res_mass += max(p[x] - c_x * q[x], 0.0) - max(p[x] - c_new * q[x], 0.0)
        slack = res_mass * w_old / p_mass
        weight = min(1.0, slack / (slack + (1.0 - w_old))) if slack > 0.0 else 0.0
        self.folds[key] = (c_new, res_mass, weight)
        return self.folds[key]


def walk_subtree(
    top: int, w_top: float, children: dict[int, list[int]], parents: dict[int, int], depths: dict[int, int],
    tokens: Sequence[int], rows: NodeRows,
) -> tuple[float, float, float]:
    """Traversal's walk below ``top`` until only ``top`` is left.

    Node ids index ``rows``. ``children`` (mutated) lists each node's distinct children in draw order;
    ``w_top`` is top's weight (1 for the root). Returns ``(Σ alive·w·(depth+1) over the leaves tested,
    P(all of them rejected), top's weight after its last fold)``; ``alive`` is 0 when a test is sure.
    """
    ratio = {v: rows.ratio(parents[v], tokens[v]) for v in parents}
    override = {top: w_top}
    history: dict[int, tuple[tuple[int, float], ...]] = {}
    state: dict[int, tuple[float, float, float]] = {}

    def weight(node: int) -> float:
        chain = []
        while node not in override:
            chain.append(node)
            node = parents[node]
        w = override[node]
        for v in reversed(chain):
            w = min(1.0, w * ratio[v])
        return w

    def reject(leaf: int) -> None:
        parent = parents[leaf]
        siblings = children[parent]
        siblings.remove(leaf)
        w_old = weight(parent)
        if w_old == 0.0:  # nothing at or below the parent can be accepted any more
            override[parent] = 0.0
            return
        token = tokens[leaf]
        history[parent] = history.get(parent, ()) + ((token, w_old),)
        before = state.get(parent, (0.0, 1.0, 1.0))
        c_new, res_mass, override[parent] = rows.fold(parent, history[parent], before)
        p, q = rows.rows(parent)
        q_mass = before[2] - float(q[token])
        state[parent] = (c_new, res_mass, q_mass)
        for child in siblings:  # the parent's rows changed, so its remaining children's ratios did
            t = tokens[child]
            q_t = float(q[t]) / q_mass if q_mass > 0.0 else 0.0
            p_t = max(float(p[t]) - c_new * float(q[t]), 0.0) / res_mass if res_mass > 0.0 else 0.0
            ratio[child] = p_t / q_t if q_t > 0.0 else 0.0

    total, alive = 0.0, 1.0
    while True:
        leaf = top
        while children[leaf]:
            leaf = children[leaf][0]
        if leaf == top:
            return total, alive, override[top]
        w = weight(leaf)
        total += alive * w * (depths[leaf] + 1)
        alive *= 1.0 - w
        if alive == 0.0:
            return total, 0.0, override[top]
        reject(leaf)


class UnionTraversal:
    """E[τ+1] of every delayed tree of one union sample under Traversal, sharing the trunk's work.

    Args:
        trunk: forest nodes at trunk depth 0..2·L_max; ``branches[d][b]`` the L_max nodes of branch b at depth d.
        tokens: the forest's token per node.
    """

    def __init__(self, trunk: list[int], branches: list[list[list[int]]], tokens: Sequence[int], rows: NodeRows):
        self.trunk, self.branches, self.tokens, self.rows = trunk, branches, tokens, rows
        # w[d]: the trunk node's weight at depth d before any rejection (clipped running product of ratios).
        self.w = [1.0]
        for d in range(1, len(trunk)):
            self.w.append(min(1.0, self.w[-1] * rows.ratio(trunk[d - 1], tokens[trunk[d]])))
        # tail[d]: E[τ+1] contributed once trunk node d is a leaf that was folded into by its only child
        # (weight h[d]); tail[0] = 1: the root is reached and emits one token.
        self.tail = [1.0]
        for d in range(1, len(trunk)):
            h = self._trunk_fold(d - 1)
            self.tail.append(h * d + (1.0 - h) * self.tail[-1])

    def _trunk_fold(self, d: int) -> float:
        """Weight of trunk node d after its only child was rejected (0 if it could not be accepted)."""
        if self.w[d] == 0.0:
            return 0.0
        node = self.trunk[d]
        return self.rows.fold(node, ((self.tokens[self.trunk[d + 1]], self.w[d]),), (0.0, 1.0, 1.0))[2]

    def expected(self, k: int, l1: int, l2: int) -> float:
        if k == 1 or l2 == 0:  # a single path of length L = l1 + l2: test its end, then fold up the trunk
            length = l1 + l2
            if length == 0:
                return 1.0
            w = self.w[length]
            return w * (length + 1) + (1.0 - w) * self.tail[length]
        tip = self.trunk[l1]
        children: dict[int, list[int]] = {tip: []}
        parents: dict[int, int] = {}
        depths = {tip: l1}
        for branch in self.branches[l1][:k]:
            previous = tip
            for v in branch[:l2]:
                if v not in parents:
                    parents[v] = previous
                    children[previous].append(v)
                    children[v] = []
                    depths[v] = depths[previous] + 1
                previous = v
        total, alive, h = walk_subtree(tip, self.w[l1], children, parents, depths, self.tokens, self.rows)
        if l1 == 0:
            return total + alive
        return total + alive * (h * (l1 + 1) + (1.0 - h) * self.tail[l1])
