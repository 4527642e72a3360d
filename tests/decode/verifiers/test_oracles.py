"""Layer 1c: the closed-form oracle values of algorithms.md §6 (context-free toy p = (1/3, 2/3), q = (2/3, 1/3)),
reproduced by the exact-expectation functions and by enumerating the verifiers' own coins."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from decode.verifiers import get_verifier
from decode.verifiers.otlp import NaiveSolver, NSSSolver, SpecInferSolver, SpecTrSolver, spectr_rho
from tests.decode.exact.harness import ToyPair, enumerate_runs, exact_block_efficiency, outcome_law, sample_delayed

P0, Q0 = (1 / 3, 2 / 3), (2 / 3, 1 / 3)
PAIR = ToyPair.context_free(P0, Q0)

# k -> (α NSS, α Naive, α SpecTr, α SpecInfer, ρ*)
ACCEPTANCE = {
    1: (0.444444, 0.666667, 0.666667, 0.666667, 1.000000),
    2: (0.666667, 0.777778, 0.811420, 0.777778, 1.434259),
    3: (0.790123, 0.851852, 0.896576, 0.851852, 1.689729),
    4: (0.864198, 0.901235, 0.944703, 0.901235, 1.834110),
}

# (K, L1, L2) -> E[τ+1] for NSS, NaiveTree, SpecInfer, SpecTr, Traversal, GBV, BV on the first path
BLOCK_EFFICIENCY = {
    (1, 0, 2): (1.641975, 2.111111, 2.111111, 2.111111, 2.222222, 2.222222, 2.222222),
    (2, 0, 2): (2.012346, 2.333333, 2.333333, 2.405487, 2.419753, 2.617284, 2.222222),
    (3, 0, 2): (2.249809, 2.491084, 2.491084, 2.593306, 2.558299, 2.768176, 2.222222),
    (2, 1, 1): (1.740741, 2.185185, 2.185185, 2.207613, 2.259259, None, 2.222222),
    (4, 0, 3): (2.705947, 3.112398, 3.112398, 3.283624, 3.281504, 3.272235, 2.666667),
    (2, 2, 2): (1.841945, 2.703704, 2.703704, 2.735772, 3.117970, None, 3.049383),
}
COLUMNS = ("nss", "naive", "specinfer", "spectr", "traversal", "gbv")
TABLE_TOL = 1e-6  # the tables are printed to 6 decimals


def acceptance_by_branching(solver, k: int) -> float:
    """α = P(output ∈ draws) = Σ over ordered draws of P(draws) Σ_{t ∈ draws} B(t)."""
    p, q = torch.tensor(P0, dtype=torch.float64), torch.tensor(Q0, dtype=torch.float64)
    total = 0.0
    for draws in itertools.product(range(2), repeat=k):
        prob = math.prod(Q0[t] for t in draws)
        total += prob * sum(solver.branching(p, q, list(draws)).values())
    return total


def acceptance_by_sampling(solver, k: int) -> float:
    """α by enumerating the draws and the solver's own coins."""
    p, q = torch.tensor(P0, dtype=torch.float64), torch.tensor(Q0, dtype=torch.float64)

    def run(rng):
        draws = [rng.categorical(q) for _ in range(k)]
        return solver.sample(p, q, draws, rng) in draws

    return outcome_law(enumerate_runs(run)).get(True, 0.0)


@pytest.mark.parametrize("k", list(ACCEPTANCE))
@pytest.mark.parametrize(
    ("column", "solver"), [(0, NSSSolver()), (1, NaiveSolver()), (2, SpecTrSolver()), (3, SpecInferSolver())]
)
def test_acceptance_rates(k, column, solver):
    want = ACCEPTANCE[k][column]
    assert acceptance_by_branching(solver, k) == pytest.approx(want, abs=TABLE_TOL)
    assert acceptance_by_sampling(solver, k) == pytest.approx(want, abs=TABLE_TOL)


