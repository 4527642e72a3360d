"""Distillation data for a chat target: conversations from the training split only, the target's responses cached
once, the coarsened loss bounded by the full one, and a chat distillation end to end on a tiny pair."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen.chat_prompts import build_chat_prompts, shared_data_dir
from distill.chat_data import fixed_sequences, stream_of, target_responses
from distill.divergences import DIVERGENCES
from distill.module import coarsen
from tests.factories import chat_tokenizer, tiny_llama

needs_data = pytest.mark.skipif(not shared_data_dir().is_dir(), reason="../shared/data is not beside the checkout")


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_the_coarsened_divergence_is_a_lower_bound_and_exact_when_the_teacher_fits_its_top_k(name):
    """Data processing: never above the full divergence. Equal when p is zero outside its top k, for every
    divergence whose terms are linear in q where p = 0 (all but rkl, which is infinite there)."""
    g = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(3 * torch.randn(6, 50, generator=g), -1)
    log_q = torch.log_softmax(torch.randn(6, 50, generator=g), -1)
    top = log_p.topk(5, dim=-1).indices
    p_coarse, log_q_coarse = coarsen(log_p, log_q, top)
    assert torch.allclose(p_coarse.sum(-1), torch.ones(6)) and torch.allclose(log_q_coarse.exp().sum(-1), torch.ones(6))
    full, coarse = DIVERGENCES[name](log_p.exp(), log_q), DIVERGENCES[name](p_coarse, log_q_coarse)
    assert (coarse <= full + 1e-6).all() and (coarse < full - 1e-4).any()
    if name == "rkl":
        return
    peaked = torch.full((1, 50), -1e4)
    peaked[0, :5] = 0.0
    log_peaked = torch.log_softmax(peaked, -1)
    p_c, q_c = coarsen(log_peaked, log_q[:1], log_peaked.topk(5, dim=-1).indices)
    assert torch.allclose(DIVERGENCES[name](p_c, q_c), DIVERGENCES[name](log_peaked.exp(), log_q[:1]), atol=1e-5)


@needs_data
def test_training_sequences_come_from_the_training_split_only(tokenizer):
    heldout = {r["messages"][0]["content"] for r in build_chat_prompts("heldout")}
    sequences = fixed_sequences(tokenizer, "train")
    texts = [tokenizer.decode(s) for s in sequences[:300]]
    assert len(sequences) > 7000
    assert not any(f"<user>{h}</user>" in t for t in texts for h in list(heldout)[:200])
    assert all("<user>" in t and "<assistant>" in t for t in texts)
    stream = stream_of(sequences[:3], tokenizer.eos_token_id)
    assert int((stream == tokenizer.eos_token_id).sum()) >= 3


@needs_data
def test_target_responses_are_generated_once_then_read_from_the_cache(tokenizer, tmp_path):
    target = tiny_llama(1, vocab=4096, hidden=32, context=2048)
    first = target_responses(target, tokenizer, "fp", 2, 3, 1.0, tmp_path, log=lambda _: None)
    assert len(first) == 2 and all(1 <= len(r) <= 3 for r in first.values())
    (cached,) = tmp_path.glob("responses-*.json")
    assert json.loads(cached.read_text())["responses"] == first

    class NoGenerate:
        def generate(self, *args, **kwargs):
            raise AssertionError("a cached response set must not be generated again")

    assert target_responses(NoGenerate(), tokenizer, "fp", 2, 3, 1.0, tmp_path) == first
    weighted = fixed_sequences(tokenizer, "train", first, response_weight=3)
    prompts_with_response = [s for s in weighted if any(s[-len(r):] == r for r in first.values())]
    assert len(prompts_with_response) == 3 * 2
