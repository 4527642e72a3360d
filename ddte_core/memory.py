"""The process's resident memory as the commands report it: ``ddte bench``'s output and JSON, ``ddte serve``'s startup
line and ``/metrics``.

A pair's footprint is what the host must have free for it: the peak of the resident set (``VmHWM``), loading and
preparing the kernels included, not only what stays. Linux reads ``/proc/self/status``; elsewhere the peak comes from
``getrusage`` and the current size is unknown (None).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["gigabytes", "peak_rss_bytes", "rss_bytes"]


def _status_bytes(field: str) -> int | None:
    """``field`` of ``/proc/self/status`` (kB there) in bytes; None where the file or the field is absent."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def rss_bytes() -> int | None:
    """The resident set now (``VmRSS``), None where it cannot be read."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int | None:
    """The resident set's peak over the process's life (``VmHWM``; else ``getrusage``'s ``ru_maxrss``, in KiB on
    Linux and in bytes on macOS), None where neither exists."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:  # Windows
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def gigabytes(nbytes: int | None) -> str:
    """``4.71 GB`` (10^9 bytes), or ``unknown``."""
    return "unknown" if nbytes is None else f"{nbytes / 1e9:.2f} GB"
