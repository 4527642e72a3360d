"""What real clients send to `ddte serve` and read back (issue 72), with the real openai client: the forms of prompts
and messages they send, n samples, vendor fields ignored or refused with the reason, log-probabilities and echo as
lm-eval reads them, usage up to the stop string, the chat role with the first token, 404, Retry-After,
/v1/models/{id}, CORS, system_fingerprint, ignore_eos, and a χ² test of top_k and min_p through HTTP.

The cases (tests/ddte/serve_client_cases.py) run as one script in a loopback-only network namespace
(tests/isolation.py), as tests/ddte/test_serve.py's do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.isolation import run_loopback_only

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cases", [
    ["accepted_forms", "refused_and_ignored", "logprobs"],
    ["usage_and_stream", "http", "ignore_eos", "exact_law_filtered"],
], ids=["forms", "answers"])
def test_serve_client_cases(tmp_path, cases):
    """Each case prints ``ok CASE (seconds)``; no server logs a traceback."""
    code, output = run_loopback_only([sys.executable, "-m", "tests.ddte.serve_client_cases", str(tmp_path), *cases],
                                     cwd=REPO, timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert code == 0, output[-6000:]
    assert [line.split(" (")[0] for line in output.splitlines() if line.startswith("ok ")] == [f"ok {c}" for c in cases]
    assert "Traceback" not in output and "Exception in ASGI" not in output, output[-6000:]
