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
from dataclasses import dataclass

import torch

from bench.synthetic_pair import SyntheticPair, draft_delayed, draft_without_replacement
from decode.drafting.tree import DraftTree
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
class ToyPair(SyntheticPair):
    """Prefix-dependent random target p and draft q over a 2-3 token vocabulary (float64).

    With ``context_free`` the same (p0, q0) is used after every prefix (for the closed-form oracles).
    ``zero_prob`` sets each entry to zero with that probability (at least one entry stays positive), to
    exercise tokens that one model never produces.
    """

    p0: Sequence[float] | None = None
    q0: Sequence[float] | None = None
    zero_prob: float = 0.0

    @classmethod
    def context_free(cls, p0: Sequence[float], q0: Sequence[float]) -> ToyPair:
        return cls(vocab=len(p0), p0=p0, q0=q0)

    def _make(self, prefix: tuple[int, ...], which: str) -> torch.Tensor:
        if self.p0 is not None:
            return torch.tensor(self.p0 if which == "p" else self.q0, dtype=torch.float64)
        g = torch.Generator().manual_seed(hash((self.seed, 0 if which == "p" else 1) + prefix) % (2**62))
        v = torch.rand(self.vocab, generator=g, dtype=torch.float64) ** 2 + 0.02
        if self.zero_prob > 0.0:
            keep = torch.rand(self.vocab, generator=g, dtype=torch.float64) >= self.zero_prob
            keep[int(torch.argmax(v))] = True
            v = v * keep
        return v / v.sum()

    def prefix_prob(self, tokens: Sequence[int], start: int = 0) -> float:
        """Target probability of ``tokens[start:]`` given ``tokens[:start]``: Π_{j >= start} p(s_j | s_<j)."""
        prob = 1.0
        for j in range(start, len(tokens)):
            prob *= float(self.dist(tuple(tokens[:j]), "p")[tokens[j]])
        return prob


def sample_delayed(pair: SyntheticPair, k: int, l1: int, l2: int, rng) -> DraftTree:
    return draft_delayed(pair.next_q, k, l1, l2, rng)


def sample_without_replacement(pair: SyntheticPair, branching: Sequence[int], rng) -> DraftTree:
    return draft_without_replacement(pair.next_q, branching, rng)


# --- the stream criterion -------------------------------------------------------------------------------------
def emitted_law(pair: ToyPair, draft: Callable, verifier: Verifier) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one round emits (accepted + extra), over drafting and verification."""

    def run(rng):
        tree = draft(rng)
        p, q = pair.tree_rows(tree)
        return verifier.verify(tree, p, q, rng).emitted

    return outcome_law(enumerate_runs(run))


def stream_law(pair: ToyPair, law: dict[tuple[int, ...], float], length: int) -> dict[tuple[int, ...], float]:
    """P(first M tokens = s) for every string s of length M, continuing each round with p (algorithms.md §1.3)."""
    out_law = {}
    for s in itertools.product(range(pair.vocab), repeat=length):
        got = 0.0
        for out, prob in law.items():
            if len(out) <= length and s[: len(out)] == out:
                got += prob * pair.prefix_prob(s, start=len(out))
            elif len(out) > length and out[:length] == s:
                got += prob
        out_law[s] = got
    return out_law


def stream_error(pair: ToyPair, law: dict[tuple[int, ...], float], length: int) -> float:
    """max_s |P(first M tokens = s) - Π p(s)| over all strings s of length M, continuing each round with p."""
    return max(abs(got - pair.prefix_prob(s)) for s, got in stream_law(pair, law, length).items())


def stream_tv(pair: ToyPair, law: dict[tuple[int, ...], float], length: int) -> float:
    """Total variation between the law of the first M tokens (as in :func:`stream_error`) and the target's."""
    return 0.5 * sum(abs(got - pair.prefix_prob(s)) for s, got in stream_law(pair, law, length).items())


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


RealisticPair = SyntheticPair  # peaked, long-tailed logits for realistic vocabularies


def recomputed_law(target, prompt: list[int], length: int, vocab: int, sampling) -> dict[tuple[int, ...], float]:
    """P(first ``length`` tokens = s) under a CachedLM ``target`` after ``prompt``, by plain full recomputes (the
    reference a loop's enumerated law must equal)."""
    from decode.drafting.sampling import distributions

    law = {}
    with torch.inference_mode():
        for s in itertools.product(range(vocab), repeat=length):
            prob = 1.0
            for j in range(length):
                logits = target.model(torch.tensor([prompt + list(s[:j])])).logits[0, -1]
                prob *= float(distributions(logits.double(), sampling)[s[j]])
            law[s] = prob
    return law
