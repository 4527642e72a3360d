"""Layer 1d: on a realistic vocabulary (V = 4096), sampled verification rounds average to the exact E[τ+1 | tree]
within 4 standard errors, for every verifier on a tree of its regime."""

from __future__ import annotations

import math

import pytest

from decode.drafting.rng import TorchRandom
from decode.verifiers import get_verifier
from tests.decode.exact.harness import RealisticPair, sample_delayed, sample_without_replacement

PAIR = RealisticPair(vocab=4096, seed=11)
ROUNDS = 600

TREES = {
    "nss": lambda rng: sample_delayed(PAIR, 3, 1, 3, rng),
    "naive": lambda rng: sample_delayed(PAIR, 3, 1, 3, rng),
    "specinfer": lambda rng: sample_delayed(PAIR, 4, 0, 3, rng),
    "spectr": lambda rng: sample_delayed(PAIR, 3, 1, 3, rng),
    "traversal": lambda rng: sample_delayed(PAIR, 3, 2, 2, rng),
    "gbv": lambda rng: sample_delayed(PAIR, 3, 0, 4, rng),
    "block": lambda rng: sample_delayed(PAIR, 1, 5, 0, rng),
    "rsd": lambda rng: sample_without_replacement(PAIR, (3, 2, 1), rng),
}


@pytest.mark.parametrize("name", list(TREES))
def test_sampled_rounds_match_the_exact_expectation(name):
    """A fresh tree each round; d = (τ+1) - E[τ+1 | tree] must average to 0 within 4 standard errors."""
    verifier = get_verifier(name)
    rng = TorchRandom(1234)
    diffs, exacts = [], []
    for _ in range(ROUNDS):
        tree = TREES[name](rng)
        p, q = PAIR.tree_rows(tree)
        exact = verifier.expected_block_efficiency(tree, p, q)
        assert 1.0 - 1e-12 <= exact <= tree.max_depth + 1 + 1e-12
        diffs.append(len(verifier.verify(tree, p, q, rng).emitted) - exact)
        exacts.append(exact)
    mean = sum(diffs) / ROUNDS
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (ROUNDS - 1) / ROUNDS)
    assert se > 0.0, "a degenerate case proves nothing"
    assert max(exacts) - min(exacts) > 0.1, "the trees should differ in how much they accept"
    assert abs(mean) <= 4 * se, f"{name}: mean difference {mean:.4f} (se {se:.4f})"
