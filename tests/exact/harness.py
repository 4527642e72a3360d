"""Exact-enumeration harness for verifiers (algorithms.md §1.3).

A toy autoregressive pair gives prefix-dependent p and q over a 2-3 token vocabulary. ``ReplayRandom``
replays a prefix of choices and takes the first option at every new choice. ``enumerate_runs`` thus walks
every sequence of random choices of the *real* drafting and verification code exactly once, with its
probability. The stream criterion then compares the law of the first M emitted tokens with the target's.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from decode.tree import DraftTree, Regime, delayed_tree, nested_tree
from decode.verifiers.base import Verifier


class ReplayRandom:
    """A RandomSource that follows ``prefix`` and then takes the first positive-probability option.

    It records, at every choice, the options with positive probability, so the driver can branch there.
    """

    def __init__(self, prefix: Sequence[int]) -> None:
        self.prefix = list(prefix)
        self.taken: list[int] = []
        self.options: list[list[int]] = []
        self.prob = 1.0

    def _choose(self, weights: list[float]) -> int:
        total = sum(weights)
        support = [i for i, w in enumerate(weights) if w > 0.0]
        if not support:
            raise AssertionError("choice over an all-zero distribution")
        pos = len(self.taken)
        choice = self.prefix[pos] if pos < len(self.prefix) else support[0]
        self.taken.append(choice)
        self.options.append(support)
        self.prob *= weights[choice] / total
        return choice

    def bernoulli(self, prob: float) -> bool:
        prob = min(1.0, max(0.0, prob))
        return self._choose([1.0 - prob, prob]) == 1

    def categorical(self, weights: torch.Tensor) -> int:
        return self._choose([float(w) for w in weights.tolist()])


def enumerate_runs(run: Callable[[ReplayRandom], Hashable]) -> list[tuple[float, Hashable]]:
    """Every (probability, outcome) of ``run`` over all its random choices (depth-first, each path once)."""
    results = []
    stack: list[list[int]] = [[]]
    while stack:
        prefix = stack.pop()
        rng = ReplayRandom(prefix)
        outcome = run(rng)
        results.append((rng.prob, outcome))
        for pos in range(len(prefix), len(rng.taken)):
            for alt in rng.options[pos]:
                if alt != rng.taken[pos]:
                    stack.append(rng.taken[:pos] + [alt])
    return results


def outcome_law(runs: list[tuple[float, Hashable]]) -> dict[Hashable, float]:
    law: dict[Hashable, float] = defaultdict(float)
    for prob, outcome in runs:
        law[outcome] += prob
    return dict(law)


@dataclass
class ToyPair:
    """Prefix-dependent random target p and draft q over ``vocab`` tokens (float64).

    With ``context_free`` the same (p0, q0) is used after every prefix (for the closed-form oracles).
    ``zero_prob`` sets each entry to zero with that probability (at least one entry stays positive), to
    exercise tokens that one model never produces.
    """

    vocab: int
    seed: int = 0
    p0: Sequence[float] | None = None
    q0: Sequence[float] | None = None
    zero_prob: float = 0.0
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def context_free(cls, p0: Sequence[float], q0: Sequence[float]) -> ToyPair:
        return cls(vocab=len(p0), p0=p0, q0=q0)

    def _random_dist(self, prefix: tuple[int, ...], which: int) -> torch.Tensor:
        key = hash((self.seed, which) + prefix) % (2**62)
        g = torch.Generator().manual_seed(key)
        v = torch.rand(self.vocab, generator=g, dtype=torch.float64) ** 2 + 0.02
        if self.zero_prob > 0.0:
            keep = torch.rand(self.vocab, generator=g, dtype=torch.float64) >= self.zero_prob
            keep[int(torch.argmax(v))] = True
            v = v * keep
        return v / v.sum()

    def dist(self, prefix: tuple[int, ...], which: str) -> torch.Tensor:
        """``which`` is 'p' (target) or 'q' (draft); the next-token distribution after ``prefix``."""
        key = (which, prefix)
        if key not in self._cache:
            if self.p0 is not None:
                base = self.p0 if which == "p" else self.q0
                self._cache[key] = torch.tensor(base, dtype=torch.float64)
            else:
                self._cache[key] = self._random_dist(prefix, 0 if which == "p" else 1)
        return self._cache[key]

    def prefix_prob(self, tokens: Sequence[int], start: int = 0) -> float:
        """Target probability of ``tokens[start:]`` given ``tokens[:start]``: Π_{j >= start} p(s_j | s_<j)."""
        prob = 1.0
        for j in range(start, len(tokens)):
            prob *= float(self.dist(tuple(tokens[:j]), "p")[tokens[j]])
        return prob

    def tree_rows(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, V)`` p and q at every node of the tree."""
        prefixes = [tuple(tree.tokens[v] for v in tree.path_to(u)) for u in range(tree.num_nodes)]
        p = torch.stack([self.dist(pre, "p") for pre in prefixes])
        q = torch.stack([self.dist(pre, "q") for pre in prefixes])
        return p, q


