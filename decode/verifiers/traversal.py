"""Traversal verification (Weng et al., NeurIPS 2025; rule as in algorithms.md §2.9).

Bottom-up and sequence-level: test the first leaf in DFS order with its clipped path weight w; accept the
whole root-to-leaf sequence, or delete the leaf and fold the rejection into its parent (BV's residual for
p, and the sibling-removal update that zeroes the rejected token in q). A single path reduces to BV.

The test sequence is deterministic given the tree; only the accept/reject coins are random. So the exact
expectation (:func:`expected_walk`) walks the same sequence with every coin rejected and weights each test by the
probability of getting there. The walk runs on either of two states with the same three methods:

* :class:`TraversalState` keeps updated vocabulary rows per node (the verifier's own, and the one sampling needs);
* :class:`FoldState` keeps scalars only, for data collection, which walks thousands of trees per root. Every update
  at a node u has the form ``(p_un - c·q_un)_+`` with c ≥ 0, and q_un is the original q row with the rejected
  children's tokens zeroed. So a token x still drafted at u carries ``(p(x) - C·q(x))_+``, C the sum of the node's
  c so far, and a token rejected at fold j keeps ``(p(x) - C_j·q(x))_+``: each fold needs one mass, corrected on
  the few rejected tokens, and no row is copied. A fold is fixed by its node and the (token, weight) history of the
  folds before it there, so :class:`NodeRows` caches folds across the trees of one root.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from decode.drafting.tree import ROOT, DraftTree, Regime
from decode.verifiers.base import LabelRule, Verifier, make_result
from decode.verifiers.otlp import as_index, sample_residual


def clipped_weight(node: int, override: dict[int, float], parents, ratio) -> float:
    """w(node) = min(1, w(parent) · ratio[node]), restarting from the nearest ancestor whose weight a rejection
    below it reset (``override``); ``parents`` and ``ratio`` are indexed by node."""
    chain = []
    while node not in override:
        chain.append(node)
        node = parents[node]
    w = override[node]
    for v in reversed(chain):
        w = min(1.0, w * ratio[v])
    return w


class TraversalState:
    """Mutable state of one traversal: remaining children, updated rows and overridden weights.

    Updated rows are kept unnormalised with their masses (row / mass is the distribution). A rejection then
    costs one fused residual, one sum and one clone over the vocabulary, and no normalisation pass.
    """

    def __init__(self, tree: DraftTree, p: torch.Tensor, q: torch.Tensor) -> None:
        self.tree = tree
        self.p, self.q = p, q
        self.p_rows: dict[int, tuple[torch.Tensor, float]] = {}  # node -> (unnormalised row, mass)
        self.q_rows: dict[int, tuple[torch.Tensor, float]] = {}
        self.remaining = [list(c) for c in tree.children]
        parents, tokens = as_index(tree.parents[1:]), as_index(tree.tokens[1:])
        p_tok, q_tok = p[parents, tokens].tolist(), q[parents, tokens].tolist()
        # ratio[v] = p_parent(t_v) / q_parent(t_v) under the parent's current rows.
        self.ratio = [1.0] + [a / b if b > 0.0 else 0.0 for a, b in zip(p_tok, q_tok, strict=True)]
        self.override: dict[int, float] = {ROOT: 1.0}  # nodes whose weight was reset by a rejection below
        self.top = ROOT

    def depth(self, node: int) -> int:
        return self.tree.depths[node]

    def p_row(self, node: int) -> torch.Tensor:
        """Target row at ``node`` (unnormalised after an update); for sampling."""
        return self.p_rows[node][0] if node in self.p_rows else self.p[node]

    def first_leaf(self) -> int:
        node = ROOT
        while self.remaining[node]:
            node = self.remaining[node][0]
        return node

    def weight(self, node: int) -> float:
        return clipped_weight(node, self.override, self.tree.parents, self.ratio)

    def reject(self, leaf: int) -> None:
        parent = self.tree.parents[leaf]
        self.remaining[parent].remove(leaf)
        w_old = self.weight(parent)
        if w_old == 0.0:
            # The parent can no longer be accepted, nor can anything below it: its rows no longer matter.
            self.override[parent] = 0.0
            return
        p_un, p_mass = self.p_rows.get(parent, (self.p[parent], 1.0))
        q_un, q_mass = self.q_rows.get(parent, (self.q[parent], 1.0))
        # (w·p - q)_+ = (w / p_mass) · (p_un - c·q_un)_+ with c = p_mass / (w · q_mass).
        res = torch.add(p_un, q_un, alpha=-p_mass / (w_old * q_mass)).clamp_min_(0.0)
        res_mass = float(res.sum())
        slack = res_mass * w_old / p_mass
        # BV's acceptance of the parent prefix; clamped because rounding can push it a hair above 1.
        self.override[parent] = min(1.0, slack / (slack + (1.0 - w_old))) if slack > 0.0 else 0.0
        self.p_rows[parent] = (res, res_mass)
        self.q_rows[parent] = self._remove_token(q_un, q_mass, self.tree.tokens[leaf])
        # The parent's rows changed, so its remaining children's ratios change; deeper ones do not.
        p_new, p_total = self.p_rows[parent]
        q_new, q_total = self.q_rows[parent]
        for child in self.remaining[parent]:
            t = self.tree.tokens[child]
            q_t = float(q_new[t]) / q_total if q_total > 0.0 else 0.0
            p_t = float(p_new[t]) / p_total if p_total > 0.0 else 0.0
            self.ratio[child] = p_t / q_t if q_t > 0.0 else 0.0

    def _remove_token(self, q_un: torch.Tensor, q_mass: float, token: int) -> tuple[torch.Tensor, float]:
        """The draft at the parent after a rejection: the rejected sibling's token removed (renormalised)."""
        removed = float(q_un[token])
        q_new = q_un.clone()
        q_new[token] = 0.0
        return q_new, q_mass - removed


