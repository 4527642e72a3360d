"""`ddte serve --max-batch N`: a seeded request's tokens alone and in a batch, a χ² test of exactness under 4
concurrent clients, 64 clients against a bounded queue, cancellation mid-batch, and the command line.

The cases (tests/ddte/serve_batch_cases.py) run as one script in a loopback-only network namespace
(tests/isolation.py), as tests/ddte/test_serve.py's do; the --max-batch 1 path is theirs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.isolation import run_loopback_only

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cases", [
    ["same_tokens", "cancel", "cli"],
    ["exact_law", "many_clients"],
], ids=["tokens", "load"])
def test_serve_batch_cases(tmp_path, cases):
    """Each case prints ``ok CASE (seconds)``; no server logs a traceback."""
    code, output = run_loopback_only([sys.executable, "-m", "tests.ddte.serve_batch_cases", str(tmp_path), *cases],
                                     cwd=REPO, timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert code == 0, output[-6000:]
    assert [line.split(" (")[0] for line in output.splitlines() if line.startswith("ok ")] == [f"ok {c}" for c in cases]
    assert "Traceback" not in output and "Exception in ASGI" not in output, output[-6000:]


def test_a_root_feature_policy_is_refused_in_a_batch(tmp_path):
    """A session opened for a batch refuses a policy that reads root features (a batch computes none) at its build
    step, in one line."""
    from decode.session import PairRequest, open_session

    selector = REPO / "models" / "selectors" / "traversal.onnx"  # the shipped pair's
    with pytest.raises(ValueError, match="reads root features"):
        open_session(PairRequest(), f"traversal@selector={selector}", "default", "fitted", batch=True)
