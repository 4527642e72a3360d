"""The selector tests share the session fixtures of tests/conftest.py (synthetic data set, one tiny training run)."""

from __future__ import annotations

from tests.factories import TINY_TRAIN_CONFIG as TINY_CONFIG

__all__ = ["TINY_CONFIG"]
