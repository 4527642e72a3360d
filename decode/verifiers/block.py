"""Block verification on a single drafted path (Sun et al., ICLR 2025; algorithms.md §2.3).

Given the path x_1..x_L and full p, q at its nodes, the clipped running weights
``w_i = min(1, w_{i-1} p(x_i)/q(x_i))`` define per-prefix acceptance probabilities
``h_i = S_i / (S_i + 1 - w_i)`` (``h_L = w_L``), ``S_i = Σ_x (w_i p_i(x) - q_i(x))_+``; the accepted length is
the largest i whose independent Bernoulli(h_i) succeeds. GBV reuses this with a skewed draft q̃.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode.rng import RandomSource
from decode.tree import ROOT, DraftTree, Regime
from decode.verifiers.base import Verifier, make_result, register
from decode.verifiers.otlp import as_index, residual, sample_residual


@dataclass(frozen=True)
class BlockPlan:
    """Everything BV needs once the path is fixed.

    Attributes:
        p_rows: ``(L+1, V)`` target distributions at the path's nodes x_{<=0}..x_{<=L} (root first).
        q_rows: ``(L+1, V)`` draft distributions at the same nodes (the last row is never read).
        weights: w_0..w_L (w_0 = 1).
        accept: h_1..h_L, the independent per-prefix acceptance probabilities.
    """

    p_rows: torch.Tensor
    q_rows: torch.Tensor
    weights: list[float]
    accept: list[float]


def block_plan(tokens: list[int], p_rows: torch.Tensor, q_rows: torch.Tensor) -> BlockPlan:
    """BV's weights and acceptance probabilities for the drafted path ``tokens`` (x_1..x_L).

    ``p_rows``/``q_rows`` are ``(L+1, V)``: row i is the distribution after x_{<=i}. q may be a skewed draft (GBV).
    """
    length = len(tokens)
    if length == 0:
        return BlockPlan(p_rows, q_rows, [1.0], [])
    steps = torch.arange(length)
    toks = as_index(tokens)
    p_tok = p_rows[steps, toks].tolist()
    q_tok = q_rows[steps, toks].tolist()
    weights = [1.0]
    for p_x, q_x in zip(p_tok, q_tok, strict=True):
        ratio = p_x / q_x if q_x > 0.0 else (0.0 if p_x == 0.0 else float("inf"))
        weights.append(min(1.0, weights[-1] * ratio))
    accept = []
    if length > 1:
        w = torch.tensor(weights[1:-1], dtype=p_rows.dtype).unsqueeze(1)
        slack = (w * p_rows[1:-1] - q_rows[1:-1]).clamp_min_(0.0).sum(dim=1).tolist()
        for s, w_i in zip(slack, weights[1:-1], strict=True):
            denom = s + 1.0 - w_i
            # 0/0 only when w_i = 1 and p = q there: every longer prefix is then accepted, so h_i = 1.
            accept.append(s / denom if denom > 0.0 else 1.0)
    accept.append(weights[-1])
    return BlockPlan(p_rows, q_rows, weights, accept)


def block_sample(plan: BlockPlan, rng: RandomSource) -> tuple[int, int]:
    """Draw (τ, extra token): scan i = L..1 and stop at the first success; then bonus or BV's residual."""
    tau = 0
    for i in range(len(plan.accept), 0, -1):
        if rng.bernoulli(plan.accept[i - 1]):
            tau = i
            break
    if tau == len(plan.accept):
        return tau, rng.categorical(plan.p_rows[tau])
    res = residual(plan.p_rows[tau], plan.q_rows[tau], plan.weights[tau])
    return tau, sample_residual(rng, res, plan.p_rows[tau])


def block_expected(plan: BlockPlan) -> float:
    """E[τ+1] = 1 + Σ_i P(τ ≥ i) = 1 + Σ_i (1 - Π_{j ≥ i} (1 - h_j))."""
    total, none_from = 1.0, 1.0
    for h in reversed(plan.accept):
        none_from *= 1.0 - h
        total += 1.0 - none_from
    return total


def single_path_nodes(tree: DraftTree) -> tuple[list[int], list[int]]:
    """(nodes root first, tokens) of a single-path tree."""
    nodes, node = [ROOT], ROOT
    while tree.draws[node]:
        node = tree.draws[node][0]
        nodes.append(node)
    return nodes, [tree.tokens[v] for v in nodes[1:]]


@register
class BlockVerifier(Verifier):
    """Block verification: optimal among verifiers reading only on-path distributions of one draft."""

    name = "block"
    regime_help = "single drafted paths (K = 1 or L2 = 0)"

    def supports(self, tree):
        return tree.regime != Regime.DETERMINISTIC and tree.is_single_path

    def _plan(self, tree, p, q):
        nodes, tokens = single_path_nodes(tree)
        index = as_index(nodes)
        return nodes, block_plan(tokens, p[index], q[index])

    def _verify(self, tree, p, q, rng):
        nodes, plan = self._plan(tree, p, q)
        tau, extra = block_sample(plan, rng)
        return make_result(tree, nodes[tau], extra)

    def _expected(self, tree, p, q):
        return block_expected(self._plan(tree, p, q)[1])