# --- drafting on the toy pair, through the same RandomSource -----------------------------------------------
def sample_delayed(pair: ToyPair, k: int, l1: int, l2: int, rng) -> DraftTree:
    """A (K, L1, L2)-delayed tree: a q-trunk of L1, then K i.i.d. q-branches of L2 from its tip."""
    trunk: list[int] = []
    for _ in range(l1):
        trunk.append(rng.categorical(pair.dist(tuple(trunk), "q")))
    branches = []
    for _ in range(k):
        branch: list[int] = []
        for _ in range(l2):
            branch.append(rng.categorical(pair.dist(tuple(trunk + branch), "q")))
        branches.append(branch)
    return delayed_tree(trunk, branches)


def sample_without_replacement(pair: ToyPair, branching: Sequence[int], rng) -> DraftTree:
    """Per-node without-replacement tree: ``branching[d]`` distinct q-draws at every node of depth d."""
    children: dict[tuple[int, ...], list[int]] = {}
    frontier: list[tuple[int, ...]] = [()]
    for width in branching:
        nxt = []
        for prefix in frontier:
            weights = pair.dist(prefix, "q").clone()
            drawn = []
            for _ in range(min(width, int((weights > 0).sum()))):
                t = rng.categorical(weights)
                weights[t] = 0.0
                drawn.append(t)
            children[prefix] = drawn
            nxt.extend(prefix + (t,) for t in drawn)
        frontier = nxt
    return nested_tree(children, Regime.WITHOUT_REPLACEMENT)


# --- the stream criterion -------------------------------------------------------------------------------------
def emitted_law(pair: ToyPair, draft: Callable, verifier: Verifier) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one round emits (accepted + extra), over drafting and verification."""

    def run(rng):
        tree = draft(rng)
        p, q = pair.tree_rows(tree)
        return verifier.verify(tree, p, q, rng).emitted

    return outcome_law(enumerate_runs(run))


def stream_error(pair: ToyPair, law: dict[tuple[int, ...], float], length: int) -> float:
    """max_s |P(first M tokens = s) - Π p(s)| over all strings s of length M, continuing each round with p."""
    worst = 0.0
    for s in itertools.product(range(pair.vocab), repeat=length):
        got = 0.0
        for out, prob in law.items():
            if len(out) <= length and s[: len(out)] == out:
                got += prob * pair.prefix_prob(s, start=len(out))
            elif len(out) > length and out[:length] == s:
                got += prob
        worst = max(worst, abs(got - pair.prefix_prob(s)))
    return worst


def check_total_mass(law: dict) -> float:
    return abs(sum(law.values()) - 1.0)


def exact_block_efficiency(pair: ToyPair, draft: Callable, verifier: Verifier) -> tuple[float, float]:
    """E[τ+1] two ways: enumerating verifier coins, and averaging the analytic E[τ+1 | tree] over trees."""
    by_enumeration = sum(prob * len(out) for out, prob in emitted_law(pair, draft, verifier).items())

    def tree_value(rng):
        tree = draft(rng)
        p, q = pair.tree_rows(tree)
        return verifier.expected_block_efficiency(tree, p, q)

    analytic = sum(prob * value for prob, value in enumerate_runs(tree_value))
    return by_enumeration, analytic


def is_close(a: float, b: float, tol: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=0.0, abs_tol=tol)


@dataclass
class RealisticPair(ToyPair):
    """Prefix-dependent pair over a realistic vocabulary: peaked, long-tailed logits for the target, and the
    same logits plus noise for the draft, so p and q overlap partly (per-token acceptance ~0.5-0.8)."""

    noise: float = 1.0
    scale: float = 5.0

    def _random_dist(self, prefix: tuple[int, ...], which: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + prefix) % (2**62))
        logits = torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.scale
        if which == 1:
            logits = logits + torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.noise
        return torch.softmax(logits, dim=0)
