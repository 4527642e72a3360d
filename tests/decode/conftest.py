"""Fixtures shared by the decoding tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def selector_file(tmp_path_factory) -> Path:
    """A small selector trained on synthetic data with the tiny models' hidden sizes, exported to ONNX, whose guard
    leaves the fallback whenever it is beaten (tests/decode/selectors.py)."""
    from tests.decode.selectors import train_selector_file

    return train_selector_file(tmp_path_factory.mktemp("selector"))
