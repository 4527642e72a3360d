"""`ddte serve --max-batch N` end to end, run as one script inside a loopback-only network namespace
(tests/ddte/test_serve_batch.py runs it through tests/isolation.py), on the tiny pairs of tests/ddte/serve_cases.py.

``python -m tests.ddte.serve_batch_cases FOLDER CASE...`` prints ``ok CASE`` for each case that passed.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.ddte.serve_cases import (
    MODEL,
    PROMPT,
    REPO,
    _answers,
    _metric,
    _serving_url,
    client,
    outcomes,
    post,
    run_cases,
    running,
    served,
    two_token_law,
    wait_until,
)


def served_batch(pair_yaml: Path, method: str = "traversal@1,3,0", max_batch: int = 4, max_queue: int = 64,
                 verifier=None, eos: bool = True):
    """What ``ddte serve --max-batch N --kernels default`` serves: the batch decoder opened by decode/session.py."""
    from ddte.serve.app import Served
    from decode.session import PairRequest, open_session
    from decode.verifiers import get_verifier

    session = open_session(PairRequest(pair_yaml), method, "default", "fitted", batch=max_batch)
    if not eos:
        session.decoder.eos_token_id = None
    verifier = verifier or get_verifier(session.decoding.method.verifier)
    return Served(MODEL, session.pair, session.decoder, session.policy, session.decoding.method.text, max_queue, 64,
                  max_batch=max_batch, verifier=verifier)


def ask_all(base: str, bodies: list[dict], clients: int) -> list[tuple[int, dict]]:
    """``bodies`` sent by ``clients`` threads at once, each taking the next body; the answers in order."""
    answers: list = [None] * len(bodies)
    todo = iter(range(len(bodies)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            answers[i] = post(base, "/v1/completions", bodies[i])

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return answers


def case_same_tokens(pairs: dict, folder: Path) -> None:
    """A seeded request gives the same tokens through --max-batch 4 beside three others as alone through --max-batch
    1 (its rows are the same bits: decode/batch.py), greedy and sampled, streamed or not, with top-p; the openai
    client streams from a batch."""
    bodies = [{"model": MODEL, "prompt": PROMPT + "x" * (seed % 3), "max_tokens": 20, "seed": seed,
               "temperature": (0.0, 0.7, 1.0, 1.3)[seed % 4], "top_p": 0.9 if seed % 5 == 0 else 1.0}
              for seed in range(12)]
    with running(served(pairs["chat"])) as base:
        alone = [post(base, "/v1/completions", body) for body in bodies]
    with running(served_batch(pairs["chat"])) as base:
        together = ask_all(base, bodies, 4)
        openai = client(base)
        chunks = list(openai.completions.create(stream=True, **bodies[1]))
        assert _metric(base, "ddte_batch_size_count") > 0 and _metric(base, "ddte_target_pass_tokens_sum") > 0
    assert all(status == 200 for status, _ in alone + together), [s for s, _ in alone + together]
    assert [a["ddte"]["token_ids"] for _, a in together] == [a["ddte"]["token_ids"] for _, a in alone]
    assert [a["choices"][0]["text"] for _, a in together] == [a["choices"][0]["text"] for _, a in alone]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone[1][1]["choices"][0]["text"]


def case_exact_law(pairs: dict, folder: Path) -> None:
    """The first two tokens of 800 seeded T = 1 requests from 4 concurrent clients, decoded in batches of 4, against
    the target's exact law (χ²); a batch whose verifier is shown the wrong q fails the same test."""
    from tests.decode.test_lossless import P_VALUE, SAMPLES, UniformDraftSpecInfer, chi2_p_value
    from tests.decode.test_lossless import PROMPT as IDS

    exact = two_token_law(pairs["toy"], IDS)
    bodies = [{"model": MODEL, "prompt": IDS, "max_tokens": 2, "seed": seed} for seed in range(SAMPLES)]
    for verifier, should_pass in ((None, True), (UniformDraftSpecInfer(), False)):
        serve = served_batch(pairs["toy"], "specinfer@1,4,0", verifier=verifier, eos=False)
        with running(serve) as base:
            answers = ask_all(base, bodies, 4)
            alone = _metric(base, 'ddte_batch_size_bucket{le="1"}')  # steps that advanced one request only
            steps = _metric(base, "ddte_batch_size_count")
        assert all(status == 200 for status, _ in answers)
        counts: dict = {}
        for _, answer in answers:
            key = tuple(answer["ddte"]["token_ids"])
            counts[key] = counts.get(key, 0) + 1
        p_value = chi2_p_value(exact, counts)
        assert (p_value > P_VALUE) == should_pass, f"verifier {verifier}: χ² p = {p_value:.2e}"
        assert alone < steps, "no step advanced two requests together"


