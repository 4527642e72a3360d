"""Loading a draft/target pair for decoding: the shipped default, or any two HF causal LMs that share a vocabulary.

Importing this module is cheap (torch and transformers load with the first pair): command-line help texts name the
default directories without paying for them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from decode.pair_spec import DTYPES, PairSpec, read_pair_config

if TYPE_CHECKING:
    import torch

    from decode.models.cached_lm import CachedLM
    from decode.models.kernel_choice import KernelChoice

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"
DEFAULT_TOKENIZER = MODELS_DIR / "tokenizer"


@dataclass
class LoadedPair:
    """Both models, cached for decoding, with what identifies the pair: one record, whole when loaded.

    Attributes:
        paths: ``target``, ``draft`` and (when found) ``tokenizer`` directories the pair was loaded from.
        spec: the pair as its YAML names it (decode/pair_spec.py: its prompt sources, kernel request and
            ``target_quant``); a pair loaded from two folders holds :meth:`PairSpec.folders`' defaults.
        kernel_choice: the KernelChoice :meth:`use_kernels` applied (None: both on the default path), the one thing
            that moves after load, with the models' kernel paths.
    """

    target: CachedLM
    draft: CachedLM
    tokenizer: object | None  # a transformers tokenizer, when one was found
    eos_token_id: int | None
    paths: dict[str, Path]
    spec: PairSpec
    kernel_choice: KernelChoice | None = None

    @property
    def chat(self) -> bool:
        """Whether the pair's prompts are chat conversations (rendered with the tokenizer's chat template)."""
        return self.spec.heldout_prompts.startswith(("chat:", "mixed:"))

    @property
    def context_limit(self) -> int:
        """Positions both models attend over."""
        return min(self.target.context_limit, self.draft.context_limit)

    @property
    def hidden_sizes(self) -> dict[str, int]:
        """Width of each root-feature hidden block (decode.policies.features.HIDDEN_NAMES)."""
        from decode.policies.features import hidden_sizes

        return hidden_sizes(self.target.config.hidden_size, self.draft.config.hidden_size)

    def fingerprint(self) -> str:
        """:func:`pair_fingerprint` of the directories this pair came from."""
        return pair_fingerprint(self.paths["target"], self.paths["draft"], self.paths.get("tokenizer"))

    def use_kernels(self, request: str | None = None, cache: Path | None = None, announce=None,
                    progress: bool = False, release: bool = False):
        """Move both models to the kernel paths ``request`` names (None: the pair's own, usually ``auto``: this
        machine's fastest, measured once and cached in ``cache``, with a bar on stderr given ``progress``); the
        :class:`~decode.models.kernel_choice.KernelChoice`. ``release``: the stock weights given back for good once
        chosen (decode/models/release.py), for a process that never runs the stock models.

        Raises:
            ValueError: a request that does not parse, a path a model cannot run here, or a target path beside the
                pair's ``target_quant`` (the opt-in names the target's path; another one would be silently dropped).
        """
        from decode.models.kernel_choice import KernelRequest, choose_kernels, with_target_quant

        parsed = KernelRequest.parse(self.spec.kernels if request is None else request)
        # the user's opt-in to another target model (PairSpec.target_quant)
        parsed = with_target_quant(parsed, self.spec.target_quant, request is not None)
        self.kernel_choice = choose_kernels(self.target, self.draft, parsed, self.fingerprint(), cache, announce,
                                            progress, release)
        return self.kernel_choice


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
    """'auto' or None (the models' default for the device: fp32 on CPU, bf16 on CUDA), a torch dtype name, or
    ``bfloat16-native``: bf16 where the device runs bf16 matrix products natively (CUDA, or a CPU with AVX-512 BF16
    or AMX), fp32 elsewhere.

    Why the last: on a CPU without native bf16, a bf16 target prefills and runs tree passes several times slower than
    in fp32, and only its one-token pass is faster (docs/pairs.md). Where bf16 is native, its tree pass is nearly flat
    and bf16 wins everywhere."""
    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}' ({', '.join(DTYPES[:-1])} or {DTYPES[-1]})")
    import torch

    if name == "bfloat16-native":
        from ddte_core.machine import native_bf16_cpu

        return torch.bfloat16 if device.type == "cuda" or native_bf16_cpu() else torch.float32
    return getattr(torch, name)


def load_pair(
    target: str | Path = DEFAULT_TARGET,
    draft: str | Path = DEFAULT_DRAFT,
    tokenizer: str | Path | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    fast_draft: bool = True,
    draft_dtype: str | None = None,
    spec: PairSpec | None = None,
) -> LoadedPair:
    """Load both models (safetensors or GGUF only, no remote code) and a tokenizer if one is available.

    ``target`` (and ``draft``) is an HF folder or a ``.gguf`` file. The tokenizer is looked up at ``tokenizer``,
    else in the target's folder (or its GGUF file), else beside it in ``tokenizer/``. A missing tokenizer is not an
    error: token ids still work. ``dtype`` is the target's (and the draft's, unless ``draft_dtype`` is given). The
    draft runs through the fast forward of :mod:`decode.models.fast_llama` when it supports the model (and
    ``fast_draft``), the target always through HF's, both on the default kernels
    (:func:`decode.models.kernel_choice.choose_kernels` moves them to this machine's fastest). ``spec``: the pair spec
    it was loaded from (None: :meth:`PairSpec.folders` of the two folders).

    Raises:
        ValueError: a missing directory, weights that are not safetensors or GGUF, an unknown device or dtype, or
            two models that do not share one vocabulary.
    """
    from decode.models.cached_lm import CachedLM
    from decode.models.fast_llama import cached_lm
    from decode.models.loading import check_same_vocab, load_causal_lm

    dev = resolve_device(device)
    target_dtype, draft_torch_dtype = model_dtypes(dev, dtype, draft_dtype)
    target_lm = CachedLM(load_causal_lm(target, dev, target_dtype), dev, target_dtype)
    draft_lm = cached_lm(load_draft_model(draft, dev, draft_torch_dtype), dev, draft_torch_dtype, fast=fast_draft)
    check_same_vocab(target_lm.config, draft_lm.config)
    attach_draft_steering(draft_lm, target_lm, Path(draft), Path(target))
    tokenizer_dir = find_tokenizer_dir(Path(target), tokenizer)
    tok = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    if eos is None:
        eos = getattr(target_lm.config, "eos_token_id", None)
        if isinstance(eos, list):  # several: the first (none: no EOS stop, as an empty list never matched)
            eos = eos[0] if eos else None
    paths = {"target": Path(target), "draft": Path(draft)}
    if tokenizer_dir is not None:
        paths["tokenizer"] = tokenizer_dir
    spec = spec if spec is not None else PairSpec.folders(Path(target), Path(draft), tokenizer)
    return LoadedPair(target_lm, draft_lm, tok, eos, paths, spec)


def model_dtypes(device: torch.device, dtype: str | None, draft_dtype: str | None) -> tuple[torch.dtype, torch.dtype]:
    """The target's and the draft's dtypes as :func:`load_pair` loads them: ``dtype`` (None or auto: the device's
    default) and ``draft_dtype`` (None: the target's)."""
    from decode.models.loading import default_dtype

    target = resolve_dtype(dtype, device)
    return default_dtype(device, target), default_dtype(device, resolve_dtype(draft_dtype, device) or target)


def check_kernel_request(spec: PairSpec | None, device: str, dtype: str | None, request: str | None) -> None:
    """ValueError, before any model loads, where :meth:`LoadedPair.use_kernels` would refuse ``request`` (None: the
    pair's own) on the pair ``spec`` names (None: two folders) loaded on ``device`` in ``dtype`` (None or auto: each
    model's own): a request that does not parse, a target path beside the pair's ``target_quant``, or a fixed path a
    model cannot run in its dtype here. It needs no weights: the dtypes and the device decide."""
    from decode.models.kernel_choice import KernelRequest, check_fixed_paths, with_target_quant

    dev = resolve_device(device)
    own = spec is not None and dtype in (None, "auto")  # each model's dtype as the pair names it
    target_dtype, draft_dtype = (spec.target_dtype, spec.draft_dtype) if own and spec is not None else (dtype, dtype)
    dtypes = model_dtypes(dev, target_dtype, draft_dtype)
    text = request if request is not None else (spec.kernels if spec is not None else "auto")
    parsed = with_target_quant(KernelRequest.parse(text), spec.target_quant if spec is not None else None,
                               request is not None)
    check_fixed_paths(parsed, dict(zip(("target", "draft"), dtypes, strict=True)), dev)


def load_draft_model(path: str | Path, device: torch.device, dtype: torch.dtype | None):
    """The draft as decoding runs it: its weights, with its reduced output vocabulary when its folder has one
    (:mod:`decode.models.draft_vocab`)."""
    from decode.models.draft_vocab import DraftVocab, attach_draft_vocab
    from decode.models.loading import load_causal_lm

    model = load_causal_lm(path, device, dtype)
    vocab = DraftVocab.load(path) if Path(path).is_dir() else None
    if vocab is not None:
        attach_draft_vocab(model, vocab)
    return model


def load_other_draft(pair: LoadedPair, path: str | Path, release: bool = False) -> CachedLM:
    """Another draft for ``pair``'s target, loaded as the pair's own draft was (device, dtype, forward, kernel path;
    its draft vocabulary and steering map, checked against this target); ``release``: its stock weights given back
    as its kernels are made (decode/models/release.py).

    Raises:
        ValueError: a missing folder, unsafe weights, another vocabulary, or a steering map for another target.
    """
    from decode.models.fast_llama import cached_lm
    from decode.models.loading import check_same_vocab

    own = pair.draft
    draft = cached_lm(load_draft_model(path, own.device, own.dtype), own.device, own.dtype,
                      fast=own.forward_name == "fast")
    draft.use_kernel(own.kernel, release=release)
    check_same_vocab(pair.target.config, draft.config)
    attach_draft_steering(draft, pair.target, Path(path), pair.paths["target"])
    return draft


def attach_draft_steering(draft: CachedLM, target: CachedLM, draft_path: Path, target_path: Path) -> None:
    """Attach the steering map a draft folder holds (:mod:`decode.models.steering`), if any, after checking that it was
    trained with this target, and link the draft to it: the target then records the states the map reads at every
    pass, and the draft's forwards take their δ from them.

    Raises:
        ValueError: the map is unreadable, does not fit the models, or was trained with another target.
    """
    from decode.models.steering import SteeringMap, check_compatible, link_steering

    steering = SteeringMap.load(draft_path) if draft_path.is_dir() else None
    if steering is None:
        return
    check_compatible(steering, draft.model, target.config)
    steering.spec.check_target(model_fingerprint(target_path))
    link_steering(draft, target, steering)


def load_pair_spec(spec: PairSpec, device: str = "cpu", dtype: str | None = None, fast_draft: bool = True,
                   tokenizer: str | Path | None = None) -> LoadedPair:
    """:func:`load_pair` of the models a pair spec names, each in its own dtype unless ``dtype`` (not auto) overrides
    both; ``tokenizer`` overrides the spec's.

    Raises:
        ValueError: a registry model not fetched yet, or what :func:`load_pair` raises.
    """
    spec.check_available()
    override = dtype not in (None, "auto")
    return load_pair(spec.target, spec.draft, tokenizer or spec.tokenizer, device,
                     dtype if override else spec.target_dtype, fast_draft,
                     draft_dtype=dtype if override else spec.draft_dtype, spec=spec)


def load_pair_config(path: str | Path, device: str = "cpu", dtype: str | None = None, fast_draft: bool = True,
                     tokenizer: str | Path | None = None) -> LoadedPair:
    """:func:`load_pair_spec` of a pair YAML (a path, or a name under ``configs/pair/``)."""
    return load_pair_spec(read_pair_config(path), device, dtype, fast_draft, tokenizer)


def pair_fingerprint(target: str | Path, draft: str | Path, tokenizer: str | Path | None = None) -> str:
    """sha256 over both models' config.json and safetensors weights and the tokenizer's tokenizer.json.

    The weights are part of it: a draft distilled from the shipped one keeps its config but is another pair, and
    labels or selectors made for one must not pass for the other.
    The tokenizer is looked up like :func:`load_pair` does when not given.
    """
    target, draft = Path(target), Path(draft)
    if tokenizer is None:
        tokenizer = find_tokenizer_dir(target, None)
    files = [*_model_files(target), *_model_files(draft)]
    if tokenizer is not None and not Path(tokenizer).is_file():  # a GGUF tokenizer is hashed with its file
        files.append(Path(tokenizer) / "tokenizer.json")
    return _digest(files)


def model_fingerprint(model: str | Path) -> str:
    """sha256 over one model's config.json and safetensors weights (or its GGUF file)."""
    return _digest(_model_files(Path(model)))


def _model_files(model: Path) -> list[Path]:
    return [model] if model.is_file() else [model / "config.json", *sorted(model.glob("*.safetensors"))]


def _digest(files: list[Path]) -> str:
    """sha256 over each file's name and bytes, in order (a missing file contributes its name)."""
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
    from decode.models.gguf import is_gguf

    if explicit is None and is_gguf(target):
        return target  # the GGUF file carries its tokenizer
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
    return load_tokenizer(found) if found is not None else None


CHAT_ROLES = ("system", "user", "assistant")


def check_messages(messages) -> None:
    """ValueError (naming ``messages[i]``) unless ``messages`` is a conversation a chat template renders as meant:
    a non-empty list of {role, content} strings, roles among :data:`CHAT_ROLES`, system turns only first, and the
    user speaking before the assistant does."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must have a role ({', '.join(CHAT_ROLES)}) and a string content")
    roles = [m["role"] for m in messages]
    first = next((i for i, role in enumerate(roles) if role != "system"), None)
    if first is None:
        raise ValueError("messages hold only system turns: a user turn must follow")
    if "system" in roles[first:]:
        raise ValueError(f"messages[{roles.index('system', first)}] is a system turn after the conversation began")
    if roles[first] != "user":
        raise ValueError(f"messages[{first}] is an assistant turn before any user turn")


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text of a conversation: the tokenizer's chat template with the generation prompt appended.

    Raises:
        ValueError: no tokenizer, a tokenizer without a chat template, or messages :func:`check_messages` refuses.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat prompts (messages rows) need a tokenizer with a chat template")
    check_messages(messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def pair_context_limit(spec: PairSpec) -> int | None:
    """Positions both models of ``spec`` attend over, read from their ``config.json`` without loading them
    (:func:`decode.models.loading.context_limit`'s rule); None for a model given as a GGUF file."""
    import json

    limits = []
    for folder in (spec.target, spec.draft):
        config = Path(folder) / "config.json"
        if not config.is_file():
            return None
        try:
            limits.append(int(json.loads(config.read_text()).get("max_position_embeddings", 1 << 30)))
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"{config}: not a readable model config ({err})") from err
    return min(limits)


def load_tokenizer(path: Path):
    """The tokenizer at ``path`` (a folder, or a GGUF file that carries one)."""
    from transformers import AutoTokenizer

    from decode.models.gguf import is_gguf, load_gguf_tokenizer

    if is_gguf(path):
        return load_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))
