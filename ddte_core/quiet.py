"""One way to keep third-party chatter out of a command's output: transformers' progress bars and its logged
warnings, for the span of a block, restored after it (so a caller that wants them keeps them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers(bars: bool = False, warnings: bool = False) -> Iterator[None]:
    """Inside the block, transformers shows no progress bar (unless ``bars``) and logs only errors (unless
    ``warnings``): "Loading weights" bars per model, and deprecation notices raised inside its own code paths (HF
    assisted generation passes its assistant both a generation config and arguments, and warns about itself)."""
    from transformers.utils import logging as hf_logging

    had_bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    if not bars:
        hf_logging.disable_progress_bar()
    if not warnings:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if had_bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(level)
