"""Places to write: the one check that no file stands where an output, or a folder above it, has to be, and the one
staged write that leaves a file whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

INSTALL_ROOT = Path(__file__).resolve().parents[1]  # the folder holding ddte's packages and its configs/


def bundled(path: str | Path) -> Path:
    """``path`` where it exists; else, for a relative path such as ``configs/pair/shipped.yaml``, the same path under
    ddte's own folder when it is there. So the shipped configs, and the config paths written inside them, resolve from
    any working folder; a user's own file always wins."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    installed = INSTALL_ROOT / path
    return installed if installed.exists() else path


def cache_root() -> Path:
    """Where ddte keeps what it fetched or measured once per machine: ``$DDTE_CACHE``, else ``~/.cache/ddte``."""
    env = os.environ.get("DDTE_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "ddte"
    if root.exists() and not root.is_dir():
        raise ValueError(f"the ddte cache {root} ($DDTE_CACHE, else ~/.cache/ddte) is a file, not a folder")
    return root


def latency_cache() -> Path:
    """Where the running machine's latency tables and kernel choices are kept (decode/models/machine_cache.py):
    ``$DDTE_LATENCY_CACHE``, else ``<cache_root>/latency``.

    Raises:
        ValueError: naming the variable it came from, where no folder can be kept there (a file in the way, a place
            that cannot be written).
    """
    env = os.environ.get("DDTE_LATENCY_CACHE")
    if env:
        return usable_folder(Path(env).expanduser(), "$DDTE_LATENCY_CACHE")
    return usable_folder(cache_root() / "latency", "the latency cache ($DDTE_CACHE/latency, else "
                         "~/.cache/ddte/latency)")


def usable_folder(path: Path, what: str) -> Path:
    """``path``, a folder ddte may create and write in; ValueError naming ``what`` (where the path came from) where a
    file stands at it or above it, or nothing can be written there. Nothing is left behind."""
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{what} {path}: {blocking} is a file, not a folder")
    if not folder_is_writable(path):
        raise ValueError(f"{what} {path}: no folder can be written there (no permission, a read-only or virtual file "
                         "system)")
    return path


def refuse_file_in_the_way(path: str | Path, what: str = "output", folder: bool = True) -> Path:
    """``path`` as a Path; ValueError when a folder above it (or, for a ``folder`` output, ``path`` itself) is an
    existing file, so the output could never be written there. Nothing is created."""
    path = Path(path)
    places = (path, *path.parents) if folder else path.parents
    blocking = next((p for p in places if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{what} {path}: {blocking} is a file, not a folder")
    return path


def check_output_folder(path: str | Path, what: str = "--output", own: str | None = None,
                        overwrite: bool = False) -> Path:
    """The one rule for a command that writes a folder: the folder may be new or empty; one holding this command's
    own earlier output (its ``own`` file) is replaced only with ``overwrite``; any other non-empty folder is refused,
    so a data set or another run's files are never written into. ValueError names the way out; nothing is created."""
    path = refuse_file_in_the_way(path, what)
    if not path.is_dir() or not any(path.iterdir()):
        return path
    if own is not None and (path / own).is_file():
        if overwrite:
            return path
        raise ValueError(f"{what} {path} holds an earlier run ({own}): pass --overwrite to replace it, or choose "
                         "another folder")
    raise ValueError(f"{what} {path} is not empty and holds no earlier run of this command: choose a new folder")


@contextlib.contextmanager
def staged_file(path: str | Path) -> Iterator[Path]:
    """Write ``path`` whole or not at all: yields a temporary path in the same folder (created if missing) for the
    caller to write; on success it becomes an ordinary shared file (0644; mkstemp makes 0600) renamed onto
    ``path``, and on any error it is removed."""
    path = writable_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def writable_file(path: str | Path) -> Path:
    """The regular file an output path names: a symbolic link's target (the link is written through, not replaced).
    ValueError for a link that leads nowhere (a loop, a missing target) and for a device, pipe or socket, which a
    staged write would replace with a file (as root, /dev/null itself)."""
    path = Path(path)
    if path.is_symlink():
        try:
            path = path.resolve(strict=True)
        except (OSError, RuntimeError) as err:
            raise ValueError(f"{path}: a symbolic link that leads nowhere (a loop or a missing target)") from err
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ValueError(f"{path} is not a regular file (a device, pipe or socket): give a file name")
    return path


def folder_is_writable(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (or, where it does not exist yet, in the nearest folder above it
    that does), by creating and removing one: permission bits do not say so for root, a read-only mount or a
    virtual file system such as /proc."""
    import tempfile

    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ddte-probe-"):
            return True
    except OSError:
        return False
