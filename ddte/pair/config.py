"""Typed configuration of the pair recipe, loaded from YAML (``configs/pair/*.yaml``) with dotted CLI overrides.

The dataclasses below are the schema; the YAML files mirror them key for key. Unknown keys are errors, so a typo in
a config or an override never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelShape:
    """Llama architecture sizes of one model (vocabulary and context come from the top level)."""

    hidden_size: int = 384
    intermediate_size: int = 1536
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 6


@dataclass
class TrainSchedule:
    """Optimisation of one model: AdamW, linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    steps: int = 400
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_blocks: int = 48
    max_minutes: float | None = None


@dataclass
class ModelRecipe:
    """One model of the pair: its shape, its training schedule and its seed."""

    shape: ModelShape = field(default_factory=ModelShape)
    train: TrainSchedule = field(default_factory=TrainSchedule)
    seed: int = 0


@dataclass
class CorpusConfig:
    """Which stdlib files are used (see ``ddte.pair.corpus``)."""

    heldout_fraction: float = 0.1
    max_files: int | None = None


@dataclass
class TokenizerConfig:
    """Byte-level BPE trained on the training split only."""

    vocab_size: int = 4096
    min_frequency: int = 2


@dataclass
class PairConfig:
    """The whole recipe: corpus, tokenizer, both models, storage."""

    out_dir: str = "models"
    context_length: int = 512
    storage_dtype: str = "float16"
    threads: int | None = None
    final_eval_blocks: int | None = 256
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    target: ModelRecipe = field(default_factory=ModelRecipe)
    draft: ModelRecipe = field(default_factory=ModelRecipe)


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check and convert one YAML value to its annotated type (int/float/str/bool, optionally None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        annotation = next(a for a in options if a is not type(None))
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation in (str, bool) and isinstance(value, annotation):
        return value
    raise ValueError(f"{key}: expected {getattr(annotation, '__name__', annotation)}, got {value!r}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from a nested dict, rejecting unknown keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, prefix + name)
    return cls(**kwargs)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML (``1e-3``, ``null``, ``true``)."""
    if "=" not in assignment:
        raise ValueError(f"override {assignment!r} is not of the form key=value")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a section")
    value = yaml.safe_load(raw)
    # YAML reads "1e-3" as a string (no dot in the mantissa); a float is what any numeric key wants.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            pass
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> PairConfig:
    """Read a YAML config (or the defaults when ``path`` is None), apply overrides, validate against the schema."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    for assignment in overrides or []:
        apply_override(data, assignment)
    config = _build(PairConfig, data, "")
    if config.storage_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"storage_dtype must be float32, float16 or bfloat16, got {config.storage_dtype!r}")
    for name in ("target", "draft"):
        train = getattr(config, name).train
        if train.seq_len > config.context_length:
            raise ValueError(f"{name}.train.seq_len ({train.seq_len}) exceeds context_length ({config.context_length})")
    return config


def config_to_dict(config: PairConfig) -> dict[str, Any]:
    """The resolved config as plain data (for recipe.json)."""
    return dataclasses.asdict(config)
