"""SpecTr-GBV's released verification rule (Lin et al., arXiv 2604.25925), as a negative control (issue 31).

Written from the rule's math as issue 31 states it, not from the released code (which has no licence). Notation:
p is the target and q the draft. For one draft, P_l and Q_l are the raw joint products of p and q over its first
l tokens. ``r_l = min(Q_l / P_l, 1)`` and ``r_l(x) = min(Q_l q(x) / (P_l p(x)), 1)``, with p, q the rows after
those l tokens.

* K i.i.d. drafts of length L from the root (a (K, 0, L) tree, or a single path when K = 1), scanned in draw
  order, with a fresh coin per test. τ is the accepted length so far. Draft j tests lengths l = τ + 1 .. L and
  computes P_l, Q_l over its *own* first l tokens. Nothing checks that they extend the prefix already accepted.
* Sub-block l < L: accept with
  ``h_l = [Σ_x P_l p(x)(1 - r_l(x))^K - P_l (1 - r_l)^K] / [1 - (1 - Q_l)^K - Σ_x P_l p(x)(1 - (1 - r_l(x))^K)]``
  (τ becomes l and the draft goes on to l + 1). Otherwise the prefix joins this round's rejected set and the draft
  still goes on to l + 1. A later draft skips a prefix in that set.
* Full block: accept with ``h_L = P_L [1 - (1 - r_L)^K] / [1 - (1 - Q_L)^K]``. The first full acceptance ends the
  round with a bonus token from p. Full-block rejections join no set, so a duplicate draft is tested again.
* Otherwise the last accepted sub-block wins, even one that does not extend an earlier accepted prefix. The
  correction is drawn from ``P_τ p(x) [1 - r_τ(x)^K]`` there (P_0 = Q_0 = 1 at the root).

With K = 1 this is block verification except that the joint ratio min(1, P_l/Q_l) is not capped as a running
ratio. :class:`FixedSpecTrGBV` changes the three things that look wrong (the duplicate test, the cap, the residual
exponent) through the hooks below. It is exact at K = 1, and still biased at K = 2 (tests/decode/exact/
test_spectr_gbv.py).
"""

from __future__ import annotations

import torch

from decode.drafting.tree import ROOT, DraftTree
from decode.verifiers.base import Verifier, make_result
from decode.verifiers.otlp import sample_residual

# The sub-block test is 0/0 when no drafted mass can be short of the target's (for K = 1: q·Q ≤ p·P everywhere).
# Read as 1, as block verification does. No oracle of issue 31 depends on this reading.
ZERO_DENOMINATOR = 1e-12


def root_drafts(tree: DraftTree) -> list[list[int]]:
    """The K drafted paths of a root-paths tree as node lists, in draw order.

    Equal prefixes share nodes. A node's draws list one entry per branch through it, in branch order, so the m-th
    branch to reach a node leaves it by its m-th draw.
    """
    used: dict[int, int] = {}
    drafts = []
    for _ in tree.draws[ROOT]:
        node, nodes = ROOT, []
        while tree.draws[node]:
            index = used.get(node, 0)
            used[node] = index + 1
            node = tree.draws[node][index]
            nodes.append(node)
        drafts.append(nodes)
    return drafts


def _ratio_to_target(big_p: float, big_q: float, p_u: torch.Tensor, q_u: torch.Tensor) -> torch.Tensor:
    """``r(x) = min(Q q(x) / (P p(x)), 1)``; 1 where P p(x) = 0, a token every term weighs by P p(x) anyway."""
    target = big_p * p_u
    return torch.where(target > 0, (big_q * q_u) / target.clamp_min(1e-300), torch.ones_like(p_u)).clamp_max(1.0)


