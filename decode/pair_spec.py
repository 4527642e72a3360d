"""A pair YAML (``configs/pair/*.yaml``): its keys as a typed config (:class:`PairFile`, read through
:mod:`ddte_core.yamlconfig`) and the pair it names, paths resolved (:class:`PairSpec`).

Importing this module is cheap: reading a pair YAML loads no model (:func:`decode.pair.load_pair_spec` does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ddte_core.paths import INSTALL_ROOT, bundled
from ddte_core.yamlconfig import build_dataclass, read_yaml_mapping

CONFIGS_DIR = INSTALL_ROOT / "configs"
DTYPES = ("auto", "float32", "bfloat16", "float16", "bfloat16-native")


@dataclass(frozen=True)
class PairFile:
    """A pair YAML key for key, as written (``target`` and ``draft`` required; see :class:`PairSpec` for what each
    means): the schema :func:`ddte_core.yamlconfig.build_dataclass` checks the file's types against."""

    target: str
    draft: str
    tokenizer: str | None = None
    target_dtype: str | None = None
    draft_dtype: str | None = None
    kernels: str = "auto"
    target_quant: str | None = None
    train_prompts: str | None = None
    heldout_prompts: str | None = None


PAIR_KEYS = tuple(field.name for field in dataclasses.fields(PairFile))


@dataclass(frozen=True)
class PairSpec:
    """A pair as a YAML file names it (``configs/pair/*.yaml``); paths resolved, fetched targets located.

    Attributes:
        target, draft, tokenizer: model folders or GGUF files (``tokenizer`` None: found beside the target).
        target_dtype, draft_dtype: each model's dtype when the command's ``--dtype`` is auto (None: the device's
            default, fp32 on CPU).
        kernels: the kernel request when a command says ``--kernels auto`` or nothing
            (:class:`decode.models.kernel_choice.KernelRequest`: ``auto``, a path, ``target=PATH,draft=PATH``).
        target_quant: a quantized kernel path for the target (``int8-dynamic``, ``int8-weight``), or None. Opting in
            makes the target another model than the pair's: its outputs follow the quantized law, which decoding
            keeps exactly, and the bench's baseline is AR on that same quantized target (``ar-kernels``).
        train_prompts, heldout_prompts: the prompt sources that fit this pair (``builtin:*`` for the stdlib pair,
            ``chat:*`` for a chat model), the defaults of collect and bench.
        fetch: the registry models (:mod:`decode.models.registry`) the target and the draft come from, if any.
    """

    source: Path
    target: Path
    draft: Path
    tokenizer: Path | None = None
    target_dtype: str | None = None
    draft_dtype: str | None = None
    kernels: str = "auto"
    target_quant: str | None = None
    train_prompts: str = "builtin:train"
    heldout_prompts: str = "builtin:heldout"
    fetch: tuple[str, ...] = ()

    @classmethod
    def folders(cls, target: Path, draft: Path, tokenizer: str | Path | None = None) -> PairSpec:
        """The spec of a pair given as two folders (``--target``/``--draft``): every other key its default."""
        return cls(target, target, draft, None if tokenizer is None else Path(tokenizer))

    def check_available(self) -> None:
        """ValueError naming the command that makes a missing fetched model available."""
        from decode.models.registry import require_fetched

        for name in self.fetch:
            try:
                require_fetched(name)
            except ValueError as err:
                raise ValueError(f"pair {self.source.stem}: {err}") from err

    def paths(self) -> dict[str, Path]:
        """``target``, ``draft`` and (when set) ``tokenizer``."""
        out = {"target": self.target, "draft": self.draft}
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer
        return out


def resolve_pair_path(name: str | Path) -> Path:
    """A pair YAML's path: ``name`` itself when it is a file, else ``configs/pair/NAME.yaml`` of this checkout."""
    path = bundled(name)
    if path.is_file():
        return path
    named = CONFIGS_DIR / "pair" / f"{name}.yaml"
    if path.suffix == "" and named.is_file():
        return named
    known = ", ".join(sorted(p.stem for p in (CONFIGS_DIR / "pair").glob("*.yaml")))
    raise ValueError(f"pair config {str(name)!r} does not exist (a YAML file, or one of: {known})")


def read_pair_file(path: Path) -> PairFile:
    """The keys of the pair YAML at ``path``, checked: the one-line errors of :func:`read_pair_config`."""
    data = read_yaml_mapping(path)
    where = f"pair config {str(path)!r}"
    if "draft_int8" in data:
        raise ValueError(f"{where}: draft_int8 is replaced by kernels (auto: each model's fastest path on this "
                         "machine, measured once; draft=int8-weight is what draft_int8: all ran)")
    unknown = set(data) - set(PAIR_KEYS)
    if unknown or "target" not in data or "draft" not in data:
        extra = f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""
        raise ValueError(f"{where} needs keys target and draft (and optionally {', '.join(PAIR_KEYS[2:])}){extra}")
    try:
        keys = build_dataclass(PairFile, data)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    if keys.target_quant is not None:
        from decode.models.kernels import KERNEL_PATHS

        quantized = [name for name, kernel in KERNEL_PATHS.items() if not kernel.exact]
        if keys.target_quant not in quantized:
            raise ValueError(f"{where}: target_quant must be one of {', '.join(quantized)}")
    for key in ("target_dtype", "draft_dtype"):
        if getattr(keys, key) not in (None, *DTYPES):
            raise ValueError(f"{where}: {key} must be one of {', '.join(DTYPES)}")
    from decode.models.kernel_choice import KernelRequest

    try:
        KernelRequest.parse(keys.kernels)
    except ValueError as err:
        raise ValueError(f"{where}: kernels: {err}".replace("--kernels: ", "")) from err
    return keys


def read_pair_config(path: str | Path) -> PairSpec:
    """The :class:`PairSpec` of a pair YAML (a path, or a name under ``configs/pair/``).

    Relative paths resolve against the repository root that holds the config (its ``configs/`` parent), else
    against the YAML's own folder. ``fetch:NAME`` as the target is the folder ``ddte fetch NAME`` writes.

    Raises:
        ValueError: a missing file, unknown keys, a missing target or draft, a value of the wrong type, or a bad
            dtype, kernel request or quantized target.
    """
    from decode.models.registry import fetch_name, fetched_model_dir

    path = resolve_pair_path(path)
    keys = read_pair_file(path)
    base = next((p.parent for p in path.resolve().parents if p.name == "configs"), path.resolve().parent)

    def at_base(value: str) -> Path:
        return Path(value) if Path(value).is_absolute() else base / value

    def located(value: str | None) -> Path | None:
        return None if value is None else at_base(value)

    def model_path(value: str) -> Path:
        name = fetch_name(value)
        return fetched_model_dir(name) if name is not None else at_base(value)

    fetched = tuple(name for name in (fetch_name(keys.target), fetch_name(keys.draft)) if name is not None)
    prompts = {k: getattr(keys, k) for k in ("train_prompts", "heldout_prompts") if getattr(keys, k) is not None}
    return PairSpec(path, model_path(keys.target), model_path(keys.draft), located(keys.tokenizer),
                    keys.target_dtype, keys.draft_dtype, keys.kernels, keys.target_quant, fetch=fetched, **prompts)
