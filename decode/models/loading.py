"""Loading a causal LM for the decoding engine, and the facts two models must share to draft for each other.

A model is a local HF folder (``config.json`` + safetensors) or a ``.gguf`` file, loaded offline with remote code never
trusted; its context limit and vocabulary come from its config.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

__all__ = ["check_same_vocab", "context_limit", "default_dtype", "load_causal_lm"]


def default_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype``, else the device's default: bf16 on CUDA, fp32 elsewhere."""
    if dtype is not None:
        return dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def context_limit(config: PretrainedConfig) -> int:
    """Positions a model attends over: ``max_position_embeddings`` (unbounded if the config has none)."""
    return int(getattr(config, "max_position_embeddings", 1 << 30))


def load_causal_lm(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Load a local causal LM directory (``config.json`` + safetensors weights) or a ``.gguf`` file, offline, with
    sdpa attention (eager where the model has no sdpa path, as Gemma2 for its softcapped attention scores).

    ``dtype`` defaults to fp32 on CPU and bf16 on CUDA. Remote code is never trusted.

    Raises:
        ValueError: the directory is missing, or has no ``config.json`` or no ``*.safetensors`` file, or a file in it
            cannot be read (a corrupt header, a config transformers does not know); a GGUF file transformers cannot
            read as a causal LM.
    """
    p = Path(path)
    dev = torch.device(device)
    if p.suffix.lower() == ".gguf":
        from decode.models.gguf import load_gguf_model

        return load_gguf_model(p, default_dtype(dev, dtype)).to(dev)
    if p.exists() and not p.is_dir():
        raise ValueError(f"model {str(p)!r} is a file, not a model directory (an HF folder, or a .gguf file)")
    if not p.is_dir():
        raise ValueError(f"model directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise ValueError(f"model directory {str(p)!r} has no config.json")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model directory {str(p)!r} has no *.safetensors weights (only safetensors are loaded)")
    from safetensors import SafetensorError

    from ddte_core.quiet import quiet_transformers

    try:
        with quiet_transformers():  # a "Loading weights" bar per model is noise in every command's output
            model = AutoModelForCausalLM.from_pretrained(
                str(p),
                attn_implementation=None,  # transformers' default: sdpa, else eager (asking for "sdpa" refuses Gemma2)
                use_safetensors=True,
                local_files_only=True,
                trust_remote_code=False,
                dtype=default_dtype(dev, dtype),
            )
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # a corrupt file, a config it cannot read
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model directory {str(p)!r} could not be loaded: {first}") from err
    return model.to(dev).eval()


def check_same_vocab(
    target_config: PretrainedConfig,
    draft_config: PretrainedConfig,
    allow_padded_tail: bool = False,
    tokenizer_sizes: tuple[int, int] | None = None,
) -> int:
    """Check that a target and a draft model share one vocabulary; return its size.

    Args:
        target_config, draft_config: the models' configs (their text configs' ``vocab_size`` are compared).
        allow_padded_tail: accept different ``vocab_size`` values, as when one model pads its embedding matrix
            past the tokenizer's size. The **smaller** ``vocab_size`` is then the usable vocabulary (returned);
            callers must slice both models' logits to it (the padded tail ids are never produced by the
            tokenizer). If ``tokenizer_sizes`` is given, the two tokenizers must have the same size and it must
            fit in the usable vocabulary.
        tokenizer_sizes: ``(len(target_tokenizer), len(draft_tokenizer))``, optional.

    Raises:
        ValueError: the sizes differ (and ``allow_padded_tail`` is off, or the tokenizers differ).
    """
    vt = int(target_config.get_text_config().vocab_size)
    vd = int(draft_config.get_text_config().vocab_size)
    if tokenizer_sizes is not None:
        st, sd = (int(s) for s in tokenizer_sizes)
        if st != sd:
            raise ValueError(f"target and draft tokenizers differ in size: {st} vs {sd}")
    if vt == vd:
        return vt
    if not allow_padded_tail:
        raise ValueError(
            f"vocabulary mismatch: target vocab_size={vt}, draft vocab_size={vd}; speculative decoding needs one "
            "shared vocabulary (a draft of the target's own family and tokenizer)"
        )
    usable = min(vt, vd)
    if tokenizer_sizes is not None and tokenizer_sizes[0] > usable:
        raise ValueError(
            f"tokenizer size {tokenizer_sizes[0]} exceeds the smaller vocab_size {usable} (target {vt}, draft {vd})"
        )
    return usable