class ReleasedSpecTrGBV(Verifier):
    """Wrong: SpecTr-GBV's released rule. Not lossless even at K = 1, and duplicate drafts inflate acceptance."""

    name = "spectr-gbv-released"
    regime_help = "K i.i.d. root paths of one length ((K, 0, L) trees) and single paths"

    def supports(self, tree):
        return tree.is_root_paths

    # --- the hooks the fixed variant changes ----------------------------------------------------------------
    def joint_target(self, big_p: float, big_q: float, weight: float) -> float:
        """The P_l the tests use: the raw joint product (``weight`` is block verification's running capped ratio)."""
        return big_p

    def skips_rejected_full_blocks(self) -> bool:
        """Whether a full block already rejected this round is skipped (the released rule tests it again)."""
        return False

    def correction_weights(self, big_p: float, big_q: float, p_u: torch.Tensor, q_u: torch.Tensor, k: int):
        """Unnormalised correction law at the winning prefix: ``P p(x) [1 - r(x)^K]``."""
        return big_p * p_u * (1.0 - _ratio_to_target(big_p, big_q, p_u, q_u) ** k)

    # --- the tests -------------------------------------------------------------------------------------------
    @staticmethod
    def sub_block_accept(big_p: float, big_q: float, p_u: torch.Tensor, q_u: torch.Tensor, k: int) -> float:
        r = min(big_q / big_p, 1.0) if big_p > 0 else 1.0
        r_x = _ratio_to_target(big_p, big_q, p_u, q_u)
        mass = big_p * p_u
        num = float((mass * (1.0 - r_x) ** k).sum()) - big_p * (1.0 - r) ** k
        den = 1.0 - (1.0 - big_q) ** k - float((mass * (1.0 - (1.0 - r_x) ** k)).sum())
        if den <= ZERO_DENOMINATOR:
            return 1.0
        return min(1.0, max(0.0, num / den))  # a uniform coin: h outside [0, 1] acts as 0 or 1

    @staticmethod
    def full_block_accept(big_p: float, big_q: float, k: int) -> float:
        r = min(big_q / big_p, 1.0) if big_p > 0 else 1.0
        return min(1.0, big_p * (1.0 - (1.0 - r) ** k) / (1.0 - (1.0 - big_q) ** k))

    def _verify(self, tree, p, q, rng):
        drafts = root_drafts(tree)
        length = len(drafts[0]) if drafts else 0
        if length == 0:
            return make_result(tree, ROOT, rng.categorical(p[ROOT]))
        k = len(drafts)
        tau, won, won_pq = 0, ROOT, (1.0, 1.0)
        rejected: set[int] = set()  # nodes, i.e. prefixes: equal prefixes share a node
        for nodes in drafts:
            joints, big_p, big_q, weight = [], 1.0, 1.0, 1.0
            for node in nodes:
                parent, token = tree.parents[node], tree.tokens[node]
                p_x, q_x = float(p[parent, token]), float(q[parent, token])
                big_p, big_q = big_p * p_x, big_q * q_x
                weight = min(1.0, weight * p_x / q_x)
                joints.append((self.joint_target(big_p, big_q, weight), big_q))
            for depth in range(tau + 1, length + 1):
                node = nodes[depth - 1]
                big_p, big_q = joints[depth - 1]
                if depth < length:
                    if node in rejected:
                        continue
                    if rng.bernoulli(self.sub_block_accept(big_p, big_q, p[node], q[node], k)):
                        tau, won, won_pq = depth, node, (big_p, big_q)
                    else:
                        rejected.add(node)
                elif not (self.skips_rejected_full_blocks() and node in rejected):
                    if rng.bernoulli(self.full_block_accept(big_p, big_q, k)):
                        return make_result(tree, node, rng.categorical(p[node]))
                    if self.skips_rejected_full_blocks():
                        rejected.add(node)
        weights = self.correction_weights(*won_pq, p[won], q[won], k)
        return make_result(tree, won, sample_residual(rng, weights, p[won]))

    def _expected(self, tree, p, q):
        raise NotImplementedError("a negative control: the tests enumerate its rounds instead")


class FixedSpecTrGBV(ReleasedSpecTrGBV):
    """Still wrong: the released rule with its three suspect steps fixed. P_l is block verification's capped
    ``w_l Q_l`` (so r_l = 1), a rejected full block is not tested again, and the correction is ``P p(x)(1 - r(x))^K``
    (the residual mass in h's numerator). Exact at K = 1, where it is block verification; biased for K ≥ 2."""

    name = "spectr-gbv-fixed"

    def joint_target(self, big_p, big_q, weight):
        return weight * big_q

    def skips_rejected_full_blocks(self):
        return True

    def correction_weights(self, big_p, big_q, p_u, q_u, k):
        return big_p * p_u * (1.0 - _ratio_to_target(big_p, big_q, p_u, q_u)) ** k
