"""Tiny random HF models for engine tests (built from config, never downloaded)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel


def tiny_llama(
    seed: int, vocab: int = 8, hidden: int = 32, layers: int = 1, logit_scale: float = 1.0
) -> PreTrainedModel:
    """A random Llama; ``logit_scale`` multiplies the output head so distributions are peaked, not near-uniform."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model
