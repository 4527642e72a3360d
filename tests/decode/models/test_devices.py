"""The decoding path on every device present: tree attention and cache rollback against a plain recompute in
bfloat16, greedy equality with the target's own `generate`, and a χ² check of sampled output against the target's
exact joint law.

The CPU cases always run, so these tests are themselves checked here. The CUDA cases carry the `gpu` marker and skip
where no CUDA device is visible; `bash .ci/gpu` runs only them, on a GPU machine, with a one-line summary.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier, verifier_names
from tests.factories import tiny_llama

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="no CUDA device visible")])
DEVICES = ["cpu", CUDA]
# bfloat16 keeps 8 bits of mantissa: a cached tree pass and a plain recompute sum in different orders, and their
# logits differ by up to ~1 % of the largest logit here (on CPU: 0 for HF's forward, 0.4-0.8 % for ddte's fast draft
# forward; a wrong parent: 21 %). The bound is relative to the largest |logit| of the reference row.
BF16_TOL = 0.03
PROMPT = [5, 9, 3, 17, 22, 40, 2, 11]


def _recompute(lm: CachedLM, ids: list[int]) -> torch.Tensor:
    """``(V,)`` float32 logits after ``ids`` from one plain, cache-free forward."""
    with torch.inference_mode():
        return lm.model(torch.tensor([ids], device=lm.device)).logits[0, -1].float()


def _relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0))


@pytest.mark.parametrize("wrapper", [CachedLM, FastCachedLM], ids=["hf", "fast"])
@pytest.mark.parametrize("device", DEVICES)
def test_tree_attention_and_rollback_match_a_recompute_in_bf16(device, wrapper):
    lm = wrapper(tiny_llama(seed=3, vocab=64, hidden=64, layers=2, logit_scale=4.0), device, torch.bfloat16)
    lm.prefill(PROMPT)
    tip = lm.length - 1
    # two branches of two tokens under the tip: a, a->b and c, c->d (block order a, b, c, d)
    a, b, c, d = 30, 31, 32, 33
    logits = lm.extend_tree([a, b, c, d], [tip, -1, tip, -3])
    paths = [[a], [a, b], [c], [c, d]]
    for row, path in zip(logits, paths, strict=True):
        assert _relative_gap(row, _recompute(lm, PROMPT + path)) < BF16_TOL, path
    # negative control: b under the wrong parent is ~20 % away, so the tolerance tells paths apart
    assert _relative_gap(logits[1], _recompute(lm, PROMPT + [c, b])) > 5 * BF16_TOL
    base = tip + 1
    lm.commit([base + 2, base + 3])  # keep the branch c -> d, drop a -> b
    assert lm.length == len(PROMPT) + 2 and lm.committed == lm.length
    bonus = lm.extend([44], commit=True)[-1]
    assert _relative_gap(bonus, _recompute(lm, PROMPT + [c, d, 44])) < BF16_TOL
    lm.crop(len(PROMPT))  # linear rollback, then a different continuation
    again = lm.extend([45], commit=True)[-1]
    assert _relative_gap(again, _recompute(lm, PROMPT + [45])) < BF16_TOL


def _supported(name: str) -> list[Action]:
    """The test's trees that this verifier is lossless on."""
    verifier = get_verifier(name)
    return [a for a in (Action(2, 1, 2), Action(1, 4, 0), Action(3, 0, 2)) if verifier.supports_action(a.k, a.l1, a.l2)]


@pytest.mark.parametrize("name", verifier_names())
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_output_equals_the_targets_own_generate(device, name):
    """float32 on the device: every verifier at T = 0 reproduces the target's greedy continuation exactly, on every
    tree of the test it is lossless on."""
    target = CachedLM(tiny_llama(seed=1, vocab=64, hidden=64, layers=2), device, torch.float32)
    draft = CachedLM(tiny_llama(seed=2, vocab=64, hidden=32, layers=1), device, torch.float32)
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([PROMPT], device=target.device), max_new_tokens=20,
                                    min_new_tokens=20, do_sample=False)
    reference = out[0, len(PROMPT):].tolist()
    decoder = SpeculativeDecoder(target, draft, get_verifier(name))
    actions = _supported(name)
    assert actions
    for action in actions:
        gen = decoder.generate(PROMPT, 20, StaticPolicy(action), TorchRandom(0), SamplingConfig(0.0))
        assert gen.tokens == reference, action


def _exact_joint(lm: CachedLM, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """``(V, V)`` float64 law of the target's first two sampled tokens: p(x1) · p(x2 | x1)."""
    from decode.drafting.sampling import distributions

    first = distributions(_recompute(lm, prompt), sampling).double().cpu()
    rows = [distributions(_recompute(lm, prompt + [x]), sampling).double().cpu() for x in range(lm.vocab_size)]
    return first[:, None] * torch.stack(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_output_follows_the_target_law(device):
    """Traversal on a (2,0,1) tree, T = 1: the first two tokens of 2,000 generations against the target's exact joint
    law (χ², 36 cells, rare ones pooled). Negative control: the same counts are far from the draft's joint law."""
    from scipy.stats import chisquare

    vocab, prompt, sampling = 6, [1, 4, 2], SamplingConfig(1.0)
    target = CachedLM(tiny_llama(seed=5, vocab=vocab, hidden=32, logit_scale=3.0), device, torch.float32)
    draft = CachedLM(tiny_llama(seed=6, vocab=vocab, hidden=32, logit_scale=3.0), device, torch.float32)
    decoder = SpeculativeDecoder(target, draft, get_verifier("traversal"))
    counts = torch.zeros(vocab, vocab)
    drafted = 0
    for seed in range(2000):
        gen = decoder.generate(prompt, 2, StaticPolicy(Action(2, 0, 1)), TorchRandom(seed), sampling)
        counts[gen.tokens[0], gen.tokens[1]] += 1
        drafted += gen.stats.accepted_tokens
    assert drafted > 200  # the trees were drafted and partly accepted, not skipped
    cells = list(itertools.product(range(vocab), repeat=2))

    def p_value(joint: torch.Tensor) -> float:
        """χ² over the cells expected at least 5 times, the rarer ones pooled into one cell."""
        expected = {cell: 2000 * float(joint[cell]) / float(joint.sum()) for cell in cells}
        common = [cell for cell in cells if expected[cell] >= 5]
        rare = [cell for cell in cells if expected[cell] < 5]
        got = [float(counts[cell]) for cell in common] + ([sum(float(counts[cell]) for cell in rare)] if rare else [])
        want = [expected[cell] for cell in common] + ([sum(expected[cell] for cell in rare)] if rare else [])
        return chisquare(got, want).pvalue

    assert p_value(_exact_joint(target, prompt, sampling)) > 1e-3
    assert p_value(_exact_joint(draft, prompt, sampling)) < 1e-6
