"""Layer 1b: the five known-wrong variants of algorithms.md §6(b), plus SpecTr-GBV's released rule (issue 31).
The harness must flag each one.

Each of the five changes one thing in a real verifier through the same hooks the real code uses. SpecTr-GBV is a
rule of its own (``spectr_gbv.py``) behind the same ``Verifier`` interface. If the harness ever passed one of them,
it would be too weak to trust on the real verifiers. Its exact counterexamples are in ``test_spectr_gbv.py``.
"""

from __future__ import annotations

import functools

import pytest

from decode.drafting.tree import Regime
from decode.verifiers.gbv import GreedyBlockVerifier
from decode.verifiers.ot import SpecInferVerifier, SpecTrVerifier
from decode.verifiers.otlp import SpecInferSolver, SpecTrSolver, spectr_rho
from decode.verifiers.traversal import TraversalState, TraversalVerifier
from tests.decode.exact.harness import ToyPair, emitted_law, sample_delayed, sample_without_replacement, stream_error
from tests.decode.verifiers.spectr_gbv import ReleasedSpecTrGBV

FLAGGED = 1e-6  # real verifiers stay below 1e-9; a biased one must be clearly above


class DedupSpecInferSolver(SpecInferSolver):
    """Wrong: drops duplicate draws, so a rejected token triggers one residual update instead of one per copy."""

    def _residual_chain(self, p, q, draws):
        yield from super()._residual_chain(p, q, list(dict.fromkeys(draws)))


class DedupSpecInfer(SpecInferVerifier):
    name = "specinfer-dedup"
    solver = DedupSpecInferSolver()


class LowRhoSpecTrSolver(SpecTrSolver):
    """Wrong: takes ρ a little below K-SEQ's root, so the residual goes negative and is clipped."""

    def rho(self, p, q, k):
        rho = spectr_rho(p, q, k)
        return max(1.0, rho - 0.02) if k > 1 else rho


class LowRhoSpecTr(SpecTrVerifier):
    name = "spectr-low-rho"
    solver = LowRhoSpecTrSolver()


class NoQUpdateState(TraversalState):
    """Wrong: keeps the rejected sibling's token in the parent's draft."""

    def _remove_token(self, q_un, q_mass, token):
        return q_un, q_mass


class TraversalWithoutQUpdate(TraversalVerifier):
    name = "traversal-no-q-update"
    state_cls = NoQUpdateState


class InconsistentTieGBV(GreedyBlockVerifier):
    """Wrong: the path choice breaks ties by draw order, while q̃ ranks ties by token id."""

    name = "gbv-inconsistent-ties"

    def select_child(self, children, tokens, keys):
        best = max(keys)
        return children[keys.index(best)]  # the first drawn among equal clipped ratios


class SpecInferOnWithoutReplacement(SpecInferVerifier):
    """Wrong: the with-replacement rule applied to siblings drawn without replacement."""

    name = "specinfer-on-wor"

    def supports(self, tree):
        return tree.regime in (Regime.IID, Regime.WITHOUT_REPLACEMENT)


def worst_error(verifier, drafts) -> float:
    worst = 0.0
    for pair, draft, length in drafts:
        worst = max(worst, stream_error(pair, emitted_law(pair, draft, verifier), length))
    return worst


def iid(shape, seeds=(1, 2, 3), vocab=3):
    out = []
    for seed in seeds:
        pair = ToyPair(vocab=vocab, seed=seed)
        out.append((pair, functools.partial(sample_delayed, pair, *shape), shape[1] + shape[2] + 1))
    return out


def wor(branching, seeds=(1, 2, 3)):
    out = []
    for seed in seeds:
        pair = ToyPair(vocab=3, seed=seed)
        out.append((pair, functools.partial(sample_without_replacement, pair, branching), len(branching) + 1))
    return out


CONTROLS = {
    "dedup-specinfer": (DedupSpecInfer(), iid((3, 0, 1)) + iid((2, 1, 1))),
    "spectr-rho-below-root": (LowRhoSpecTr(), iid((3, 0, 1)) + iid((2, 0, 2))),
    "traversal-without-q-update": (TraversalWithoutQUpdate(), iid((2, 0, 2)) + wor((2, 1))),
    "gbv-inconsistent-ties": (InconsistentTieGBV(), iid((2, 0, 2)) + iid((3, 0, 2), seeds=(1,))),
    "specinfer-on-wor-trees": (SpecInferOnWithoutReplacement(), wor((2, 1)) + wor((3,))),
    "spectr-gbv-released": (ReleasedSpecTrGBV(), iid((1, 0, 2), vocab=2) + iid((2, 0, 2))),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_negative_control_is_flagged(control):
    verifier, drafts = CONTROLS[control]
    assert worst_error(verifier, drafts) > FLAGGED


@pytest.mark.parametrize("control", list(CONTROLS))
def test_the_correct_counterpart_passes_the_same_cases(control):
    """Same trees, the real rule: so the flag above comes from the one change, not from the scenario."""
    from decode.verifiers import get_verifier

    counterpart = {
        "dedup-specinfer": "specinfer",
        "spectr-rho-below-root": "spectr",
        "traversal-without-q-update": "traversal",
        "gbv-inconsistent-ties": "gbv",
        "specinfer-on-wor-trees": "rsd",
        "spectr-gbv-released": "gbv",
    }[control]
    _, drafts = CONTROLS[control]
    assert worst_error(get_verifier(counterpart), drafts) < 1e-9

