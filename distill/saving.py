"""Writing a model the way the shipped pair is stored: safetensors in a storage dtype, config loading as fp32."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def round_to_storage(model, storage_dtype: str) -> None:
    """Round the weights through the storage dtype (in place, kept fp32) so evaluation sees the shipped weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(DTYPES[storage_dtype]).float())


def save_model(model, hf_tokenizer, directory: Path, storage_dtype: str) -> None:
    """``save_pretrained`` (safetensors) in the storage dtype, with the tokenizer alongside.

    config.json keeps ``"dtype": "float32"`` so ``from_pretrained`` (dtype "auto" in transformers 5) upcasts the
    half-precision file to fp32; pass ``dtype=torch.float16`` to keep it small in memory instead.
    """
    from ddte_core.quiet import quiet_transformers

    with quiet_transformers():  # "Writing model shards" is noise for a one-shard model
        model.to(DTYPES[storage_dtype]).save_pretrained(directory)
    model.float()
    config_path = directory / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["dtype"] = "float32"
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    hf_tokenizer.save_pretrained(directory)
