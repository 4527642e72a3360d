"""The Ray engine's tests (tests/data_gen/ray_cases.py), run by a pytest of their own in a network namespace with only
loopback up (tests/isolation.py): a local Ray bound to 127.0.0.1 still listens on every interface of its host."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.isolation import run_loopback_only

REPO = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("ray_cases.py")


def test_ray_engine_in_a_loopback_only_network_namespace():
    pytest.importorskip("ray", reason="the Ray engine's extra is not installed: pip install -e '.[ray]'")
    code, output = run_loopback_only([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(CASES)],
                                     cwd=REPO)
    assert code == 0, output[-6000:]
    assert " passed" in output and "skipped" not in output, output[-2000:]
