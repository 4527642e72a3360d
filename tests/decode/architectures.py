"""Tiny random configs of every HF architecture ddte is tested on (tests/decode/models/test_architectures.py).

One function builds a config per case name, at any width and depth: the target is 2 layers of width 64, the draft
1 layer of width 32. Sliding windows are set smaller than the tests' contexts, so a wrong window shows. Nothing is
downloaded.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    OPTConfig,
    Phi3Config,
    PhiConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
    Starcoder2Config,
)

CONTEXT = 128  # max_position_embeddings of every case
WINDOW = 5  # the sliding window of every windowed case: far below the tests' 20-50 positions
HEADS = 4

# the 18 architectures of issue 25, plus Qwen2 with its sliding window on (Qwen2.5 checkpoints ship that switch)
ARCHITECTURES = [
    "llama", "mistral", "qwen2", "qwen2-window", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt2",
    "gpt_neox", "opt", "falcon", "olmo2", "granite", "starcoder2", "smollm3", "cohere",
]
# cases whose attention has a sliding window (every layer, or the sliding layers of a hybrid)
WINDOWED = {"mistral", "qwen2-window", "gemma2", "gemma3_text", "phi3", "starcoder2"}
# drafts that ddte's fast forward runs (decode.models.fast_llama); every other falls back to HF's forward
FAST_DRAFTS = {"llama", "mistral", "qwen2", "qwen2-window", "qwen3"}


def arch_config(name: str, vocab: int, hidden: int, layers: int, window: int = WINDOW) -> PretrainedConfig:
    """A random-model config of case ``name``: ``layers`` layers of width ``hidden``, 4 heads (2 key/value heads
    where the architecture has grouped-query attention), ``vocab`` tokens, ``window`` where it slides."""
    head = hidden // HEADS
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    # the Llama-style keywords most configs share
    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": 2,
              "max_position_embeddings": CONTEXT, **ids}
    if name == "llama":
        return LlamaConfig(**common)
    if name == "mistral":
        return MistralConfig(**common, sliding_window=window)
    if name == "qwen2":
        return Qwen2Config(**common)
    if name == "qwen2-window":  # layers from max_window_layers on slide: hybrid in the target, all-sliding draft
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=window, max_window_layers=layers // 2)
    if name == "qwen3":
        return Qwen3Config(**common, head_dim=head)
    # Gemma scales its input embedding by sqrt(width): tied to the output head, a random one only repeats its input
    # token, so the Gemma cases untie the head
    if name == "gemma":
        return GemmaConfig(**common, head_dim=head, tie_word_embeddings=False)
    if name == "gemma2":  # alternating sliding/full layers; attention and final logits softcapped (eager only)
        return Gemma2Config(**common, head_dim=head, query_pre_attn_scalar=head, sliding_window=window,
                            tie_word_embeddings=False)
    if name == "gemma3_text":  # sliding, full, sliding, ... with a local rotary base on the sliding layers
        return Gemma3TextConfig(**common, head_dim=head, query_pre_attn_scalar=head, sliding_window=window,
                                sliding_window_pattern=2, tie_word_embeddings=False)
    if name == "phi":
        return PhiConfig(**common)
    if name == "phi3":
        return Phi3Config(**common, sliding_window=window)
    if name == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=HEADS, n_positions=CONTEXT,
                          bos_token_id=1, eos_token_id=2)
    if name == "gpt_neox":
        return GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=HEADS, max_position_embeddings=CONTEXT,
                             **ids)
    if name == "opt":
        return OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=HEADS, max_position_embeddings=CONTEXT, word_embed_proj_dim=hidden, **ids)
    if name == "falcon":
        return FalconConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=HEADS, max_position_embeddings=CONTEXT, bos_token_id=1,
                            eos_token_id=2)
    if name == "olmo2":
        return Olmo2Config(**common)
    if name == "granite":  # Granite's multipliers, at values its checkpoints use
        return GraniteConfig(**common, embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                             attention_multiplier=0.0156)
    if name == "starcoder2":
        return Starcoder2Config(**common, sliding_window=window)
    if name == "smollm3":  # every second layer without rotary embedding (NoPE)
        return SmolLM3Config(**common, no_rope_layer_interval=2)
    if name == "cohere":
        return CohereConfig(**common)
    raise KeyError(name)


def arch_model(name: str, seed: int, vocab: int, hidden: int, layers: int, window: int = WINDOW,
               logit_scale: float = 1.0) -> PreTrainedModel:
    """A random model of case ``name`` in eval mode, transformers' default attention (sdpa, else eager).

    Every matrix is redrawn with standard deviation 1/sqrt(its last dimension): at HF's initialisation (0.02) a
    tiny model with tied embeddings only repeats its input token, and greedy decoding would say little. Vectors
    (biases, norm weights) get noise of 0.1, so that a forward that dropped a bias or a norm weight shows.
    ``logit_scale`` multiplies the output head (and a tied input embedding) so distributions are peaked.
    """
    torch.manual_seed(seed)
    return randomized(AutoModelForCausalLM.from_config(arch_config(name, vocab, hidden, layers, window)).eval(),
                      logit_scale)


def randomized(model: PreTrainedModel, logit_scale: float = 1.0) -> PreTrainedModel:
    """``model`` with its parameters redrawn in place as :func:`arch_model` says (from torch's current seed)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            else:
                param.add_(0.1 * torch.randn_like(param))
        if logit_scale != 1.0:
            model.get_output_embeddings().weight.mul_(logit_scale)
    return model
