"""Traversal verification (Weng et al., NeurIPS 2025; rule as in algorithms.md §2.9).

Bottom-up and sequence-level: test the first leaf in DFS order with its clipped path weight w; accept the
whole root-to-leaf sequence, or delete the leaf and fold the rejection into its parent (BV's residual for
p, and the sibling-removal update that zeroes the rejected token in q). A single path reduces to BV.

The test sequence is deterministic given the tree; only the accept/reject coins are random. So the exact
expectation walks the same sequence with every coin rejected and weights each test by the probability of
getting there.
"""

from __future__ import annotations

import torch

from decode.tree import ROOT, DraftTree, Regime
from decode.verifiers.base import Verifier, make_result, register
from decode.verifiers.otlp import as_index, sample_residual


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

    def p_row(self, node: int) -> torch.Tensor:
        """Target row at ``node`` (unnormalised after an update); for sampling."""
        return self.p_rows[node][0] if node in self.p_rows else self.p[node]

    def first_leaf(self) -> int:
        node = ROOT
        while self.remaining[node]:
            node = self.remaining[node][0]
        return node

    def weight(self, node: int) -> float:
        """w(node) = min(1, w(parent) · ratio), restarting from the nearest overridden ancestor."""
        chain = []
        while node not in self.override:
            chain.append(node)
            node = self.tree.parents[node]
        w = self.override[node]
        for v in reversed(chain):
            w = min(1.0, w * self.ratio[v])
        return w

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


@register
class TraversalVerifier(Verifier):
    """Traversal verification on i.i.d. (distinct children used) and without-replacement trees."""

    name = "traversal"
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
        state = self.state_cls(tree, p, q)
        total, alive = 0.0, 1.0
        while True:
            leaf = state.first_leaf()
            if leaf == ROOT:
                return total + alive
            w = state.weight(leaf)
            total += alive * w * (tree.depths[leaf] + 1)
            alive *= 1.0 - w
            if alive == 0.0:
                return total
            state.reject(leaf)
