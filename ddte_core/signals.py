"""A kill (SIGTERM) unwinds like Ctrl-C, so clean-up code runs: staging folders and temporary files are removed,
worker processes stopped."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt; the previous handler comes back afterwards."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
