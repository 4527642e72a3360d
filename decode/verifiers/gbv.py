"""Greedy multi-path block verification (GBV, Thomas & Pal; rule as in algorithms.md §2.10).

K i.i.d. root paths. Tokens at a node u are totally ordered by a key, and paths lexicographically by their
keys. GBV takes the largest drafted path (a greedy descent), which is distributed as the maximum of K i.i.d.
q-paths. BV then runs on it with that maximum's law q̃ in place of q.

Losslessness needs only that the path choice and q̃ use the *same* strict total order. Breaking ties one way in
the descent and another in q̃ is biased (a negative control in the tests). Greediness wants the order to
follow the acceptance ratio. Our key is therefore ``(level, token id)``, where ``level`` is
``min(1, p/q)`` quantised to 256 levels. Quantising lets one radix pass (a stable argsort of uint8)
order the whole vocabulary instead of a float sort. It changes the preference only between drafted
children whose ratios lie within 1/255 of each other.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import numpy as np
import torch

from decode.drafting.tree import ROOT
from decode.verifiers.base import LabelRule
from decode.verifiers.block import BlockPlan, BlockVerifier
from decode.verifiers.otlp import as_index, residual

LEVELS = 256


def ratio_levels(p_u: torch.Tensor, q_u: torch.Tensor) -> torch.Tensor:
    """``min(1, p/q)`` quantised to 0..255 (uint8), shape ``(V,)``; tokens with q = 0 get the top level.

    A token q never drafts carries no q-mass, so where it ranks does not change q̃ of any other token.
    """
    ratio = torch.where(q_u > 0, p_u / q_u.clamp_min(1e-300), torch.ones_like(p_u)).clamp_max_(1.0)
    return (ratio * (LEVELS - 1)).to(torch.uint8)


def power_difference(hi, lo, k: int):
    """``(hi^k - lo^k) / (hi - lo) = Σ_j hi^j lo^(k-1-j)``, free of the cancellation in hi^k - lo^k.

    By the recurrence S_1 = 1, S_{m+1} = hi·S_m + lo^m; works on tensors (elementwise) and Python floats alike.
    """
    total, lo_power = 1.0, 1.0
    for _ in range(k - 1):
        lo_power = lo_power * lo
        total = total * hi + lo_power
    return total


class PathNode:
    """The order at one node of the chosen path and the skewed draft q̃ it induces.

    ``mass_below`` (A) is the q-mass of full paths ranked below every path through this node, ``mass_here`` (X)
    the q-mass of the paths through it (algorithms.md §2.10).
    """

    def __init__(self, p_u: torch.Tensor, q_u: torch.Tensor, mass_below: float, mass_here: float, k: int) -> None:
        self.p, self.q = p_u, q_u
        self.mass_below, self.mass_here, self.k = mass_below, mass_here, k
        self.denom = mass_here * power_difference(mass_below + mass_here, mass_below, k)
        self._q_tilde: torch.Tensor | None = None
        self._below: dict[int, float] = {}
        self._slack: dict[float, float] = {}

    @cached_property
    def levels(self) -> torch.Tensor:
        return ratio_levels(self.p, self.q)

    def below(self, token: int) -> float:
        """q-mass of tokens ranked strictly below ``token`` here (one masked sum, no sort)."""
        if token not in self._below:
            level = int(self.levels[token])
            lower = (self.levels < level) | ((self.levels == level) & (_ids(self.q.numel(), self.q.device) < token))
            self._below[token] = float(torch.where(lower, self.q, 0.0).sum())
        return self._below[token]

    def q_tilde_at(self, token: int) -> float:
        """q̃(token) = [(A + B + Z)^K - (A + B)^K] / [(A + X)^K - A^K] with B = X·below, Z = X·q(token)."""
        if self.k == 1:
            return float(self.q[token])
        lo = self.mass_below + self.mass_here * self.below(token)
        z = self.mass_here * float(self.q[token])
        return z * power_difference(lo + z, lo, self.k) / self.denom

    def q_tilde(self) -> torch.Tensor:
        """The full ``(V,)`` skewed draft at this node (one radix pass over the vocabulary)."""
        if self.k == 1:
            return self.q  # the maximum of one path is that path
        if self._q_tilde is None:
            # by (level, id): numpy's stable radix pass, on the host
            order = torch.from_numpy(np.argsort(self.levels.cpu().numpy(), kind="stable")).to(self.q.device)
            q_sorted = self.q[order]
            below = torch.empty_like(self.q).scatter_(0, order, torch.cumsum(q_sorted, 0) - q_sorted)
            lo = self.mass_below + self.mass_here * below
            z = self.mass_here * self.q
            self._q_tilde = z * power_difference(lo + z, lo, self.k) / self.denom
        return self._q_tilde

    def slack(self, w: float) -> float:
        """BV's ``S = Σ_x (w·p(x) - q̃(x))_+`` at this node for the path weight ``w`` (cached per w)."""
        if w not in self._slack:
            self._slack[w] = float(residual(self.p, self.q_tilde(), w).sum())
        return self._slack[w]


