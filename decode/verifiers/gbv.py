"""Greedy multi-path block verification (GBV, Thomas & Pal; rule as in algorithms.md §2.10).

K i.i.d. root paths. Tokens at a node u are totally ordered by ``(min(1, p_u(t)/q_u(t)), t)``: clipped
ratio, ties broken by token id. Paths are ordered lexicographically by these keys. GBV takes the largest
drafted path (a greedy descent), which is distributed as the maximum of K i.i.d. q-paths. BV then runs on it
with that maximum's law q̃ in place of q. The path choice and q̃ must use the same total order. Breaking ties
one way in the descent and another in q̃ is biased (a negative control in the tests).
"""

from __future__ import annotations

import torch

from decode.tree import ROOT
from decode.verifiers.base import Verifier, make_result, register
from decode.verifiers.block import block_expected, block_plan, block_sample
from decode.verifiers.otlp import as_index


def clipped_ratio(p_u: torch.Tensor, q_u: torch.Tensor) -> torch.Tensor:
    """``min(1, p/q)`` per token, shape ``(V,)``; tokens with q = 0 (never drafted) get 1."""
    return torch.where(q_u > 0, (p_u / q_u.clamp_min(1e-300)).clamp_max(1.0), torch.ones_like(p_u))


def power_difference(hi, lo, k: int):
    """``(hi^k - lo^k) / (hi - lo) = Σ_j hi^j lo^(k-1-j)``, free of the cancellation in hi^k - lo^k.

    Works on tensors (elementwise) and on Python floats alike.
    """
    total = hi * 0.0
    for j in range(k):
        total += hi**j * lo ** (k - 1 - j)
    return total


class GreedyBlockVerifier(Verifier):
    """GBV: greedy path selection under one total order, then BV with the skewed draft q̃."""

    name = "gbv"
    regime_help = "K i.i.d. root paths of one length ((K, 0, L) trees) and single paths"

    def supports(self, tree):
        return tree.is_root_paths

    def select_child(self, children: list[int], tokens: list[int], keys: list[float]) -> int:
        """The child with the largest (key, token); ``keys[i]`` is the clipped ratio of ``tokens[i]``."""
        best = max(range(len(children)), key=lambda i: (keys[i], tokens[i]))
        return children[best]

    def below_mass(self, ratio: torch.Tensor, q_u: torch.Tensor) -> torch.Tensor:
        """For every token t, the q-mass of tokens ranked strictly below t: ``Σ_{(r', t') < (r, t)} q(t')``."""
        order = torch.sort(ratio, stable=True).indices  # stable: equal ratios stay in token-id order
        cum = torch.cumsum(q_u[order], 0) - q_u[order]
        return torch.empty_like(q_u).scatter_(0, order, cum)

    def _plan(self, tree, p, q):
        k = tree.shape[0] if tree.shape is not None and tree.shape[2] > 0 else 1
        nodes, tokens, q_rows = [ROOT], [], []
        mass_below, mass_here = 0.0, 1.0  # A and X of algorithms.md §2.10
        node = ROOT
        while tree.children[node]:
            p_u, q_u = p[node], q[node]
            ratio = clipped_ratio(p_u, q_u)
            kids = list(tree.children[node])
            kid_tokens = [tree.tokens[v] for v in kids]
            child = self.select_child(kids, kid_tokens, ratio[as_index(kid_tokens)].tolist())
            below = self.below_mass(ratio, q_u) * mass_here + mass_below
            above = below + q_u * mass_here
            denom = mass_here * power_difference(mass_below + mass_here, mass_below, k)
            q_rows.append(q_u * mass_here * power_difference(above, below, k) / denom)
            token = tree.tokens[child]
            mass_below = float(below[token])
            mass_here = mass_here * float(q_u[token])
            nodes.append(child)
            tokens.append(token)
            node = child
        q_rows.append(q[node])  # the leaf's draft row is never read by BV
        index = as_index(nodes)
        return nodes, block_plan(tokens, p[index], torch.stack(q_rows))

    def _verify(self, tree, p, q, rng):
        nodes, plan = self._plan(tree, p, q)
        tau, extra = block_sample(plan, rng)
        return make_result(tree, nodes[tau], extra)

    def _expected(self, tree, p, q):
        return block_expected(self._plan(tree, p, q)[1])


register(GreedyBlockVerifier)
