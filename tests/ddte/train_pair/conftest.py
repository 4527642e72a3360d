"""Shared fixtures of the pair tests: offline Hugging Face, and one tiny pair trained per session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Before transformers/datasets are imported by any test: never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")
# datasets caches every loaded file; keep that out of ~/.cache in tests.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="ddte-test-datasets-"))

from tests.factories import REPO, run_subcommand

TINY_CONFIG = REPO / "configs" / "train-pair" / "tiny.yaml"
SHIPPED = REPO / "models"


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> Path:
    """A pair trained with configs/train-pair/tiny.yaml (a few seconds), shared by the tests that only read it."""
    from ddte.commands import train_pair

    out = tmp_path_factory.mktemp("tiny-pair")
    assert run_subcommand(train_pair, ["--config", str(TINY_CONFIG), "--output", str(out)]) == 0
    return out
