"""Layer 2: statistical losslessness through the whole decoding loop on tiny random HF models.

The exact law of the first two generated tokens (enumerated with the target under the same sampling transform)
is compared with the empirical law of fixed-seed generations by a χ² test. A negative control, a verifier that
is handed a q other than the one the draft sampled from, must be caught by the same test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig, distributions
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.policies.base import EntropyStopPolicy, PolicySource, StaticPolicy
from decode.verifiers import get_verifier
from decode.verifiers.ot import SpecInferVerifier
from tests.factories import tiny_llama

VOCAB = 8
PROMPT = [3, 5, 2]
SAMPLES = 800
P_VALUE = 1e-4  # fixed seeds, so the outcome is deterministic; the threshold guards against an unlucky seed choice


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=11, vocab=VOCAB, layers=2, logit_scale=6.0)
    draft = tiny_llama(seed=12, vocab=VOCAB, layers=1, logit_scale=6.0)
    return target, draft


def exact_first_two(target, sampling: SamplingConfig) -> dict[tuple[int, int], float]:
    """P(first two tokens = (a, b)) under the target with the sampling transform, by enumeration."""
    with torch.inference_mode():
        first = distributions(target(torch.tensor([PROMPT])).logits[0, -1], sampling)
        batch = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        second = distributions(target(batch).logits[:, -1], sampling)
    return {(a, b): float(first[a] * second[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def empirical_first_two(decoder: SpeculativeDecoder, action: Action | PolicySource, sampling: SamplingConfig
                        ) -> dict[tuple[int, int], int]:
    """Counts of the first two tokens over SAMPLES generations, each step drafting ``action`` (or what the policy
    chooses)."""
    policy = action if isinstance(action, PolicySource) else StaticPolicy(action)
    counts: dict[tuple[int, int], int] = {}
    for seed in range(SAMPLES):
        tokens = decoder.generate(PROMPT, 2, policy, TorchRandom(seed), sampling).tokens
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


def chi2_p_value(exact: dict, counts: dict) -> float:
    """χ² goodness of fit, pooling cells whose expected count is below 5 into one."""
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    samples = sum(counts.values())
    total = sum(exact.values())  # 1 up to float32 rounding; scipy wants the sums to agree exactly
    for cell, prob in exact.items():
        e, o = prob / total * samples, counts.get(cell, 0)
        if e >= 5:
            observed.append(o)
            expected.append(e)
        else:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
    if pooled_e > 0.0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    assert set(counts) <= set(exact), "a sample the target cannot produce"
    return float(chisquare(observed, expected).pvalue)


CONFIGS = {"T1": SamplingConfig(1.0), "T0.5": SamplingConfig(0.5), "T1-top0.9": SamplingConfig(1.0, 0.9)}
ACTIONS = [Action(1, 4, 0), Action(4, 0, 2), Action(2, 1, 2)]
# the entropy stop rule (a single path of random length); the threshold stops it in some contexts only
ENTROPY_STOP = EntropyStopPolicy(max_length=4, threshold=0.8)


def cases():
    """Every verifier under every sampling configuration, and on every one of the issue's actions it takes.

    Each case costs SAMPLES generations (about 8 s), so the three factors are crossed pairwise, not fully: verifier
    i runs configuration c on its action (c + i) mod (its action count). A verifier taking all three actions gets
    a Latin square (each action once, each configuration once), and over the verifiers the shift i meets every
    action with every configuration. The full product at T = 1 is enumerated exactly through the same loop
    (tests/decode/exact/test_draft_vocab_loop.py, test_expander_loop.py)."""
    names = ["nss", "naive", "specinfer", "spectr", "rsd", "traversal", "gbv", "block"]
    for i, name in enumerate(names):
        taken = [action for action in ACTIONS if _takes(name, action)]
        for c, config in enumerate(CONFIGS):
            yield name, taken[(c + i) % len(taken)], config
        yield name, ENTROPY_STOP, "T1"


def _takes(name: str, action: Action) -> bool:
    """Whether verifier ``name`` is lossless on ``action``'s trees."""
    try:
        get_verifier(name).check_action(action)
    except ValueError:
        return False
    return True


def test_the_cases_cross_every_pair_of_factors():
    """Pairwise coverage: every verifier meets every configuration and every action it takes, and every action
    meets every configuration."""
    triples = [(n, a, c) for n, a, c in cases() if a is not ENTROPY_STOP]
    for name in {n for n, _, _ in triples}:
        assert {c for n, _, c in triples if n == name} == set(CONFIGS)
        assert {a for n, a, _ in triples if n == name} == {a for a in ACTIONS if _takes(name, a)}
    assert {(a, c) for _, a, c in triples} == {(a, c) for a in ACTIONS for c in CONFIGS}


@pytest.mark.parametrize(("name", "action", "config"), list(cases()), ids=lambda x: str(x))
def test_loop_is_lossless(pair, name, action, config):
    target, draft = pair
    sampling = CONFIGS[config]
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(draft), get_verifier(name))
    p_value = chi2_p_value(exact_first_two(target, sampling), empirical_first_two(decoder, action, sampling))
    assert p_value > P_VALUE, f"{name} {action} {config}: χ² p = {p_value:.2e}"


class UniformDraftSpecInfer(SpecInferVerifier):
    """Wrong: ignores the draft's distribution (q taken as uniform), though the tokens were drawn from q."""

    name = "specinfer"

    def verify(self, tree, p, q, rng):
        return super().verify(tree, p, torch.full_like(q, 1.0 / q.shape[-1]), rng)


def test_the_chi2_test_catches_a_mismatched_q(pair):
    target, draft = pair
    sampling = SamplingConfig(1.0)
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(draft), UniformDraftSpecInfer())
    p_value = chi2_p_value(exact_first_two(target, sampling), empirical_first_two(decoder, Action(1, 4, 0), sampling))
    assert p_value < P_VALUE


@pytest.mark.parametrize("name", ["specinfer", "traversal", "rsd"])
@pytest.mark.parametrize("config", ["T1", "T1-top0.9"])
def test_loop_with_the_fast_draft_forward_is_lossless(pair, name, config):
    """The decoder's default draft wrapper (decode.models.fast_llama) keeps the loop exact on delayed trees."""
    from decode.models.fast_llama import FastCachedLM

    target, draft = pair
    sampling = CONFIGS[config]
    decoder = SpeculativeDecoder(CachedLM(target), FastCachedLM(draft), get_verifier(name))
    p_value = chi2_p_value(exact_first_two(target, sampling), empirical_first_two(decoder, Action(2, 1, 2), sampling))
    assert p_value > P_VALUE, f"{name} fast draft {config}: χ² p = {p_value:.2e}"
