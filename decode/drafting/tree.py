"""Draft trees: one representation for single paths, K i.i.d. root paths, (K, L1, L2)-delayed trees and
per-node without-replacement trees.

A tree is a set of distinct prefixes of the root context (its *nodes*), plus, for every node, the ordered
list of its **draws**: the child tokens drawn at that node, in draw order, with repeats. Two branches that
draw the same token at the same node give one child node whose token appears twice in the parent's draw
list. Verifiers need that multiplicity (SpecInfer must run one residual update per copy, algorithms.md
§2.4) and the draw order (K-SEQ and NaiveTree read the draws in order), while the target pass only needs
the distinct prefixes.

Node 0 is the root (the context itself, token -1). Every other node's parent has a smaller index, so a
single forward loop visits parents before children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

import torch

ROOT = 0


class Regime(StrEnum):
    """How the draws at each node were produced; decides which verifiers are lossless on the tree."""

    IID = "iid"  # draws at a node are i.i.d. from q: single path, K i.i.d. root paths, (K, L1, L2)-delayed trees
    WITHOUT_REPLACEMENT = "without_replacement"  # distinct draws, sequentially without replacement from q
    DETERMINISTIC = "deterministic"  # children chosen by a rule (e.g. top-k), not sampled from q


class InvalidTreeError(ValueError):
    """The tree's structure is inconsistent."""


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A drafted tree over the root context.

    Attributes:
        tokens: token of each node, length n; ``tokens[0] == -1`` for the root.
        parents: parent node of each node, length n; ``parents[0] == -1`` and ``parents[i] < i``.
        draws: for each node, the child *nodes* in draw order, one entry per draw (a child appears as
            many times as its token was drawn at this node).
        regime: how the draws were produced.
        shape: ``(K, L1, L2)`` for i.i.d. delayed trees (a single path of length L is ``(1, L, 0)``,
            K root paths of length L are ``(K, 0, L)``), else ``None``.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    draws: tuple[tuple[int, ...], ...]
    regime: Regime
    shape: tuple[int, int, int] | None = None
    _depths: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0 or len(self.parents) != n or len(self.draws) != n:
            raise InvalidTreeError("tokens, parents and draws must have the same non-zero length")
        if self.tokens[0] != -1 or self.parents[0] != -1:
            raise InvalidTreeError("node 0 must be the root (token -1, parent -1)")
        depths = [0] * n
        for i in range(1, n):
            parent = self.parents[i]
            if not 0 <= parent < i:
                raise InvalidTreeError(f"node {i} has parent {parent}; parents must precede their children")
            if self.tokens[i] < 0:
                raise InvalidTreeError(f"node {i} has a negative token")
            depths[i] = depths[parent] + 1
        for u, draw in enumerate(self.draws):
            for v in draw:
                if not 0 < v < n or self.parents[v] != u:
                    raise InvalidTreeError(f"node {u} lists a draw of node {v}, which is not its child")
        for v in range(1, n):
            if v not in self.draws[self.parents[v]]:
                raise InvalidTreeError(f"node {v} is never drawn at its parent")
        if self.regime != Regime.IID and any(len(set(d)) != len(d) for d in self.draws):
            raise InvalidTreeError(f"a {self.regime.value} tree cannot draw the same child twice")
        object.__setattr__(self, "_depths", tuple(depths))

    # --- structure -----------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Number of nodes including the root."""
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        return self._depths

    @property
    def max_depth(self) -> int:
        return max(self._depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Distinct child nodes of each node, in order of first draw."""
        return tuple(tuple(dict.fromkeys(d)) for d in self.draws)

    def draw_tokens(self, node: int) -> list[int]:
        """Tokens drawn at ``node``, in draw order, with repeats."""
        return [self.tokens[v] for v in self.draws[node]]

    def child_with_token(self, node: int, token: int) -> int | None:
        """The child node of ``node`` whose token is ``token``, if drafted."""
        for v in self.children[node]:
            if self.tokens[v] == token:
                return v
        return None

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @property
    def is_single_path(self) -> bool:
        """Every node has at most one draw."""
        return all(len(d) <= 1 for d in self.draws)

    @property
    def is_root_paths(self) -> bool:
        """K i.i.d. paths of one common length branching at the root (single paths included)."""
        if self.regime != Regime.IID or self.shape is None:
            return False
        k, l1, l2 = self.shape
        return l1 == 0 or k == 1 or l2 == 0

    @cached_property
    def ancestry(self) -> torch.Tensor:
        """``(n, n)`` bool: ``[i, j]`` is True iff node j is node i or one of its ancestors.

        Rows/columns 1..n-1 form the tree part of a tree attention mask (the root is the last cached token).
        """
        n = self.num_nodes
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if i > 0:
                anc[i] = anc[self.parents[i]]
            anc[i, i] = True
        return anc

    def first_path(self) -> DraftTree:
        """The tree reduced to its first drafted path (first draw at every node), as a single path."""
        tokens = []
        node = ROOT
        while self.draws[node]:
            node = self.draws[node][0]
            tokens.append(self.tokens[node])
        return single_path(tokens)

    def __repr__(self) -> str:
        return f"DraftTree(regime={self.regime.value}, shape={self.shape}, nodes={self.num_nodes})"


# --- builders -------------------------------------------------------------------------------------------
class TreeBuilder:
    """Incrementally builds a tree by drawing tokens at nodes (merging equal prefixes)."""

    def __init__(self) -> None:
        self.tokens: list[int] = [-1]
        self.parents: list[int] = [-1]
        self.draws: list[list[int]] = [[]]

    def draw(self, node: int, token: int) -> int:
        """Record a draw of ``token`` at ``node``; returns the child node (existing or new)."""
        for v in self.draws[node]:
            if self.tokens[v] == token:
                self.draws[node].append(v)
                return v
        v = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(node)
        self.draws.append([])
        self.draws[node].append(v)
        return v

    def depth(self, node: int) -> int:
        depth = 0
        while node > 0:
            node, depth = self.parents[node], depth + 1
        return depth

    def build(self, regime: Regime, shape: tuple[int, int, int] | None) -> DraftTree:
        return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(tuple(d) for d in self.draws), regime, shape)


def delayed_tree(trunk: Sequence[int], branches: Sequence[Sequence[int]]) -> DraftTree:
    """A (K, L1, L2)-delayed tree from its drafted tokens.

    Args:
        trunk: the L1 trunk tokens, drawn one at a time from q.
        branches: K branches of L2 tokens each, i.i.d. from q after the trunk tip, in draw order.
    """
    lengths = {len(b) for b in branches}
    if len(branches) == 0 or len(lengths) != 1:
        raise InvalidTreeError("a delayed tree needs K >= 1 branches of one common length")
    builder = TreeBuilder()
    tip = ROOT
    for token in trunk:
        tip = builder.draw(tip, token)
    for branch in branches:
        node = tip
        for token in branch:
            node = builder.draw(node, token)
    return builder.build(Regime.IID, (len(branches), len(trunk), lengths.pop()))


def single_path(tokens: Sequence[int]) -> DraftTree:
    """A single drafted path (the (1, L, 0)-delayed tree)."""
    return delayed_tree(tokens, [[]])


def root_paths(paths: Sequence[Sequence[int]]) -> DraftTree:
    """K i.i.d. paths of equal length drafted from the root (the (K, 0, L)-delayed tree)."""
    return delayed_tree([], paths)


def nested_tree(children: dict[tuple[int, ...], Sequence[int]], regime: Regime) -> DraftTree:
    """A tree from a map ``prefix -> tokens drawn after it`` (prefixes relative to the root).

    Used for without-replacement and deterministic trees; every prefix key must itself be drafted.
    """
    builder = TreeBuilder()
    node_of: dict[tuple[int, ...], int] = {(): ROOT}
    for prefix in sorted(children, key=len):
        if prefix not in node_of:
            raise InvalidTreeError(f"prefix {prefix} is not in the tree")
        for token in children[prefix]:
            node_of[prefix + (int(token),)] = builder.draw(node_of[prefix], token)
    return builder.build(regime, None)


def probe_tree(k: int, l1: int, l2: int, regime: Regime) -> DraftTree:
    """A (K, L1, L2) tree drafted in ``regime``, with placeholder tokens: what a verifier is asked to accept.

    I.i.d. branches repeat one token; without replacement, the K draws at the branching node are distinct and each
    branch then continues as a single path (RSD's drafting).
    """
    if regime == Regime.IID:
        return delayed_tree([0] * l1, [[0] * l2 for _ in range(k)])
    builder = TreeBuilder()
    tip = ROOT
    for _ in range(l1):
        tip = builder.draw(tip, 0)
    for b in range(k if l2 > 0 else 0):
        node = builder.draw(tip, b)
        for _ in range(l2 - 1):
            node = builder.draw(node, 0)
    return builder.build(regime, None)


def delayed_tree_size(k: int, l1: int, l2: int) -> int:
    """Drafted tokens of a (K, L1, L2)-delayed tree, duplicates counted: L1 + K * L2."""
    return l1 + k * l2
