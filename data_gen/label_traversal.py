"""Traversal's exact E[τ+1] of every delayed tree of one union sample, sharing the work across its trees.

The walk itself is the verifier's (``decode.verifiers.traversal``: :func:`expected_walk` on a scalar
:class:`FoldState`). Across the action trees of one union sample most folds repeat exactly: branches of every L2
(and the first branches of every K) walk the same nodes with the same weights, and :class:`NodeRows` caches each
distinct fold once per root. The trunk above the branch point is folded the same way by every tree: its tail value
is computed once per sample. Results equal the verifier's own walk up to float rounding (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

from decode.verifiers.traversal import FoldState, NodeRows, expected_walk


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
        state = FoldState(tip, self.w[l1], children, parents, depths, self.tokens, self.rows)
        total, alive = expected_walk(state)
        h = state.override[tip]
        if l1 == 0:
            return total + alive
        return total + alive * (h * (l1 + 1) + (1.0 - h) * self.tail[l1])
