"""Exact block-efficiency labels of every (K, L1, L2) action at a root, from the root's union trees (data_gen/union.py).

How a verifier is labelled is its own declaration (``Verifier.label_rule``):

* ``REACH`` (top-down verifiers): reach probabilities with the solvers' exact branching, memoised per
  (node, draws); the reach of a branch node does not depend on L2, so one pass per (L1, K) gives every L2 by
  prefix sums;
* ``TRAVERSAL``: the verifier's fold walk with folds shared across the root's trees (data_gen/label_traversal.py);
* ``PATHS`` (GBV): its path nodes reused across the root's trees;
* ``TREE``: the verifier's own exact expectation on each distinct action tree, built explicitly.

Actions whose trees a verifier does not support get NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data_gen.label_traversal import UnionTraversal
from data_gen.union import UnionForest
from decode.drafting.actions import Action
from decode.verifiers import LabelRule, Verifier
from decode.verifiers.gbv import PathNode
from decode.verifiers.traversal import NodeRows


@dataclass
class RootLabels:
    """Labels of one root: per union tree, and their mean.

    Attributes:
        be_trees: verifier -> ``(s, A)`` Ê[τ+1] of each action on each of the s union trees (NaN where the
            verifier does not support the action's trees). Each tree's value is exact given that tree.
        accept: top-down verifier -> ``(L_max + 1,)`` P(a draw is accepted at trunk depth d with K_max draws),
            mean over the trees.
        trunk_accept: ``(s, 2·L_max)`` min(1, p/q) of the trunk token drawn at trunk depth j (standard speculative
            sampling's acceptance of that token, given the trunk up to j).
        trunk_beta: ``(s, 2·L_max)`` 1 − TV(p, q) at trunk depth j: the expected acceptance there.
        l1_by_depth: ``(2·L_max,)`` ‖p − q‖₁ at trunk depth d, mean over the trees.
    """

    be_trees: dict[str, np.ndarray]
    accept: dict[str, np.ndarray]
    trunk_accept: np.ndarray
    trunk_beta: np.ndarray
    l1_by_depth: np.ndarray

    @property
    def be(self) -> dict[str, np.ndarray]:
        """verifier -> ``(A,)`` Ê[τ+1] per action, the mean over the union trees."""
        return {name: values.mean(axis=0) for name, values in self.be_trees.items()}


def label_forest(
    forest: UnionForest, p: torch.Tensor, q: torch.Tensor, verifiers: Sequence[Verifier], actions: Sequence[Action]
) -> RootLabels:
    """Ê[τ+1] of every action for every verifier on each of the forest's union trees.

    Args:
        p, q: ``(n, V)`` target and draft rows of every forest node (q rows of leaves are never read).
        actions: each with K <= k_max and L1, L2 <= l_max of the forest.

    Raises:
        ValueError: a verifier whose draft regime union trees do not sample (``LabelRule.NONE``).
    """
    be_trees, accept = {}, {}
    for verifier in verifiers:
        if verifier.label_rule == LabelRule.NONE:
            raise ValueError(f"verifier '{verifier.name}' drafts {verifier.draft_regime.value} trees, which union "
                             "trees do not sample: it cannot be labelled from them")
        if verifier.label_rule == LabelRule.REACH:
            tables = [_ot_tables(verifier, forest, s, p, q) for s in range(len(forest.samples))]
            be_trees[verifier.name] = np.array([[grid[a.k - 1, a.l1, a.l2] for a in actions] for grid, _ in tables])
            accept[verifier.name] = np.mean([t[1] for t in tables], axis=0)
        else:
            be_trees[verifier.name] = tree_labels(verifier, forest, p, q, actions)
    trunks = torch.tensor([s.trunk for s in forest.samples])  # (s, 2·L_max + 1)
    nodes, drawn = trunks[:, :-1], torch.tensor(forest.tokens)[trunks[:, 1:]]
    p_drawn = p[nodes].gather(-1, drawn.unsqueeze(-1)).squeeze(-1).double()
    q_drawn = q[nodes].gather(-1, drawn.unsqueeze(-1)).squeeze(-1).double()
    trunk_accept = torch.where(p_drawn >= q_drawn, 1.0, p_drawn / q_drawn.clamp_min(1e-300))
    trunk_beta = torch.minimum(p[nodes], q[nodes]).double().sum(-1)
    l1 = (p[nodes] - q[nodes]).abs().sum(-1).mean(0)
    return RootLabels(be_trees, accept, trunk_accept.numpy(), trunk_beta.numpy(), l1.double().numpy())


def _ot_tables(verifier: Verifier, forest: UnionForest, index: int, p, q) -> tuple[np.ndarray, np.ndarray]:
    """``be[K-1, L1, L2]`` and the per-depth acceptance of one union tree, from reach probabilities."""
    solver, tokens = verifier.solver, forest.tokens
    sample, k_max, l_max = forest.samples[index], forest.k_max, forest.l_max
    memo: dict[tuple[int, tuple[int, ...]], dict[int, float]] = {}
    single = solver.single_draw
    p_np, q_np = p.numpy(), q.numpy()

    def branching(node: int, draws: tuple[int, ...]) -> dict[int, float]:
        key = (node, draws)
        if key not in memo:
            if single is not None and len(draws) == 1:  # most nodes of a delayed tree have one child
                t = draws[0]
                memo[key] = {t: single(float(p_np[node, t]), float(q_np[node, t]))}
            else:
                memo[key] = solver.branching(p[node], q[node], list(draws))
        return memo[key]

    trunk = sample.trunk
    reach = [1.0]
    for j in range(2 * l_max):
        t = tokens[trunk[j + 1]]
        reach.append(reach[-1] * branching(trunk[j], (t,))[t])
    cum = np.cumsum(reach)
    be = np.empty((k_max, l_max + 1, l_max + 1))
    accept = np.empty(l_max + 1)
    for d in range(l_max + 1):
        be[:, d, 0] = cum[d]
        be[0, d, :] = cum[d : d + l_max + 1]
        branches = sample.branches[d]
        accept[d] = sum(branching(trunk[d], tuple(tokens[b[0]] for b in branches)).values())
        for k in range(2, k_max + 1):
            levels = _branch_level_sums(branching, tokens, trunk[d], branches[:k])
            be[k - 1, d, 1:] = cum[d] + reach[d] * np.cumsum(levels)
    return be, accept


def _branch_level_sums(branching, tokens: list[int], tip: int, branches: list[list[int]]) -> list[float]:
    """Σ over distinct nodes at each branch level m = 1..L of P(reach | at the tip)."""
    reach = {tip: 1.0}
    sums = []
    for m in range(len(branches[0])):
        parents = [tip if m == 0 else b[m - 1] for b in branches]
        draws: dict[int, list[int]] = {}
        for parent, branch in zip(parents, branches, strict=True):
            draws.setdefault(parent, []).append(tokens[branch[m]])
        total = 0.0
        for parent, branch in zip(parents, branches, strict=True):
            v = branch[m]
            if v not in reach:
                reach[v] = reach[parent] * branching(parent, tuple(draws[parent]))[tokens[v]]
                total += reach[v]
        sums.append(total)
    return sums


def tree_labels(verifier: Verifier, forest: UnionForest, p, q, actions: Sequence[Action]) -> np.ndarray:
    """``(s, A)``: the exact expectation on each distinct action tree of each sample (NaN where unsupported).

    ``TRAVERSAL`` and ``PATHS`` verifiers share work across the trees of a root (Traversal's fold walk, GBV's path
    nodes: order, q̃, BV sums); any other verifier gets its own expectation on each tree.
    """
    keys = list(dict.fromkeys(a.canonical() for a in actions))
    samples = range(len(forest.samples))
    values: dict[Action, list[float]] = {}
    if verifier.label_rule == LabelRule.TRAVERSAL:
        rows = NodeRows(p.numpy(), q.numpy())
        walks = [UnionTraversal(s.trunk, s.branches, forest.tokens, rows) for s in forest.samples]
        values = {key: [w.expected(key.k, key.l1, key.l2) for w in walks] for key in keys}
    else:
        steps: dict[tuple[int, float, float, int], PathNode] = {}
        for key in keys:
            values[key] = []
            for s in samples:
                tree, nodes = forest.action_tree(s, key)
                if not verifier.supports(tree):
                    values[key] = [float("nan")] * len(samples)
                    break
                index = torch.tensor(nodes)
                if verifier.label_rule == LabelRule.PATHS:
                    value = verifier.expected_with_steps(tree, p[index], q[index], _step_cache(steps, nodes))
                else:
                    value = verifier.expected_block_efficiency(tree, p[index], q[index])
                values[key].append(value)
    return np.array([values[a.canonical()] for a in actions]).T


def _step_cache(steps: dict, nodes: list[int]):
    """A GBV step factory that reuses path nodes by (forest node, masses, K) across trees."""

    def make_step(u: int, p_u, q_u, mass_below: float, mass_here: float, k: int) -> PathNode:
        key = (nodes[u], mass_below, mass_here, k)
        if key not in steps:
            steps[key] = PathNode(p_u, q_u, mass_below, mass_here, k)
        return steps[key]

    return make_step
