"""Typed configuration of the pair recipe, loaded from YAML (``configs/train-pair/*.yaml``) with dotted CLI overrides.

The dataclasses below are the schema; the YAML files mirror them key for key. Unknown keys are errors, so a typo in
a config or an override never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddte.train_pair.tokenizer import BYTE_ALPHABET, SPECIAL_TOKENS
from ddte_core.schedule import OptimSchedule
from ddte_core.yamlconfig import load_yaml_config
from distill.config import ModelShape


@dataclass
class TrainSchedule(OptimSchedule):
    """Optimisation of one model (:class:`OptimSchedule`), with its batches and its held-out evaluation."""

    batch_size: int = 16
    seq_len: int = 256
    eval_every: int = 50
    eval_blocks: int = 48


@dataclass
class ModelRecipe:
    """One model of the pair: its shape, its training schedule and its seed."""

    shape: ModelShape = field(default_factory=ModelShape)
    train: TrainSchedule = field(default_factory=TrainSchedule)
    seed: int = 0


@dataclass
class CorpusConfig:
    """Which stdlib files are used (see ``data_gen.corpus``)."""

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


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> PairConfig:
    """Read a YAML config (or the defaults when ``path`` is None), apply overrides, validate against the schema.

    Raises ValueError naming the first bad key.
    """
    config = load_yaml_config(PairConfig, path, overrides, required=("target", "draft"))  # never a silent 2 h default
    if config.storage_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"storage_dtype must be float32, float16 or bfloat16, got {config.storage_dtype!r}")
    positive = {"context_length": config.context_length, "tokenizer.vocab_size": config.tokenizer.vocab_size}
    for name in ("target", "draft"):
        recipe: ModelRecipe = getattr(config, name)
        train, shape = recipe.train, recipe.shape
        if train.seq_len > config.context_length:
            raise ValueError(f"{name}.train.seq_len ({train.seq_len}) exceeds context_length ({config.context_length})")
        for key in ("batch_size", "seq_len", "eval_every", "eval_blocks"):
            positive[f"{name}.train.{key}"] = getattr(train, key)
        for key, value in dataclasses.asdict(shape).items():
            positive[f"{name}.shape.{key}"] = value
        if problem := train.problem():
            raise ValueError(f"{name}.train: {problem}")
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    for name in ("target", "draft"):
        if problem := getattr(config, name).shape.problem():
            raise ValueError(f"{name}.shape: {problem}")
    smallest = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if config.tokenizer.vocab_size < smallest:
        raise ValueError(f"tokenizer.vocab_size must be >= {smallest} (a byte-level BPE holds the {BYTE_ALPHABET} "
                         f"bytes and {len(SPECIAL_TOKENS)} special tokens), got {config.tokenizer.vocab_size}")
    if not 0 < config.corpus.heldout_fraction < 1:
        raise ValueError(f"corpus.heldout_fraction must be in (0, 1), got {config.corpus.heldout_fraction}")
    return config


def config_to_dict(config: PairConfig) -> dict[str, Any]:
    """The resolved config as plain data (for recipe.json)."""
    return dataclasses.asdict(config)


def read_recipe(folder: str | Path) -> dict[str, Any]:
    """``folder/recipe.json`` as ``ddte train-pair`` wrote it (empty where the folder has none).

    Raises:
        ValueError: the file is not a JSON object.
    """
    import json

    path = Path(folder) / "recipe.json"
    if not path.is_file():
        return {}
    try:
        recipe = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not readable JSON ({err})") from err
    if not isinstance(recipe, dict):
        raise ValueError(f"{path} is not a recipe (a JSON object)")
    return recipe


def recipe_heldout_fraction(recipe: dict[str, Any]) -> float:
    """The corpus split a pair was trained on: its recipe's ``corpus.heldout_fraction`` (the default where absent)."""
    return float(recipe.get("config", {}).get("corpus", {}).get("heldout_fraction", CorpusConfig.heldout_fraction))
