"""The training corpus of the shipped draft/target pair: the Python standard library of the running interpreter.

Every machine that runs ddte has these files, so the pair can be rebuilt anywhere without a download. The corpus is
defined by rules, not by a file list, and the rules are applied to ``sysconfig.get_paths()["stdlib"]``:

* only ``*.py`` files, walked in sorted order of their POSIX relative path (deterministic on every filesystem);
* no directory named ``site-packages`` or ``__pycache__`` (third-party code and caches);
* no test suites: any directory named ``test``, ``tests`` or ``idle_test`` (``test/``, ``idlelib/idle_test``,
  ``lib2to3/tests``, ``ctypes/test``, ``unittest/test``, ``distutils/tests``, ``tkinter/test`` ...);
* no generated data: the ``pydoc_data`` package (a 750 KB string of prose) and the codec tables written by
  ``gencodec.py`` (``encodings/cp1252.py`` and friends, recognised by ``gencodec`` in their first 400 characters);
* no file that does not decode as strict UTF-8.

The held-out split is by whole module: a file is held out when the first 8 bytes of ``sha256(relative path)``, read
as a big-endian integer and divided by 2**64, fall below ``heldout_fraction`` (default 0.1). That is stable across
machines, Python versions and corpus subsets, and a module is either entirely in training or entirely held out.
The Python version (``sys.version``) is part of the corpus identity and is recorded wherever the corpus is used.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test", "pydoc_data"})
GENERATED_MARKER = "gencodec"  # header word of the generated charmap codec tables in encodings/
HELDOUT_FRACTION = 0.1
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class SourceFile:
    """One corpus module: its path relative to the stdlib root (POSIX form) and its split."""

    relpath: str
    split: str
    root: Path

    @property
    def path(self) -> Path:
        return self.root / self.relpath

    def read(self) -> str:
        """The module's text, exactly as on disk (strict UTF-8, newlines untouched)."""
        return self.path.read_bytes().decode("utf-8")


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    """The interpreter version that defines the corpus, e.g. ``3.11.7``."""
    return ".".join(str(part) for part in sys.version_info[:3])


def heldout_score(relpath: str) -> float:
    """A stable number in [0, 1) derived from the relative path; below the fraction means held out."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(relpath: str, heldout_fraction: float = HELDOUT_FRACTION) -> str:
    """``"heldout"`` or ``"train"`` for a module, by :func:`heldout_score`."""
    return "heldout" if heldout_score(relpath) < heldout_fraction else "train"


def _is_generated(path: Path) -> bool:
    with path.open("rb") as handle:
        return GENERATED_MARKER.encode() in handle.read(400)


def _decodes_as_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def list_corpus(root: Path | None = None, heldout_fraction: float = HELDOUT_FRACTION) -> list[SourceFile]:
    """Every corpus module under ``root`` (default: the running stdlib), sorted by relative path, with its split."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {root}")
    files: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of excluded trees (site-packages can be huge).
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            if not path.is_file() or _is_generated(path) or not _decodes_as_utf8(path):
                continue
            relpath = path.relative_to(root).as_posix()
            files.append(SourceFile(relpath, split_of(relpath, heldout_fraction), root))
    files.sort(key=lambda f: f.relpath)
    return files


def select_split(files: list[SourceFile], split: str) -> list[SourceFile]:
    """The files of one split (``"train"`` or ``"heldout"``), order kept."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return [f for f in files if f.split == split]


def subset(files: list[SourceFile], max_files: int | None) -> list[SourceFile]:
    """A deterministic subset of at most ``max_files`` per split, evenly spaced over the sorted list (for tests).

    Taking files from each split separately keeps both splits non-empty even for a handful of files.
    """
    if max_files is None:
        return files
    picked: list[SourceFile] = []
    for split in SPLITS:
        part = select_split(files, split)
        if len(part) <= max_files:
            picked.extend(part)
            continue
        step = len(part) / max_files
        picked.extend(part[int(i * step)] for i in range(max_files))
    return sorted(picked, key=lambda f: f.relpath)


def corpus_summary(files: list[SourceFile]) -> dict[str, object]:
    """Counts and identity of a corpus, for recipe metadata and prompt provenance."""
    return {
        "python_version": python_version(),
        "python_implementation": sys.implementation.name,
        "stdlib_root": str(files[0].root) if files else str(stdlib_root()),
        "files": {split: len(select_split(files, split)) for split in SPLITS},
        "bytes": {split: sum(f.path.stat().st_size for f in select_split(files, split)) for split in SPLITS},
        "heldout_rule": "sha256(relpath)[:8] as big-endian int / 2**64 < heldout_fraction",
        "excluded_dirs": sorted(EXCLUDED_DIRS),
    }
