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


def test_a_selector_decodes_in_a_batch_and_a_batch_of_one_is_the_single_request(tmp_path):
    """A session opened for a batch serves a policy that reads root features (the shipped selector): three requests
    decode together; a seeded request alone on that batch gives exactly the tokens of the one-request decoder."""
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.engine import SpeculativeDecoder
    from decode.generation import Job
    from decode.session import PairRequest, open_session
    from decode.verifiers import get_verifier

    selector = REPO / "models" / "selectors" / "traversal.onnx"  # the shipped pair's
    session = open_session(PairRequest(), f"traversal@selector={selector}", "default", "fitted", batch=4)
    decoder, policy, pair = session.decoder, session.policy, session.pair
    verifier = get_verifier("traversal")
    sampling = SamplingConfig(0.8)
    jobs = [Job(pair.tokenizer.encode(text), 12, policy, TorchRandom(seed), sampling, verifier)
            for seed, text in enumerate(["Once upon a time", "The cat", "def add(a, b):"])]
    generations = decoder.generate(jobs)
    assert all(len(g.tokens) >= 1 and g.stats.steps >= 1 for g in generations)
    alone = decoder.generate([Job(jobs[0].prompt_ids, 12, policy, TorchRandom(0), sampling, verifier)])[0].tokens
    single = SpeculativeDecoder(pair.target, pair.draft, verifier, pair.eos_token_id, latency=decoder.latency)
    assert single.generate(jobs[0].prompt_ids, 12, policy, TorchRandom(0), sampling).tokens == alone