@pytest.mark.parametrize("k", list(ACCEPTANCE))
def test_spectr_rho_star(k):
    p, q = torch.tensor(P0, dtype=torch.float64), torch.tensor(Q0, dtype=torch.float64)
    rho = spectr_rho(p, q, k)
    assert rho == pytest.approx(ACCEPTANCE[k][4], abs=TABLE_TOL)
    # Feasible side: the K-SEQ residual p - γ min(p/ρ, q) has no negative entry.
    capped = torch.minimum(p / rho, q)
    beta = float(capped.sum())
    gamma = (1 - (1 - beta) ** k) / beta
    assert float((p - gamma * capped).min()) >= -1e-15


def _closed_form_nss(k: int, l1: int, l2: int) -> float:
    """algorithms.md §6, item 6: NSS on a delayed tree with context-free p, q."""
    total = 0.0
    for i in range(l1 + l2 + 1):
        for xs in itertools.product(range(2), repeat=i):
            big_p = math.prod(P0[t] for t in xs)
            if i <= l1:
                pi = math.prod(Q0[t] for t in xs)
            else:
                trunk = math.prod(Q0[t] for t in xs[:l1])
                pi = trunk * (1 - (1 - math.prod(Q0[t] for t in xs[l1:])) ** k)
            total += big_p * pi
    return total


@pytest.mark.parametrize("shape", list(BLOCK_EFFICIENCY))
@pytest.mark.parametrize("column", range(len(COLUMNS)))
def test_block_efficiency_table(shape, column):
    want = BLOCK_EFFICIENCY[shape][column]
    if want is None:
        pytest.skip("GBV is defined on root paths only")
    draft = functools.partial(sample_delayed, PAIR, *shape)
    by_enumeration, analytic = exact_block_efficiency(PAIR, draft, get_verifier(COLUMNS[column]))
    assert analytic == pytest.approx(want, abs=TABLE_TOL)
    assert by_enumeration == pytest.approx(analytic, abs=1e-12)


@pytest.mark.parametrize("shape", list(BLOCK_EFFICIENCY))
def test_block_verification_on_the_first_path(shape):
    verifier = get_verifier("block")

    def run(rng):
        tree = sample_delayed(PAIR, *shape, rng).first_path()
        p, q = PAIR.tree_rows(tree)
        return verifier.expected_block_efficiency(tree, p, q)

    value = sum(prob * v for prob, v in enumerate_runs(run))
    assert value == pytest.approx(BLOCK_EFFICIENCY[shape][6], abs=TABLE_TOL)


@pytest.mark.parametrize("shape", list(BLOCK_EFFICIENCY))
def test_nss_closed_form(shape):
    draft = functools.partial(sample_delayed, PAIR, *shape)
    _, analytic = exact_block_efficiency(PAIR, draft, get_verifier("nss"))
    assert analytic == pytest.approx(_closed_form_nss(*shape), abs=1e-12)


def test_single_path_sd_closed_form():
    """§6.1: context-free standard SD, E[τ+1] = (1 - α^{L+1}) / (1 - α) with α = 1 - TV = 2/3."""
    alpha = 2 / 3
    for length in range(5):
        draft = functools.partial(sample_delayed, PAIR, 1, length, 0)
        _, analytic = exact_block_efficiency(PAIR, draft, get_verifier("naive"))
        assert analytic == pytest.approx((1 - alpha ** (length + 1)) / (1 - alpha), abs=1e-12)


def test_block_beats_token_verification_on_the_bv_toy():
    """BV toy (algorithms.md §2.3): L = 2 gives E[τ] token-wise 10/9, BV 11/9."""
    draft = functools.partial(sample_delayed, PAIR, 1, 2, 0)
    assert exact_block_efficiency(PAIR, draft, get_verifier("naive"))[1] == pytest.approx(1 + 10 / 9, abs=1e-12)
    assert exact_block_efficiency(PAIR, draft, get_verifier("block"))[1] == pytest.approx(1 + 11 / 9, abs=1e-12)
