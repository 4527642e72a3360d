"""A draft with int8 weight-only layers (decode/models/fast_llama.py, ``int8=``) stays exactly lossless through the
real loop.

A quantized pass is another q: the loop samples from the law of the pass it ran and hands that same law to the
verifier. Exact enumeration through :meth:`SpeculativeDecoder.generate` (tiny HF models, 3 tokens): every
verifier's law of the first three tokens must equal the target's, with int8 in one-token passes (the trunk) and in
every pass (branches too). Negative control: a loop that samples from the int8 law but shows the verifier the law
of the same node under the unquantized weights (as if the verifier were handed "the draft's q" computed apart)
must be caught; the real loop passes the same case.
"""

from __future__ import annotations

import pytest
import torch

from decode.drafting.actions import Action
from decode.drafting.delayed import DraftedTree
from decode.drafting.sampling import distributions
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM, int8_weight
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.test_expander_loop import LATENCY, TOL, VOCAB, law_error, loop_law, target_law
from tests.factories import tiny_llama


def outlier_draft(seed: int):
    """A tiny draft whose layer matrices each hold one large column: per-channel int8 then rounds the rest coarsely,
    so the quantized law differs from the plain one by far more than float noise."""
    model = tiny_llama(seed=seed, vocab=VOCAB, hidden=16, layers=1, logit_scale=3.0)
    with torch.no_grad():
        for name, param in model.model.layers.named_parameters():
            if name.endswith("proj.weight"):
                param[:, 0] *= 400.0
    return model


def int8_pair(mode: str, seed: int = 3) -> tuple[CachedLM, FastCachedLM]:
    target = CachedLM(tiny_llama(seed=seed, vocab=VOCAB, hidden=32, layers=2, logit_scale=3.0))
    return target, FastCachedLM(outlier_draft(seed + 100), int8=mode)


def _shape(name: str) -> Action:
    """A delayed tree the verifier takes (a branch pass of two tokens after a one-token trunk), else a chain."""
    return Action(2, 1, 2) if get_verifier(name).supports_action(2, 1, 2) else Action(1, 3, 0)


def test_int8_layers_change_q_but_not_much():
    """The quantized passes give another law (else the tests below would prove nothing) close to the plain one."""
    weight = torch.randn(12, 16)
    q, scale = int8_weight(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert torch.allclose(scale[:, None] * q.float(), weight, atol=float(scale.max()) / 2 + 1e-6)
    plain, quant = (FastCachedLM(outlier_draft(103), int8=m) for m in ("none", "all"))
    a, b = plain.prefill([2, 0, 1]), quant.prefill([2, 0, 1])
    assert 1e-3 < float((a.softmax(-1) - b.softmax(-1)).abs().max()) < 0.5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single", "all"])
@pytest.mark.parametrize("name", verifier_names())
def test_an_int8_draft_is_lossless(name, mode):
    target, draft = int8_pair(mode)
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    got, _ = loop_law(decoder, StaticPolicy(_shape(name)))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, target_law(target)) < TOL


class MislabelledDecoder(SpeculativeDecoder):
    """Wrong: draws the tree from the int8 draft, then shows the verifier each drafted node's law (the root's
    included) under the plain weights, recomputed over the same cache, not the law its children were drawn from."""

    def _draft_tree(self, request, q_root, action) -> DraftedTree:
        drafted = super()._draft_tree(request, q_root, action)
        draft, tree, q = self.draft, drafted.tree, drafted.q.clone()
        mode, draft.int8 = draft.int8, "none"
        try:
            for v in range(tree.num_nodes):
                if drafted.slots[v] < 0:
                    continue  # a leaf: nothing was drawn from it
                parent = draft.parent_of(drafted.slots[v]) if v == 0 else drafted.slots[tree.parents[v]]
                length = draft.length
                logits = draft.extend_tree([tree.tokens[v]], [parent])
                draft.crop(length)
                q[v] = distributions(logits, request.sampling)[0]
        finally:
            draft.int8 = mode
        return DraftedTree(tree, q, drafted.slots, drafted.draft_calls, drafted.hidden, drafted.trunk_depth)


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_verifier_shown_the_unquantized_q_is_caught(name):
    target, draft = int8_pair("all")
    shape = Action(1, 2, 0)
    got, _ = loop_law(MislabelledDecoder(target, draft, get_verifier(name), latency=LATENCY), StaticPolicy(shape))
    assert law_error(got, target_law(target)) > 100 * TOL
    got, _ = loop_law(SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY), StaticPolicy(shape))
    assert law_error(got, target_law(target)) < TOL
