"""Block verification on a single drafted path (Sun et al., ICLR 2025; algorithms.md §2.3).

Given the path x_1..x_L and full p, q at its nodes, the clipped running weights
``w_i = min(1, w_{i-1} p(x_i)/q(x_i))`` define per-prefix acceptance probabilities
``h_i = S_i / (S_i + 1 - w_i)`` (``h_L = w_L``), ``S_i = Σ_x (w_i p_i(x) - q_i(x))_+``; the accepted length is
the largest i whose independent Bernoulli(h_i) succeeds. GBV reuses this with a skewed draft q̃.

The weights need only the drafted tokens' probabilities. The full-vector sums S_i are computed lazily: a sampled
round scans i = L, L-1, ... and stops at the first success, so it computes S_i only for the prefixes it tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decode.drafting.rng import RandomSource
from decode.drafting.tree import ROOT, DraftTree, Regime
from decode.verifiers.base import Verifier, make_result
from decode.verifiers.otlp import as_index, residual, sample_residual

RowFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class BlockPlan:
    """BV on one path with lazily computed acceptance probabilities.

    Args:
        p_tok: p_{i-1}(x_i) for i = 1..L (target probability of each drafted token at its parent).
        q_tok: the draft's probability of the same tokens (q̃ for GBV).
        rows: ``rows(i) -> (p_i, q_i)``, the full ``(V,)`` distributions after x_{<=i}, i = 0..L
            (q_L is never read).
        slack: optional ``slack(i, w_i) -> S_i``, for callers that cache the sums across paths; by default
            ``Σ_x (w_i p_i(x) - q_i(x))_+`` from ``rows(i)``.
    """

    def __init__(
        self, p_tok: list[float], q_tok: list[float], rows: RowFn, slack: Callable[[int, float], float] | None = None
    ) -> None:
        self.length = len(p_tok)
        self.rows = rows
        self.slack = slack or self._slack
        self.weights = [1.0]
        for p_x, q_x in zip(p_tok, q_tok, strict=True):
            ratio = p_x / q_x if q_x > 0.0 else (0.0 if p_x == 0.0 else float("inf"))
            self.weights.append(min(1.0, self.weights[-1] * ratio))
        self._accept: dict[int, float] = {}

    def accept(self, i: int) -> float:
        """h_i, the acceptance probability of prefix x_{<=i} (1 <= i <= L)."""
        if i not in self._accept:
            w_i = self.weights[i]
            if i == self.length:
                h = w_i
            else:
                slack = self.slack(i, w_i)
                denom = slack + (1.0 - w_i)
                # 0/0 only when w_i = 1 and p = q there: every longer prefix is then accepted, so h_i = 1.
                h = slack / denom if denom > 0.0 else 1.0
            self._accept[i] = h
        return self._accept[i]

    def _slack(self, i: int, w_i: float) -> float:
        p_i, q_i = self.rows(i)
        return float(residual(p_i, q_i, w_i).sum())

    def sample(self, rng: RandomSource) -> tuple[int, int]:
        """Draw (τ, extra token): scan i = L..1 and stop at the first success; then bonus or BV's residual."""
        tau = 0
        for i in range(self.length, 0, -1):
            if rng.bernoulli(self.accept(i)):
                tau = i
                break
        p_tau, q_tau = self.rows(tau)
        if tau == self.length:
            return tau, rng.categorical(p_tau)
        return tau, sample_residual(rng, residual(p_tau, q_tau, self.weights[tau]), p_tau)

    def expected(self) -> float:
        """E[τ+1] = 1 + Σ_i P(τ ≥ i) = 1 + Σ_i (1 - Π_{j ≥ i} (1 - h_j))."""
        total, none_from = 1.0, 1.0
        for i in range(self.length, 0, -1):
            none_from *= 1.0 - self.accept(i)
            total += 1.0 - none_from
        return total


def single_path_nodes(tree: DraftTree) -> tuple[list[int], list[int]]:
    """(nodes root first, tokens) of a single-path tree."""
    nodes, node = [ROOT], ROOT
    while tree.draws[node]:
        node = tree.draws[node][0]
        nodes.append(node)
    return nodes, [tree.tokens[v] for v in nodes[1:]]


class BlockVerifier(Verifier):
    """Block verification: optimal among verifiers reading only on-path distributions of one draft."""

    name = "block"
    regime_help = "single drafted paths (K = 1 or L2 = 0)"

    def supports(self, tree):
        return tree.regime != Regime.DETERMINISTIC and tree.is_single_path

    def _plan(self, tree, p, q):
        nodes, tokens = single_path_nodes(tree)
        parents, toks = as_index(nodes[:-1]), as_index(tokens)
        plan = BlockPlan(p[parents, toks].tolist(), q[parents, toks].tolist(), lambda i: (p[nodes[i]], q[nodes[i]]))
        return nodes, plan

    def _verify(self, tree, p, q, rng):
        nodes, plan = self._plan(tree, p, q)
        tau, extra = plan.sample(rng)
        return make_result(tree, nodes[tau], extra)

    def _expected(self, tree, p, q):
        return self._plan(tree, p, q)[1].expected()