class TraversalVerifier(Verifier):
    """Traversal verification on i.i.d. (distinct children used) and without-replacement trees."""

    name = "traversal"
    label_rule = LabelRule.TRAVERSAL
    regime_help = "i.i.d. trees (incl. delayed) and without-replacement trees"
    state_cls = TraversalState

    def supports(self, tree):
        return tree.regime in (Regime.IID, Regime.WITHOUT_REPLACEMENT)

    def _verify(self, tree, p, q, rng):
        state = self.state_cls(tree, p, q)
        while True:
            leaf = state.first_leaf()
            if leaf == ROOT or rng.bernoulli(state.weight(leaf)):
                return make_result(tree, leaf, sample_residual(rng, state.p_row(leaf), p[leaf]))
            state.reject(leaf)

    def _expected(self, tree, p, q):
        total, alive = expected_walk(self.state_cls(tree, p, q))
        return total + alive


def expected_walk(state: TraversalState | FoldState) -> tuple[float, float]:
    """Walk below ``state.top`` until only the top is left, every test rejected.

    Returns ``(Σ alive·w·(depth + 1) over the leaves tested, P(all of them rejected))``; ``alive`` is the
    probability of reaching a test. The top's weight after its last fold is then ``state.override[state.top]``.
    """
    total, alive = 0.0, 1.0
    while True:
        leaf = state.first_leaf()
        if leaf == state.top:
            return total, alive
        w = state.weight(leaf)
        total += alive * w * (state.depth(leaf) + 1)
        alive *= 1.0 - w
        if alive == 0.0:
            return total, 0.0
        state.reject(leaf)


# (node, ((token, w_old), ...) of the node's folds so far, ending with this one) -> (C, residual mass, weight)
FoldCache = dict[tuple[int, tuple[tuple[int, float], ...]], tuple[float, float, float]]


class NodeRows:
    """``float64`` target and draft rows of nodes (e.g. a union forest's), converted once and shared by every walk
    over them, with the cache of folds.

    Args:
        p, q: ``(n, V)`` arrays (any float dtype) indexed by node.
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


class FoldState:
    """The walk's state in scalars, below ``top`` (weight ``w_top``), over nodes indexing ``rows``.

    Args:
        children: each node's distinct children in draw order (mutated by the walk).
        parents, depths: of every node below the top.
        tokens: token per node id.
    """

    def __init__(self, top: int, w_top: float, children: dict[int, list[int]], parents: dict[int, int],
                 depths: dict[int, int], tokens: Sequence[int], rows: NodeRows) -> None:
        self.top, self.children, self.parents, self.depths = top, children, parents, depths
        self.tokens, self.rows = tokens, rows
        self.ratio = {v: rows.ratio(parents[v], tokens[v]) for v in parents}
        self.override = {top: w_top}
        self.history: dict[int, tuple[tuple[int, float], ...]] = {}
        self.state: dict[int, tuple[float, float, float]] = {}  # node -> (C, p mass, q mass) after its folds

    def depth(self, node: int) -> int:
        return self.depths[node]

    def first_leaf(self) -> int:
        leaf = self.top
        while self.children[leaf]:
            leaf = self.children[leaf][0]
        return leaf

    def weight(self, node: int) -> float:
        return clipped_weight(node, self.override, self.parents, self.ratio)

    def reject(self, leaf: int) -> None:
        parent = self.parents[leaf]
        siblings = self.children[parent]
        siblings.remove(leaf)
        w_old = self.weight(parent)
        if w_old == 0.0:  # nothing at or below the parent can be accepted any more
            self.override[parent] = 0.0
            return
        token = self.tokens[leaf]
        self.history[parent] = self.history.get(parent, ()) + ((token, w_old),)
        before = self.state.get(parent, (0.0, 1.0, 1.0))
        c_new, res_mass, self.override[parent] = self.rows.fold(parent, self.history[parent], before)
        p, q = self.rows.rows(parent)
        q_mass = before[2] - float(q[token])
        self.state[parent] = (c_new, res_mass, q_mass)
        for child in siblings:  # the parent's rows changed, so its remaining children's ratios did
            t = self.tokens[child]
            q_t = float(q[t]) / q_mass if q_mass > 0.0 else 0.0
            p_t = max(float(p[t]) - c_new * float(q[t]), 0.0) / res_mass if res_mass > 0.0 else 0.0
            self.ratio[child] = p_t / q_t if q_t > 0.0 else 0.0