def case_many_clients(pairs: dict, folder: Path) -> None:
    """64 clients at once on batches of 4 and a queue of 16: none lost (each answered 200 or, beyond the queue's
    bound, 429 as documented), every 200 the tokens its seed gives alone, the queue never deeper than its bound, and
    the resident memory of the server's process bounded."""
    import psutil

    bodies = [{"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "seed": seed} for seed in range(64)]
    with running(served(pairs["chat"])) as base:
        alone = [post(base, "/v1/completions", body)[1]["ddte"]["token_ids"] for body in bodies]
    process = psutil.Process()
    with running(served_batch(pairs["chat"], max_queue=16)) as base:
        ask_all(base, bodies[:8], 8)  # warm up: the first steps allocate what the rest reuse
        rss = process.memory_info().rss
        answers = ask_all(base, bodies, 64)
        grown = (process.memory_info().rss - rss) / 2**20
        counted = outcomes(base)
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 20, statuses
    for (status, answer), want in zip(answers, alone, strict=True):
        if status == 200:
            assert answer["ddte"]["token_ids"] == want
        else:
            assert answer["error"]["type"] == "rate_limit_error" and answer["error"]["code"] == "queue_full", answer
    assert counted.get(("completions", "200")) == 8 + statuses.count(200), counted
    assert counted.get(("completions", "429"), 0) == statuses.count(429), counted
    assert grown < 200, f"resident memory grew {grown:.0f} MB over 64 clients"


def case_cancel(pairs: dict, folder: Path) -> None:
    """Two streams in a batch of 2, both left after their first chunk: both generations stop (their slots free),
    each is counted 499, and the next two requests are answered from the same batch."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    with running(served_batch(pairs["chat"], max_batch=2, eos=False)) as base:
        host, port = base.removeprefix("http://").split(":")
        connections = []
        for _ in range(2):
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            connections.append(connection)
        for connection in connections:
            response = connection.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data: ")
            connection.close()
        wait_until(lambda: _metric(base, "ddte_requests_running") == 0, "a generation went on after its client left",
                   30)
        assert _metric(base, "ddte_generation_tokens_total") < 2 * 400
        wait_until(lambda: outcomes(base).get(("completions", "499")) == 2, "the left streams were not counted 499")
        answers = ask_all(base, [{"model": MODEL, "prompt": PROMPT, "max_tokens": 8}] * 2, 2)
        assert [status for status, _ in answers] == [200, 200], answers
        assert all(a["usage"]["completion_tokens"] == 8 for _, a in answers), answers


def case_cli(pairs: dict, folder: Path) -> None:
    """``ddte serve --max-batch 3`` says it batches, answers, reports per-position acceptance, and exits 0 at
    SIGTERM; --max-batch 0 is one line before any model loads."""
    import signal

    serve = [sys.executable, "-m", "ddte", "serve", "--pair", str(pairs["chat"]), "--model-name", MODEL,
             "--kernels", "default", "--port", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    bad = subprocess.run([*serve, "--max-batch", "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--max-batch" in bad.stderr
    proc = subprocess.Popen([*serve, "--max-batch", "3"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        base = _serving_url(proc)
        wait_until(lambda: _answers(base), "ddte serve did not answer at the URL it printed", 60)
        answers = ask_all(base, [{"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "seed": s} for s in range(6)],
                          3)
        assert [status for status, _ in answers] == [200] * 6, answers
        assert _metric(base, "ddte_batch_size_count") > 0
        import urllib.request

        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'ddte_spec_decode_acceptance_rate_per_pos{position="1"}' in text, text[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def main(argv: list[str]) -> int:
    return run_cases(globals(), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
