"""Root features: the decoder's incremental bookkeeping equals a from-scratch recompute at every root."""

from __future__ import annotations

import pytest
import torch

from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig, distributions, entropy, law_entropy
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.policies.base import StaticPolicy
from decode.policies.features import SCALAR_NAMES, kl_divergence, root_features
from tests.factories import tiny_llama

LATENCY = LatencyTable([8, 64], [1, 16], [[0.5, 0.6], [0.7, 0.8]], [[2.0, 3.0], [4.0, 5.0]])


class RecordingPolicy(StaticPolicy):
    """A static policy that asks for root features and keeps them."""

    needs_root_features = True

    def __init__(self, action):
        super().__init__(action)
        self.roots = []

    def choose(self, root):
        self.roots.append(root)
        return super().choose(root)


def recompute(model, context, sampling):
    """(hidden, probs) at the previous and the root token, from a plain forward over the whole context."""
    with torch.inference_mode():
        out = model(torch.tensor([context]), output_hidden_states=True)
    hidden, probs = out.hidden_states[-1][0], distributions(out.logits[0], sampling)
    return hidden[-2], probs[-2], hidden[-1], probs[-1]


@pytest.mark.parametrize("prompt", [[3, 5, 7, 2], [3]], ids=["prompt4", "prompt1"])
@pytest.mark.parametrize("action", [Action(1, 3, 0), Action(3, 1, 2), Action(2, 0, 2)])
@pytest.mark.parametrize("noise_seed", [2, 3])
def test_incremental_features_equal_recompute(action, noise_seed, prompt):
    target = tiny_llama(seed=1, vocab=16, hidden=32, layers=2, logit_scale=3.0)
    draft = tiny_llama(seed=noise_seed, vocab=16, hidden=32, layers=1, logit_scale=3.0)
    sampling = SamplingConfig(1.0, 0.95)
    policy = RecordingPolicy(action)
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(draft), _verifier(), latency=LATENCY)
    gen = decoder.generate(prompt, 20, policy, TorchRandom(noise_seed), sampling)
    context = prompt + gen.tokens
    assert len(policy.roots) == gen.stats.steps > 1
    for root in policy.roots:
        assert root.sampling == sampling  # the request's own settings, at every root
        if root.context_length < 2:
            continue  # no previous token: zero states by definition
        ctx = context[: root.context_length]
        t_hidden_prev, p_prev, _, _ = recompute(target, ctx, sampling)
        d_hidden_prev, q_prev, d_hidden_root, q_root = recompute(draft, ctx, sampling)
        want = root_features(
            t_hidden_prev, d_hidden_prev, d_hidden_root, p_prev, q_prev, q_root, len(ctx), sampling,
            LATENCY.pass_times,
        )
        got = root.features
        for name in ("target_hidden_prev", "draft_hidden_prev", "draft_hidden_root", "scalars"):
            assert torch.allclose(getattr(got, name), getattr(want, name), atol=2e-4, rtol=1e-4), name


def _verifier():
    from decode.verifiers import get_verifier

    return get_verifier("traversal")


def test_feature_function_is_deterministic_and_named():
    g = torch.Generator().manual_seed(0)
    p, q, r = (torch.softmax(torch.randn(50, generator=g), 0) for _ in range(3))
    h = torch.randn(8, generator=g)
    args = (h, h[:4], h[4:], p, q, r, 37, SamplingConfig(0.7, 0.9), LATENCY.pass_times)
    a, b = root_features(*args), root_features(*args)
    assert torch.equal(a.scalars, b.scalars) and a.scalars.shape == (len(SCALAR_NAMES),)
    scalars = dict(zip(SCALAR_NAMES, a.scalars.tolist(), strict=True))
    assert scalars["entropy_p_prev"] == pytest.approx(float(entropy(p)), rel=1e-6)
    assert scalars["kl_p_q_prev"] == pytest.approx(float(kl_divergence(p, q)), rel=1e-5)
    assert scalars["context_length"] == 37 and scalars["top_p"] == pytest.approx(0.9)
    assert scalars["draft_ms"] == pytest.approx(LATENCY.draft(37))
    assert scalars["target_ms"] == pytest.approx(LATENCY.target(37))
    one_hot = torch.zeros(50)
    one_hot[3] = 1.0
    assert torch.isfinite(kl_divergence(one_hot, p)) and torch.isfinite(kl_divergence(p, one_hot))


def test_information_terms_match_their_definitions():
    """The (3, 3) cross-entropy product gives each entropy, both KLs and the L1 distance as defined term by term,
    including top-p zeros and identical laws (KL 0, never a rounding below it)."""
    g = torch.Generator().manual_seed(1)
    p, q, r = (torch.softmax(2 * torch.randn(4096, generator=g), 0) for _ in range(3))
    p[torch.argsort(p)[:3000]] = 0.0  # a top-p cut: most of p's support removed
    p = p / p.sum()
    h = torch.zeros(8)
    for q_prev in (q, p.clone()):
        got = root_features(h, h[:4], h[4:], p, q_prev, r, 9, SamplingConfig(1.0), LATENCY.pass_times)
        s = dict(zip(SCALAR_NAMES, got.scalars.tolist(), strict=True))
        for name, want in [("entropy_p_prev", entropy(p)), ("entropy_q_prev", entropy(q_prev)),
                           ("entropy_q_root", entropy(r)), ("kl_p_q_prev", kl_divergence(p, q_prev)),
                           ("kl_q_p_prev", kl_divergence(q_prev, p)), ("l1_p_q_prev", (p - q_prev).abs().sum())]:
            assert s[name] == pytest.approx(float(want), rel=1e-5, abs=1e-5), name
        assert s["kl_p_q_prev"] >= 0.0 and s["kl_q_p_prev"] >= 0.0
    assert s["kl_p_q_prev"] == pytest.approx(0.0, abs=1e-6) and s["l1_p_q_prev"] == 0.0  # second pass: q_prev = p


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_law_over_the_draft_vocabulary_is_the_full_law_cut_to_it(top_p):
    """The drafting loop's law over a draft vocabulary's ids (softmax and top-p over its Vs logits) holds the
    full-width law's values there, so its per-node entropy is the full law's; a law that misses an id is not."""
    generator = torch.Generator().manual_seed(3)
    support = torch.randperm(512, generator=generator)[:96].sort().values
    logits = torch.full((512,), float("-inf"))
    logits[support] = 3 * torch.randn(96, generator=generator)
    sampling = SamplingConfig(0.8, top_p)
    full, compact = distributions(logits, sampling), distributions(logits[support], sampling)  # (512,), (96,)
    outside = torch.ones(512, dtype=torch.bool)
    outside[support] = False
    # no mass off the support (compared directly: two sums of 512 and 96 floats may round apart by an ulp)
    assert torch.allclose(compact, full[support], atol=1e-7) and float(full[outside].abs().sum()) == 0.0
    assert law_entropy(compact) == pytest.approx(float(entropy(full)), rel=1e-5)
    assert law_entropy(full) == pytest.approx(float(entropy(full)), rel=1e-5)
    missing = full[support[support != int(full.argmax())]]
    assert law_entropy(missing) < float(entropy(full)) - 1e-3