StepFactory = Callable[[int, torch.Tensor, torch.Tensor, float, float, int], PathNode]


def new_step(node: int, p_u: torch.Tensor, q_u: torch.Tensor, mass_below: float, mass_here: float, k: int):
    """A fresh :class:`PathNode` (``node`` is unused; a caching factory keys on it)."""
    return PathNode(p_u, q_u, mass_below, mass_here, k)


_ID_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _ids(vocab: int, device: torch.device) -> torch.Tensor:
    """``(vocab,)`` token ids on ``device``, built once per (vocab, device)."""
    key = (vocab, device)
    if key not in _ID_CACHE:
        _ID_CACHE[key] = torch.arange(vocab, device=device)
    return _ID_CACHE[key]


class GreedyBlockVerifier(BlockVerifier):
    """GBV: greedy path selection under one total order, then BV with the skewed draft q̃."""

    name = "gbv"
    label_rule = LabelRule.PATHS
    regime_help = "K i.i.d. root paths of one length ((K, 0, L) trees) and single paths"

    def supports(self, tree):
        return tree.is_root_paths

    def expected_with_steps(self, tree, p, q, make_step: StepFactory) -> float:
        """:meth:`expected_block_efficiency` with the path nodes built by ``make_step`` (for shared caches)."""
        self.check_tree(tree)
        return self._plan(tree, p, q, make_step)[1].expected()

    def select_child(self, children: list[int], tokens: list[int], keys: list[int]) -> int:
        """The child with the largest (key, token); ``keys[i]`` is the ratio level of ``tokens[i]``."""
        best = max(range(len(children)), key=lambda i: (keys[i], tokens[i]))
        return children[best]

    @staticmethod
    def _levels(step: PathNode, tokens: list[int]) -> list[int]:
        return step.levels[as_index(tokens)].tolist()

    def _plan(self, tree, p, q, make_step: StepFactory = new_step):
        """The chosen path and its BV plan. ``make_step`` builds each path node's :class:`PathNode` (the
        collector passes one that reuses them across the trees of a root)."""
        k = tree.shape[0] if tree.shape is not None and tree.shape[2] > 0 else 1
        nodes, path = [ROOT], []
        mass_below, mass_here = 0.0, 1.0
        node = ROOT
        while tree.children[node]:
            step = make_step(node, p[node], q[node], mass_below, mass_here, k)
            kids = list(tree.children[node])
            kid_tokens = [tree.tokens[v] for v in kids]
            child = kids[0] if len(kids) == 1 else self.select_child(kids, kid_tokens, self._levels(step, kid_tokens))
            token = tree.tokens[child]
            if k > 1:  # descend: paths through the child rank above those through lower-ranked siblings
                mass_below = mass_below + mass_here * step.below(token)
            mass_here = mass_here * float(q[node, token])
            path.append(step)
            nodes.append(child)
            node = child
        tokens = [tree.tokens[v] for v in nodes[1:]]
        p_tok = [float(p[u, t]) for u, t in zip(nodes[:-1], tokens, strict=True)]
        q_tok = [step.q_tilde_at(t) for step, t in zip(path, tokens, strict=True)]

        def rows(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return p[nodes[i]], (path[i].q_tilde() if i < len(path) else q[nodes[i]])

        def slack(i: int, w: float) -> float:
            return path[i].slack(w)

        return nodes, BlockPlan(p_tok, q_tok, rows, slack)

