"""Top-down ("OT-based") tree verification with an OTLP solver at every node (algorithms.md §1.4, §3.4).

From the root, run the solver on the node's draws; if its output is a drafted child, descend, otherwise emit
it as the correction. At a leaf the bonus token is drawn from p. The exact expectation sums, over every
node u, the probability that the traversal reaches u: the product of the solver's branching probabilities
along the path to u.
"""

from __future__ import annotations

import torch

from decode.drafting.tree import ROOT, DraftTree, Regime
from decode.verifiers.base import LabelRule, Verifier, make_result
from decode.verifiers.otlp import NaiveSolver, NSSSolver, OTLPSolver, RSDSolver, SpecInferSolver, SpecTrSolver


class OTVerifier(Verifier):
    solver: OTLPSolver
    label_rule = LabelRule.REACH

    def _verify(self, tree, p, q, rng):
        node = ROOT
        while True:
            draws = tree.draw_tokens(node)
            if not draws:
                return make_result(tree, node, rng.categorical(p[node]))
            token = self.solver.sample(p[node], q[node], draws, rng)
            child = tree.child_with_token(node, token)
            if child is None:
                return make_result(tree, node, token)
            node = child

    def reach_probabilities(self, tree: DraftTree, p: torch.Tensor, q: torch.Tensor) -> list[float]:
        """P(the traversal reaches node u) for every node (1 at the root); E[τ+1] is their sum."""
        self.check_tree(tree)
        reach = [0.0] * tree.num_nodes
        reach[ROOT] = 1.0
        for u in range(tree.num_nodes):
            if not tree.draws[u] or reach[u] == 0.0:
                continue
            branch = self.solver.branching(p[u], q[u], tree.draw_tokens(u))
            for v in tree.children[u]:
                reach[v] = reach[u] * branch[tree.tokens[v]]
        return reach

    def _expected(self, tree, p, q):
        return sum(self.reach_probabilities(tree, p, q))


class _IIDOnly:
    regime_help = "i.i.d. trees (single paths, K root paths, (K, L1, L2)-delayed trees)"

    def supports(self, tree: DraftTree) -> bool:
        return tree.regime == Regime.IID


class NSSVerifier(OTVerifier):
    """Naive speculative sampling: sample p at each node, descend while on the tree. Any tree."""

    name = "nss"
    solver = NSSSolver()
    regime_help = "any tree"

    def supports(self, tree):
        return True


class NaiveTreeVerifier(_IIDOnly, OTVerifier):
    """Standard speculative sampling per node on the first draw (= standard SD on a single path)."""

    name = "naive"
    solver = NaiveSolver()


class SpecInferVerifier(_IIDOnly, OTVerifier):
    """Recursive rejection sampling with replacement over the multiset of draws."""

    name = "specinfer"
    solver = SpecInferSolver()


class SpecTrVerifier(_IIDOnly, OTVerifier):
    """SpecTr's K-SEQ solver at every node."""

    name = "spectr"
    solver = SpecTrSolver()


class RSDVerifier(OTVerifier):
    """Recursive rejection sampling without replacement, for per-node without-replacement trees."""

    name = "rsd"
    solver = RSDSolver()
    regime_help = "without-replacement trees and single paths"
    draft_regime = Regime.WITHOUT_REPLACEMENT
    label_rule = LabelRule.NONE  # union trees draw i.i.d. branches, never RSD's without-replacement siblings

    def supports(self, tree):
        return tree.regime == Regime.WITHOUT_REPLACEMENT or (tree.regime == Regime.IID and tree.is_single_path)
