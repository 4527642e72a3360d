"""A draft on a quantized kernel path (decode/models/kernels.py: ``int8-dynamic``, ``int8-weight``) stays exactly
lossless through the real loop, on the fast forward and on HF's.

A quantized pass is another q: the loop samples from the law of the pass it ran and hands that same law to the
verifier. Exact enumeration through :meth:`SpeculativeDecoder.generate` (tiny HF models, 3 tokens): every
verifier's law of the first three tokens must equal the target's, for every quantized path, with trunks and
branches. Negative control: a loop that samples from the quantized law but shows the verifier the law of the same
node on the default path (as if the verifier were handed "the draft's q" computed apart) must be caught; the real
loop passes the same case.
"""

from __future__ import annotations

import pytest
import torch

from decode.batch import BatchDecoder
from decode.drafting.actions import Action
from decode.drafting.delayed import DraftedTree
from decode.drafting.sampling import distributions
from decode.drafting.tree import ROOT
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM, cached_lm
from decode.models.kernels import KERNEL_PATHS
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


QUANTIZED = [name for name, path in KERNEL_PATHS.items() if not path.exact]


def int8_pair(path: str, seed: int = 3, fast: bool = True) -> tuple[CachedLM, CachedLM]:
    target = CachedLM(tiny_llama(seed=seed, vocab=VOCAB, hidden=32, layers=2, logit_scale=3.0))
    draft = cached_lm(outlier_draft(seed + 100), fast=fast)
    draft.use_kernel(path)
    return target, draft


def _shape(name: str) -> Action:
    """A delayed tree the verifier takes (a branch pass of two tokens after a one-token trunk), else a chain."""
    return Action(2, 1, 2) if get_verifier(name).supports_action(2, 1, 2) else Action(1, 3, 0)


@pytest.mark.parametrize("path", QUANTIZED)
def test_int8_layers_change_q_but_not_much(path):
    """The quantized passes give another law (else the tests below would prove nothing) close to the plain one."""
    plain, quant = FastCachedLM(outlier_draft(103)), FastCachedLM(outlier_draft(103), kernel=path)
    a, b = plain.prefill([2, 0, 1]), quant.prefill([2, 0, 1])
    assert 1e-3 < float((a.softmax(-1) - b.softmax(-1)).abs().max()) < 0.5


@pytest.mark.slow
@pytest.mark.parametrize("path", QUANTIZED)
@pytest.mark.parametrize("name", verifier_names())
def test_an_int8_draft_is_lossless(name, path):
    target, draft = int8_pair(path)
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    got, _ = loop_law(decoder, StaticPolicy(_shape(name)))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, target_law(target)) < TOL


class MislabelledStep(BatchDecoder):
    """Wrong: draws the tree from the quantized draft, then shows the verifier each drafted node's law (the root's
    included) on the default path, recomputed from the whole sequence, not the law its children were drawn from."""

    def _draft_trees(self, live, q_roots, actions):
        drafted = super()._draft_trees(live, q_roots, actions)
        return {rid: self._mislabelled(r, drafted[rid]) for rid, r in live.items()}

    def _mislabelled(self, r, drafted: DraftedTree) -> DraftedTree:
        lm, tree, q = self.draft.lm, drafted.tree, drafted.q.clone()
        context, path = [*r.job.prompt_ids, *r.tokens], lm.kernel
        lm.use_kernel("default")
        try:
            for v in range(tree.num_nodes):
                if drafted.slots[v] < 0:
                    continue  # a leaf: nothing was drawn from it
                with torch.inference_mode():
                    logits = lm.model(torch.tensor([context + _tokens_to(tree, v)])).logits[0, -1].float()
                q[v] = distributions(logits, r.job.sampling)
        finally:
            lm.use_kernel(path)
        return DraftedTree(tree, q, drafted.slots, drafted.draft_calls, drafted.hidden, drafted.trunk_depth)


class MislabelledDecoder(SpeculativeDecoder):
    step_class = MislabelledStep


def _tokens_to(tree, v: int) -> list[int]:
    """The tokens of the path from the root (excluded) down to node ``v``."""
    tokens = []
    while v != ROOT:
        tokens.append(tree.tokens[v])
        v = tree.parents[v]
    return tokens[::-1]


@pytest.mark.parametrize("fast", [True, False], ids=["fast-forward", "hf-forward"])
@pytest.mark.parametrize("path", QUANTIZED)
@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_verifier_shown_the_unquantized_q_is_caught(name, path, fast):
    target, draft = int8_pair(path, fast=fast)
    shape = Action(1, 2, 0)
    got, _ = loop_law(MislabelledDecoder(target, draft, get_verifier(name), latency=LATENCY), StaticPolicy(shape))
    assert law_error(got, target_law(target)) > 10 * TOL  # measured 11-68x TOL; the real loop stays below TOL
    got, _ = loop_law(SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY), StaticPolicy(shape))
    assert law_error(got, target_law(target)) < TOL


@pytest.mark.parametrize("path", QUANTIZED)
def test_a_seeded_request_on_an_int8_draft_gives_the_same_tokens_alone_and_in_a_batch(path):
    """A quantized draft's q of one request must not depend on the other requests' rows in the same pass (a dynamic
    scale over the whole batch would): seeded, its tokens alone and beside companions of very different activations
    are the same."""
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from tests.decode.exact.test_batch import Entry, drive, job

    target, draft = int8_pair(path)
    sampling, prompt, tokens = SamplingConfig(1.0), [2, 0, 1], 12
    differs = 0
    for seed in range(8):
        alone = SpeculativeDecoder(target, draft, get_verifier("traversal")).generate(
            prompt, tokens, StaticPolicy(Action(2, 1, 1)), TorchRandom(seed), sampling).tokens
        batched = drive(BatchDecoder(target, draft), [
            Entry(job([1, 1, 1, 1, 1], 6, "specinfer", SamplingConfig(0.6), TorchRandom(100 + seed))),
            Entry(job(prompt, tokens, "traversal", sampling, TorchRandom(seed))),
            Entry(job([0], 8, "traversal", SamplingConfig(1.2, 0.9), TorchRandom(200 + seed)), at=1),
        ])[1]
        differs += list(batched) != alone
    assert differs == 0, f"{differs} of 8 seeded requests drew otherwise beside others"
