"""A draft with a draft vocabulary, through the real loop: laws over its support stay exactly lossless.

With a draft vocabulary the drafting loop (decode/drafting/delayed.py) asks the draft for its ``(n, Vs)`` logits only,
samples from laws of that width, maps each drawn index to its token id and widens the rows to ``(n, V)`` for the
verifier. Exact enumeration through :meth:`SpeculativeDecoder.generate` (tiny HF models, 3 tokens, the draft's
vocabulary {0, 2}): every verifier's law of the first three tokens must equal the target's, on a static delayed
tree and under a halting rule that reads the support law. Negative control, through the same hook: a loop that
takes the drawn index for the token id (skipping the map) must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import decode.drafting.delayed
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.models.draft_vocab import DraftVocab, attach_draft_vocab, support_ids
from decode.models.fast_llama import cached_lm
from decode.policies.base import StaticPolicy
from decode.policies.expander import HaltingPolicy
from decode.policies.files.expander_file import HaltingRule, NodeRule
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.test_expander_loop import (
    LATENCY,
    SAMPLING,
    TOL,
    VOCAB,
    law_error,
    loop_law,
    policy,
    splitting_threshold,
    target_law,
)
from tests.factories import tiny_llama

SUPPORT = (0, 2)


def reduced_pair(fast: bool = True, seed: int = 3) -> tuple[CachedLM, CachedLM]:
    """The tiny pair of test_expander_loop, its draft proposing only :data:`SUPPORT`."""
    target = CachedLM(tiny_llama(seed=seed, vocab=VOCAB, hidden=32, layers=2, logit_scale=3.0))
    model = tiny_llama(seed=seed + 100, vocab=VOCAB, hidden=16, layers=1, logit_scale=3.0)
    attach_draft_vocab(model, DraftVocab(torch.tensor(SUPPORT), VOCAB))
    return target, cached_lm(model) if fast else CachedLM(model)


def _shape(name: str) -> Action:
    """A delayed tree the verifier takes: branching where it can, else a chain."""
    return Action(2, 1, 1) if get_verifier(name).supports_action(2, 1, 1) else Action(1, 2, 0)


def test_the_draft_hands_over_laws_on_its_support():
    _, draft = reduced_pair()
    draft.prefill([2, 0, 1])
    assert support_ids(draft.model).tolist() == list(SUPPORT)
    compact, full = draft.extend_tree([0], [2], on_support=True), draft.extend_tree([0], [2])
    assert compact.shape == (1, len(SUPPORT)) and full.shape == (1, VOCAB)
    assert torch.allclose(compact, full[:, list(SUPPORT)], atol=1e-6) and bool(torch.isneginf(full[:, 1]).all())


@pytest.mark.slow
@pytest.mark.parametrize("name", verifier_names())
def test_a_static_tree_over_the_support_is_lossless(name):
    target, draft = reduced_pair()
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    got, _ = loop_law(decoder, StaticPolicy(_shape(name)))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, target_law(target)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fast"), [("specinfer", True), ("traversal", True), ("traversal", False)])
def test_halting_on_the_support_law_is_lossless(name, fast):
    target, draft = reduced_pair(fast)
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    shape = _shape(name)
    bounds = HaltingRule(0.0, 0, shape.l1, shape.k, shape.l2)
    rule = HaltingRule(splitting_threshold(decoder, "top", bounds), 0, shape.l1, shape.k, shape.l2)
    got, shapes = loop_law(decoder, policy("top", rule))
    assert len({Action.parse(s.strip("()")).l1 for s in shapes}) >= 2, f"the trunk never halted early: {shapes}"
    assert law_error(got, target_law(target)) < TOL


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_loop_that_skips_the_token_map_is_caught(name, monkeypatch):
    """Index i of a law over {0, 2} read as token i: the draft then proposes 0 and 1, while q says 0 and 2."""
    target, draft = reduced_pair()
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    monkeypatch.setattr(decode.drafting.delayed, "token_id", lambda support, index: index)
    got, _ = loop_law(decoder, StaticPolicy(Action(1, 1, 0)))
    assert law_error(got, target_law(target)) > 100 * TOL
    monkeypatch.undo()  # the same case with the real map
    got, _ = loop_law(decoder, StaticPolicy(Action(1, 1, 0)))
    assert law_error(got, target_law(target)) < TOL


def test_the_halting_signal_reads_the_support_law():
    """At every trunk node the policy sees a law of the support's width that sums to one."""
    target, draft = reduced_pair()
    seen: list[torch.Tensor] = []

    class Spy(HaltingPolicy):
        def halts(self, node):
            seen.append(node.q)
            return super().halts(node)

        def start(self, sampling):
            return self

    spy = Spy(NodeRule(1.0, 1.0, "top", "1,0,0", HaltingRule(0.5, 0, 2, 1, 0)))
    decoder = SpeculativeDecoder(target, draft, get_verifier("traversal"), latency=LATENCY)
    decoder.generate([2, 0, 1], 6, spy, TorchRandom(0), SAMPLING)
    assert seen and all(q.shape == (len(SUPPORT),) for q in seen)
    assert np.allclose([float(q.sum()) for q in seen], 1.0, atol=1e-6)
