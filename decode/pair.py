"""Loading a draft/target pair for decoding: the shipped default, or any two HF causal LMs that share a vocabulary."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.models import CachedLM, load_causal_lm

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"
DEFAULT_TOKENIZER = MODELS_DIR / "tokenizer"


@dataclass
class LoadedPair:
    target: CachedLM
    draft: CachedLM
    tokenizer: object | None  # a transformers tokenizer, when one was found
    eos_token_id: int | None


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda' or 'auto' (cuda when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device '{name}' (cpu, cuda or auto)")
    return torch.device(name)


def load_pair(
    target: str | Path = DEFAULT_TARGET,
    draft: str | Path = DEFAULT_DRAFT,
    tokenizer: str | Path | None = None,
    device: str = "cpu",
) -> LoadedPair:
    """Load both models (safetensors only, no remote code) and a tokenizer if one is available.

    The tokenizer is looked up at ``tokenizer``, else in the target's folder, else beside it in ``tokenizer/``.
    A missing tokenizer is not an error: token ids still work.
    """
    dev = resolve_device(device)
    target_lm = CachedLM(load_causal_lm(target, device=dev), device=dev)
    draft_lm = CachedLM(load_causal_lm(draft, device=dev), device=dev)
    tok = find_tokenizer(Path(target), tokenizer)
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    if eos is None:
        eos = getattr(target_lm.config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) and eos else eos
    return LoadedPair(target_lm, draft_lm, tok, eos)


def read_pair_config(path: str | Path) -> dict[str, str]:
    """``target``/``draft``/``tokenizer`` paths from a pair YAML; relative paths resolve against the repository
    root that holds the config (its ``configs/`` parent), else against the YAML's own folder."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"pair config {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - {"target", "draft", "tokenizer"}
    if unknown or "target" not in data or "draft" not in data:
        raise ValueError(f"pair config {str(path)!r} needs keys target and draft (and optionally tokenizer)")
    base = next((p.parent for p in path.resolve().parents if p.name == "configs"), path.resolve().parent)
    return {k: str(v if Path(v).is_absolute() else base / v) for k, v in data.items() if v is not None}


def pair_fingerprint(target: str | Path, draft: str | Path, tokenizer: str | Path | None = None) -> str:
    """sha256 over both models' config.json and the tokenizer's tokenizer.json (design.md: the pair fingerprint).

    The tokenizer is looked up like :func:`load_pair` does when not given.
    """
    target, draft = Path(target), Path(draft)
    if tokenizer is None:
        found = [d for d in (target, target.parent / "tokenizer") if (d / "tokenizer.json").is_file()]
        tokenizer = found[0] if found else None
    files = [target / "config.json", draft / "config.json"]
    if tokenizer is not None:
        files.append(Path(tokenizer) / "tokenizer.json")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def find_tokenizer(target: Path, explicit: str | Path | None):
    from transformers import AutoTokenizer

    candidates = [Path(explicit)] if explicit else [target, target.parent / "tokenizer"]
    for path in candidates:
        if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(str(path))
    if explicit:
        raise ValueError(f"no tokenizer found at {explicit}")
    return None
