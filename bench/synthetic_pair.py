"""Synthetic draft/target pairs and tree drafting from a next-token function.

Used by the verifier bench (bench/verifiers.py) and the exact tests: a pair whose next-token distributions depend on the
prefix through a seeded generator, and samplers that draft delayed and without-replacement trees from any
``next_q(prefix) -> (V,)`` function through a :class:`~decode.drafting.rng.RandomSource`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode.drafting.rng import RandomSource
from decode.drafting.tree import DraftTree, Regime, delayed_tree, nested_tree

NextDist = Callable[[tuple[int, ...]], torch.Tensor]


@dataclass
class SyntheticPair:
    """Prefix-dependent random target p and draft q (float64), cached per prefix.

    The target's logits are ``scale * N(0, 1)`` per token (peaked, long-tailed: top probability about 0.5 at
    scale 5 and V = 4096); the draft adds ``noise * N(0, 1)``, so p and q overlap partly (1 - TV about 0.75).
    """

    vocab: int
    seed: int = 0
    scale: float = 5.0
    noise: float = 1.0
    _cache: dict = field(default_factory=dict, repr=False)

    def _make(self, prefix: tuple[int, ...], which: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + prefix) % (2**62))
        logits = torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.scale
        if which == "q":
            logits = logits + torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.noise
        return torch.softmax(logits, dim=0)

    def dist(self, prefix: tuple[int, ...], which: str) -> torch.Tensor:
        """Next-token distribution after ``prefix``: ``which`` is 'p' (target) or 'q' (draft); shape ``(V,)``."""
        key = (which, prefix)
        if key not in self._cache:
            self._cache[key] = self._make(prefix, which)
        return self._cache[key]

    def next_q(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return self.dist(prefix, "q")

    def tree_rows(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, V)`` p and q at every node of ``tree``, root first."""
        prefixes = [tuple(tree.tokens[v] for v in tree.path_to(u)) for u in range(tree.num_nodes)]
        p = torch.stack([self.dist(pre, "p") for pre in prefixes])
        q = torch.stack([self.dist(pre, "q") for pre in prefixes])
        return p, q


def draft_delayed(next_q: NextDist, k: int, l1: int, l2: int, rng: RandomSource) -> DraftTree:
    """A (K, L1, L2)-delayed tree: a q-trunk of L1 tokens, then K i.i.d. q-branches of L2 from its tip."""
    trunk: list[int] = []
    for _ in range(l1):
        trunk.append(rng.categorical(next_q(tuple(trunk))))
    branches = []
    for _ in range(k):
        branch: list[int] = []
        for _ in range(l2):
            branch.append(rng.categorical(next_q(tuple(trunk + branch))))
        branches.append(branch)
    return delayed_tree(trunk, branches)


def draft_without_replacement(next_q: NextDist, branching: Sequence[int], rng: RandomSource) -> DraftTree:
    """A per-node without-replacement tree: ``branching[d]`` distinct sequential q-draws at each node of depth d."""
    children: dict[tuple[int, ...], list[int]] = {}
    frontier: list[tuple[int, ...]] = [()]
    for width in branching:
        nxt = []
        for prefix in frontier:
            weights = next_q(prefix).clone()
            drawn = []
            for _ in range(min(width, int((weights > 0).sum()))):
                t = rng.categorical(weights)
                weights[t] = 0.0
                drawn.append(t)
            children[prefix] = drawn
            nxt.extend(prefix + (t,) for t in drawn)
        frontier = nxt
    return nested_tree(children, Regime.WITHOUT_REPLACEMENT)
