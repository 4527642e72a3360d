"""The per-machine cache: what ddte measures once on a machine (kernel choices, latency tables), read by every later
command, and measured by one process at a time.

Two commands started together on an empty cache would measure at once: each would time its passes while the other
loads both cores, they would choose different kernels, and the last writer's contended timings would stay cached for
every later run. So every measurement holds the cache's one lock
(:func:`measurement_lock`), and :func:`read_or_measure` reads the cache again once it holds it: a command that waited
for another's measurement of the same thing takes that one instead of measuring beside it.

One cache, keyed by the pair's fingerprint and the machine's identity (:func:`machine_identity`), holds every kind of
measurement (:data:`KINDS`: the kernel choice, decode/models/kernel_choice.py; the latency table and what a
batch's passes cost beyond it, decode/cost/measure.py), each read or measured once through
:func:`cached_measurement`, each kind in files of its own (a kind added later leaves the files cached before it
readable). A cached file that does not read as this kind's measurement of this pair and machine (an older ddte's,
say) is measured again once, and the line announcing that measurement says so.
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from ddte_core.paths import staged_file

if TYPE_CHECKING:
    from decode.models.cached_lm import CachedLM

__all__ = ["KINDS", "cache_file", "cached_measurement", "cached_value", "machine_identity", "measurement_lock",
           "read_or_measure"]

LOCK_NAME = ".measure.lock"
# each kind of measurement and the prefix of its files (the names every cache written so far holds)
KINDS = {"kernels": "kernels-", "latency table": "", "batch cost": "batch-"}


class Measured(Protocol):
    """A cached measurement records the pair and the machine it measured."""

    pair: str
    machine: str


Value = TypeVar("Value", bound=Measured)


def machine_identity(target: CachedLM, draft: CachedLM, kernels: bool = True) -> str:
    """What a measured time depends on besides the pair: the processor (its model name and a digest of its flags, as a
    hypervisor may give every Xeon one name; or the GPU's name) with the limits set on its kernels
    (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``: they change which paths run, :func:`ddte_core.machine.
    kernel_limits`), torch's threads, both models' dtypes and, with ``kernels``, the path each runs and its attention
    where it is not plain sdpa. A kernel choice is cached under it without the paths (it chooses them), a latency
    table with them."""
    import torch

    from ddte_core.machine import cpu_flags_digest, cpu_model, kernel_limits
    from decode.models.kernels import DEFAULT

    limits = kernel_limits()
    processor = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else \
        f"{cpu_model()} flags {cpu_flags_digest()}" + (f" limited by {limits}" if limits else "")
    threads = torch.get_num_threads()

    def model(lm: CachedLM) -> str:
        dtype = str(lm.dtype).removeprefix("torch.")
        if not kernels:
            return dtype
        path = dtype if lm.kernel == DEFAULT else f"{dtype} {lm.kernel}"
        # the attention a multi-row pass runs moves its time (grouped heads unrepeated: decode/models/attention.py)
        attention = getattr(getattr(lm, "config", None), "_attn_implementation", None)
        return path if attention in (None, "sdpa") else f"{path} {attention}"

    return (f"{processor}; {threads} torch thread{'' if threads == 1 else 's'}; "
            f"target {model(target)}, draft {model(draft)}")


def cache_file(cache: Path, kind: str, fingerprint: str, identity: str) -> Path:
    """Where the ``kind`` measurement (:data:`KINDS`) of a pair (``fingerprint``) on a machine (``identity``) lives:
    ``<cache>/<prefix><digest>.json``."""
    digest = hashlib.sha256(f"{fingerprint}\n{identity}".encode()).hexdigest()[:20]
    return cache / f"{KINDS[kind]}{digest}.json"


def cached_value(cache: Path | None, kind: str, fingerprint: str, identity: str,
                 parse: Callable[[str], Value]) -> Value | None:
    """The ``kind`` measurement of this pair and machine cached in ``cache`` (``parse`` of its text), else None."""
    path = None if cache is None else cache_file(cache, kind, fingerprint, identity)
    return read_cached(path, _reader(parse, fingerprint, identity))


def cached_measurement(cache: Path | None, kind: str, fingerprint: str, identity: str, parse: Callable[[str], Value],
                       measure: Callable[[], Value], dump: Callable[[Value], str],
                       announce: Callable[[str], None] | None = None,
                       covers: Callable[[Value], bool] | None = None) -> tuple[Value, Path | None]:
    """The ``kind`` measurement of this pair and machine, and where it is cached: read from ``cache`` where a file
    there parses (``parse``) as one of this pair and machine that ``covers`` what is asked, else measured once under
    the cache's lock and written whole (:func:`read_or_measure`). ``announce`` hears one line before a measurement,
    which says when a cached file was there but could not serve (measured again). ``cache`` None: measure, keep
    nothing."""
    path = None if cache is None else cache_file(cache, kind, fingerprint, identity)

    def say() -> None:
        if announce is None:
            return
        again = " (the file there is an older ddte's or another measurement's: measured again)" if \
            path is not None and path.is_file() else ""
        announce(f"measuring this machine's {kind} once ({identity})" + (f"; cached at {path}{again}" if path else ""))

    return read_or_measure(path, _reader(parse, fingerprint, identity, covers), measure, dump, say), path


def _reader(parse: Callable[[str], Value], fingerprint: str, identity: str,
            covers: Callable[[Value], bool] | None = None) -> Callable[[str], Value | None]:
    def read(text: str) -> Value | None:
        value = parse(text)
        mine = (value.pair, value.machine) == (fingerprint, identity)
        return value if mine and (covers is None or covers(value)) else None

    return read


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
