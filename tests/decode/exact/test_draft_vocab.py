"""A draft with a reduced output vocabulary (FR-Spec, decode/models/draft_vocab.py) stays exactly lossless.

The draft's q comes out of the product's own :func:`decode.models.draft_vocab.expand_logits` (``-inf`` outside the set),
so it puts zero mass on the tokens the draft can never propose; the target p puts mass everywhere. Every
verifier, on every regime it claims, must still emit the target's law (stream criterion): the residual carries
p's mass on the missing tokens.

Negative control: the target's law cut to the draft's vocabulary too (as if the reduced token map were applied
to the target's logits as well, a tempting "consistency" fix). The harness must flag it; the real rule passes
the same cases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from decode.drafting.tree import Regime
from decode.models.draft_vocab import DraftVocab, expand_logits
from decode.verifiers import get_verifier, verifier_names
from decode.verifiers.traversal import TraversalVerifier
from tests.decode.exact.harness import (
    ToyPair,
    check_total_mass,
    emitted_law,
    sample_delayed,
    sample_without_replacement,
    stream_error,
)

TOL = 1e-9


@dataclass
class ReducedDraftPair(ToyPair):
    """A :class:`ToyPair` whose draft proposes only ``draft_tokens``: q = softmax of its logits over that set,
    expanded to the full vocabulary by the product's function."""

    draft_tokens: tuple[int, ...] = (0, 1)

    def _make(self, prefix: tuple[int, ...], which: str) -> torch.Tensor:
        law = super()._make(prefix, which)
        if which == "p":
            return law
        vocab = DraftVocab(torch.tensor(self.draft_tokens), self.vocab)
        logits = expand_logits(law[vocab.token_ids].log(), vocab.token_ids, self.vocab)  # (V,), -inf outside
        return torch.softmax(logits, dim=-1)


PAIRS = {
    "v3-draft01": ReducedDraftPair(vocab=3, seed=1, draft_tokens=(0, 1)),
    "v3-draft2": ReducedDraftPair(vocab=3, seed=2, draft_tokens=(2,)),  # a one-token draft vocabulary
    "v4-draft13": ReducedDraftPair(vocab=4, seed=5, draft_tokens=(1, 3)),
}
DELAYED = [(2, 0, 2), (2, 1, 1), (1, 2, 0), (3, 0, 1)]


def _error(pair, draft, verifier) -> float:
    law = emitted_law(pair, draft, verifier)
    assert check_total_mass(law) < 1e-12
    return stream_error(pair, law, max(len(out) for out in law))


def test_the_draft_puts_no_mass_outside_its_vocabulary():
    pair = PAIRS["v4-draft13"]
    for prefix in [(), (1,), (3, 1)]:
        q = pair.dist(prefix, "q")
        assert float(q[[0, 2]].sum()) == 0.0 and abs(float(q.sum()) - 1.0) < 1e-12
        assert float(pair.dist(prefix, "p")[[0, 2]].sum()) > 0.0  # the target does write those tokens


def _cases():
    """Every verifier that drafts i.i.d. trees, on every delayed shape it claims (its own supports_action)."""
    for name in verifier_names():
        verifier = get_verifier(name)
        if verifier.draft_regime != Regime.IID:
            continue  # RSD drafts without replacement: the next test
        for pair_name in PAIRS:
            yield from ((pair_name, shape, name) for shape in DELAYED if verifier.supports_action(*shape))


@pytest.mark.parametrize(("pair_name", "shape", "name"), list(_cases()))
def test_lossless_with_a_reduced_draft_vocabulary(pair_name, shape, name):
    pair = PAIRS[pair_name]
    assert _error(pair, functools.partial(sample_delayed, pair, *shape), get_verifier(name)) < TOL


@pytest.mark.parametrize("name", ["nss", "rsd", "traversal"])
def test_lossless_without_replacement_with_a_reduced_draft_vocabulary(name):
    pair = PAIRS["v4-draft13"]  # two draft tokens: the branching node can draw both
    assert _error(pair, functools.partial(sample_without_replacement, pair, (2, 1)), get_verifier(name)) < TOL


class TargetCutToDraftVocab(TraversalVerifier):
    """Negative control: verifies against p restricted (and renormalised) to the draft's vocabulary."""

    name = "traversal-target-cut-to-draft-vocab"

    def __init__(self, draft_tokens: tuple[int, ...]) -> None:
        super().__init__()
        self.draft_tokens = list(draft_tokens)

    def _verify(self, tree, p, q, rng):
        cut = torch.zeros_like(p)
        cut[:, self.draft_tokens] = p[:, self.draft_tokens]
        return super()._verify(tree, cut / cut.sum(-1, keepdim=True), q, rng)


def test_negative_control_target_cut_to_the_draft_vocabulary_is_flagged():
    pair = PAIRS["v3-draft01"]
    draft = functools.partial(sample_delayed, pair, 2, 0, 2)
    assert _error(pair, draft, TargetCutToDraftVocab(pair.draft_tokens)) > 1e-3
    assert _error(pair, draft, get_verifier("traversal")) < TOL  # the same case, the real rule
