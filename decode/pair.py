"""Loading a draft/target pair for decoding: the shipped default, or any two HF causal LMs that share a vocabulary.

Importing this module is cheap (torch and transformers load with the first pair): command-line help texts name the
default directories without paying for them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from decode.models import CachedLM

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"
DEFAULT_TOKENIZER = MODELS_DIR / "tokenizer"


@dataclass
class LoadedPair:
    """Both models, cached for decoding, with what identifies the pair.

    Attributes:
        paths: ``target``, ``draft`` and (when found) ``tokenizer`` directories the pair was loaded from.
    """

    target: CachedLM
    draft: CachedLM
    tokenizer: object | None  # a transformers tokenizer, when one was found
    eos_token_id: int | None
    paths: dict[str, Path]

    @property
    def context_limit(self) -> int:
        """Positions both models attend over."""
        return min(self.target.context_limit, self.draft.context_limit)

    @property
    def hidden_sizes(self) -> dict[str, int]:
        """Width of each root-feature hidden block (decode.features.HIDDEN_NAMES)."""
        from decode.features import hidden_sizes

        return hidden_sizes(self.target.config.hidden_size, self.draft.config.hidden_size)

    def fingerprint(self) -> str:
        """:func:`pair_fingerprint` of the directories this pair came from."""
        return pair_fingerprint(self.paths["target"], self.paths["draft"], self.paths.get("tokenizer"))


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda' or 'auto' (cuda when available)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device '{name}' (cpu, cuda or auto)")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype | None:
    """'auto' or None (the models' default for the device: fp32 on CPU, bf16 on CUDA), or a torch dtype name."""
    if name in (None, "auto"):
        return None
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype '{name}' (auto, float32, bfloat16 or float16)")
    import torch

    return getattr(torch, name)


def load_pair(
    target: str | Path = DEFAULT_TARGET,
    draft: str | Path = DEFAULT_DRAFT,
    tokenizer: str | Path | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    fast_draft: bool = True,
) -> LoadedPair:
    """Load both models (safetensors only, no remote code) and a tokenizer if one is available.

    The tokenizer is looked up at ``tokenizer``, else in the target's folder, else beside it in ``tokenizer/``.
    A missing tokenizer is not an error: token ids still work. The draft runs through the fast forward of
    :mod:`decode.fast_llama` when it supports the model (and ``fast_draft``); the target always through HF's.

    Raises:
        ValueError: a missing directory, weights that are not safetensors, an unknown device or dtype, or two
            models that do not share one vocabulary.
    """
    from decode.fast_llama import cached_lm
    from decode.models import CachedLM, check_same_vocab, load_causal_lm

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    target_lm = CachedLM(load_causal_lm(target, dev, torch_dtype), dev, torch_dtype)
    draft_lm = cached_lm(load_causal_lm(draft, dev, torch_dtype), dev, torch_dtype, fast=fast_draft)
    check_same_vocab(target_lm.config, draft_lm.config)
    tokenizer_dir = find_tokenizer_dir(Path(target), tokenizer)
    tok = _load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    if eos is None:
        eos = getattr(target_lm.config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) and eos else eos
    paths = {"target": Path(target), "draft": Path(draft)}
    if tokenizer_dir is not None:
        paths["tokenizer"] = tokenizer_dir
    return LoadedPair(target_lm, draft_lm, tok, eos, paths)


def load_pair_config(path: str | Path, device: str = "cpu", dtype: str | None = None,
                     fast_draft: bool = True) -> LoadedPair:
    """:func:`load_pair` of the directories a pair YAML names."""
    paths = read_pair_config(path)
    return load_pair(paths["target"], paths["draft"], paths.get("tokenizer"), device, dtype, fast_draft)


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
    """sha256 over both models' config.json and safetensors weights and the tokenizer's tokenizer.json.

    The weights are part of it: a draft distilled from the shipped one keeps its config but is another pair, and
    labels or selectors made for one must not pass for the other. (Reading the shipped pair's 33 MB takes ~0.1 s.)
    The tokenizer is looked up like :func:`load_pair` does when not given.
    """
    target, draft = Path(target), Path(draft)
    if tokenizer is None:
        tokenizer = find_tokenizer_dir(target, None)
    files = []
    for model in (target, draft):
        files += [model / "config.json", *sorted(model.glob("*.safetensors"))]
    if tokenizer is not None:
        files.append(Path(tokenizer) / "tokenizer.json")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        if path.is_file():
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
    return digest.hexdigest()


def find_tokenizer_dir(target: Path, explicit: str | Path | None) -> Path | None:
    """The tokenizer directory: ``explicit``, else the target's folder, else ``tokenizer/`` beside it; None if none.

    Raises:
        ValueError: ``explicit`` holds no tokenizer.
    """
    candidates = [Path(explicit)] if explicit else [target, target.parent / "tokenizer"]
    for path in candidates:
        if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
            return path
    if explicit:
        raise ValueError(f"no tokenizer found at {explicit}")
    return None


def find_tokenizer(target: Path, explicit: str | Path | None):
    """The pair's transformers tokenizer (see :func:`find_tokenizer_dir`), or None."""
    found = find_tokenizer_dir(target, explicit)
    return _load_tokenizer(found) if found is not None else None


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
