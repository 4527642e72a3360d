"""The one check of a place to write: no file may stand where the output, or a folder above it, has to be."""

from __future__ import annotations

from pathlib import Path


def refuse_file_in_the_way(path: str | Path, what: str = "output", folder: bool = True) -> Path:
    """``path`` as a Path; ValueError when a folder above it (or, for a ``folder`` output, ``path`` itself) is an
    existing file, so the output could never be written there. Nothing is created."""
    path = Path(path)
    places = (path, *path.parents) if folder else path.parents
    blocking = next((p for p in places if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{what} {path}: {blocking} is a file, not a folder")
    return path
