"""The per-machine cache: what ddte measures once on a machine (kernel choices, latency tables), read by every later
command, and measured by one process at a time.

Two commands started together on an empty cache once measured at once: each timed its passes while the other loaded
both cores (a one-token pass 29.5 ms against 10.5 alone), they chose different kernels, and the last writer's
contended timings stayed cached for every later run. So every measurement holds the cache's one lock
(:func:`measurement_lock`), and :func:`read_or_measure` reads the cache again once it holds it: a command that waited
for another's measurement of the same thing takes that one instead of measuring beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ddte_core.paths import staged_file

__all__ = ["cache_file", "measurement_lock", "read_cached", "read_or_measure"]

LOCK_NAME = ".measure.lock"
Value = TypeVar("Value")


def cache_file(cache: Path, fingerprint: str, identity: str, prefix: str = "") -> Path:
    """Where one measurement of a pair (``fingerprint``) on a machine (``identity``) lives:
    ``<cache>/<prefix><digest>.json``."""
    digest = hashlib.sha256(f"{fingerprint}\n{identity}".encode()).hexdigest()[:20]
    return cache / f"{prefix}{digest}.json"


@contextmanager
def measurement_lock(cache: Path | None) -> Iterator[None]:
    """Hold ``cache``'s one measurement lock (an advisory ``flock`` on ``<cache>/.measure.lock``): another process,
    or thread, that measures waits until this one is done. No lock without a cache."""
    if cache is None:
        yield
        return
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / LOCK_NAME, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_or_measure(path: Path | None, read: Callable[[str], Value | None], measure: Callable[[], Value],
                    dump: Callable[[Value], str], announce: Callable[[], None] | None = None) -> Value:
    """The value cached at ``path`` (``read`` of its text; None from ``read`` means stale or another pair's), else
    ``measure()`` under the cache's lock, written whole at ``path`` (``dump``). ``path`` None: measure, keep nothing.
    ``announce`` runs once, right before a measurement starts."""
    cached = read_cached(path, read)
    if cached is not None:
        return cached
    with measurement_lock(None if path is None else path.parent):
        cached = read_cached(path, read)  # measured by the process this one waited for
        if cached is not None:
            return cached
        if announce is not None:
            announce()
        value = measure()
        if path is not None:
            with staged_file(path) as tmp:
                tmp.write_text(dump(value), encoding="utf-8")
    return value


def read_cached(path: Path | None, read: Callable[[str], Value | None]) -> Value | None:
    """``read`` of the text cached at ``path``; None where there is none, it is unreadable or ``read`` refuses it."""
    if path is None or not path.is_file():
        return None
    try:
        return read(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable, or from an older ddte: measure again
