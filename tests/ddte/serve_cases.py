"""`ddte serve` end to end, run as one script inside a loopback-only network namespace (tests/test_serve.py runs it
through tests/isolation.py): the server listens on 127.0.0.1 there, and every client request stays inside.

``python -m tests.ddte.serve_cases FOLDER CASE...`` builds tiny pairs in FOLDER, runs each CASE (a function below),
and prints ``ok CASE`` for each; an assertion error ends it with a traceback and a non-zero exit.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):\n"
MODEL = "tiny"
SERVER_THREAD = "uvicorn-under-test"  # the event loop's thread in running()


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def make_pairs(folder: Path) -> dict[str, Path]:
    """``chat``: a tiny pair over the shipped tokenizer with a chat template (context 512); ``toy``: the vocabulary-8
    pair of tests/decode/test_lossless.py (the χ² case)."""
    from tests.factories import chat_tokenizer, tiny_llama

    def save(root: Path, target, draft) -> Path:
        target.save_pretrained(root / "target")
        draft.save_pretrained(root / "draft")
        chat_tokenizer().save_pretrained(root / "tokenizer")
        names = ("target", "draft", "tokenizer")
        (root / "pair.yaml").write_text(json.dumps({name: str(root / name) for name in names}))
        return root / "pair.yaml"

    return {"chat": save(folder / "chat", tiny_llama(1, 4096, 32, 1, 1.0, 512), tiny_llama(2, 4096, 16, 1, 1.0, 512)),
            "toy": save(folder / "toy", tiny_llama(11, 8, 32, 2, 6.0, 64), tiny_llama(12, 8, 32, 1, 6.0, 64))}


def served(pair_yaml: Path, method: str = "traversal@1,3,0", max_queue: int = 64, verifier=None, eos: bool = True):
    from bench.method import Method
    from ddte.serve.app import Served
    from decode.batch import BatchDecoder
    from decode.pair import load_pair_config
    from decode.policies.build import build_policy
    from decode.verifiers import get_verifier

    pair = load_pair_config(pair_yaml)
    parsed = Method.parse(method)
    decoder = BatchDecoder(pair.target, pair.draft, pair.eos_token_id if eos else None)
    return Served(MODEL, pair, decoder, build_policy(parsed.policy, pair, parsed.verifier), parsed.key, max_queue, 64,
                  verifier=verifier or get_verifier(parsed.verifier))


@contextmanager
def running(serve):
    """The app of ``serve`` on uvicorn in a thread, on a free loopback port; its base URL."""
    import uvicorn

    from ddte.serve.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(serve), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=SERVER_THREAD, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def logged():
    """The log records of the server (uvicorn's and the app's) while the block runs; use it inside ``running``, whose
    uvicorn configures its loggers."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep, loggers = Keep(), [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(keep)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(keep)


def no_traceback(records: list[logging.LogRecord]) -> None:
    bad = [r for r in records if r.exc_info or "Traceback" in r.getMessage() or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


def outcomes(base: str) -> dict[tuple[str, str], int]:
    """``/metrics``' request counts by (endpoint, outcome)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    found = {}
    for line in lines:
        if line.startswith("ddte_requests_total{"):
            labels, value = line.removeprefix("ddte_requests_total{").split("} ")
            endpoint, outcome = (part.split("=")[1].strip('"') for part in labels.split(","))
            found[endpoint, outcome] = int(float(value))
    return found


def wait_until(check, what: str, seconds: float = 10.0) -> None:
    deadline = time.time() + seconds
    while not check():
        assert time.time() < deadline, what
        time.sleep(0.05)


def post(base: str, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate_cli(pair_yaml: Path, folder: Path, *args: str) -> list[int]:
    """``ddte generate`` on the same pair; the generated token ids."""
    from ddte.cli import main

    out = folder / f"gen-{time.monotonic_ns()}.jsonl"
    assert main(["generate", "--pair", str(pair_yaml), "--chat", "off", "--verifier", "traversal", "--action",
                 "1,3,0", "--output", str(out), *args]) == 0
    return json.loads(out.read_text().splitlines()[0])["tokens"]


# --- the cases ------------------------------------------------------------------------------------------------------
def case_openai_client(pairs: dict, folder: Path) -> None:
    """The real openai client: chat and completions, streamed and not; a stream says what the whole answer says."""
    with running(served(pairs["chat"])) as base:
        openai = client(base)
        assert [m.id for m in openai.models.list().data] == [MODEL]
        chat = openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=12, seed=3)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
        assert chat.choices[0].message.role == "assistant"
        extra = chat.model_extra["ddte"]
        assert extra["steps"] >= 1 and extra["mean_acceptance_length"] >= 1 and extra["actions"]
        parts = [c.choices[0].delta.content or "" for c in openai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, seed=3, stream=True)
            if c.choices]
        assert "".join(parts) == chat.choices[0].message.content
        text = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=5, temperature=0.7)
        chunks = list(openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=5, temperature=0.7,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text
        assert chunks[-1].usage.completion_tokens == text.usage.completion_tokens


def case_same_as_generate(pairs: dict, folder: Path) -> None:
    """Greedy through the server equals `ddte generate` at T = 0; a seeded T = 1 request equals generate's seed."""
    with running(served(pairs["chat"])) as base:
        for body, args in (({"temperature": 0}, ["--temperature", "0"]),
                           ({"temperature": 1.0, "seed": 7}, ["--temperature", "1", "--seed", "7"])):
            status, answer = post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                            **body})
            assert status == 200, answer
            want = generate_cli(pairs["chat"], folder, PROMPT, "--max-new-tokens", "24", *args)
            assert answer["ddte"]["token_ids"] == want


def two_token_law(pair_yaml: Path, ids: list[int]) -> dict[tuple[int, int], float]:
    """The toy target's exact law of the first two tokens after ``ids`` (its 8-token vocabulary), by (a, b)."""
    from decode.pair import load_pair_config

    pair = load_pair_config(pair_yaml)
    with torch.inference_mode():
        first = torch.softmax(pair.target.model(torch.tensor([ids])).logits[0, -1].double(), -1)
        second = torch.softmax(pair.target.model(torch.tensor([ids + [a] for a in range(8)])).logits[:, -1].double(),
                               -1)
    return {(a, b): float(first[a] * second[a, b]) for a in range(8) for b in range(8)}


def case_exact_law(pairs: dict, folder: Path) -> None:
    """The first two tokens of 800 seeded T = 1 requests against the target's exact law (χ², as the loop tests); a
    server whose verifier is shown the wrong q fails the same test."""
    from tests.decode.test_lossless import P_VALUE, SAMPLES, UniformDraftSpecInfer, chi2_p_value
    from tests.decode.test_lossless import PROMPT as IDS

    exact = two_token_law(pairs["toy"], IDS)
    for verifier, should_pass in ((None, True), (UniformDraftSpecInfer(), False)):
        serve = served(pairs["toy"], "specinfer@1,4,0", verifier=verifier, eos=False)  # every token counts, as there
        counts: dict = {}
        with running(serve) as base:
            for seed in range(SAMPLES):
                status, answer = post(base, "/v1/completions", {"model": MODEL, "prompt": IDS, "max_tokens": 2,
                                                                "seed": seed})
                assert status == 200, answer
                key = tuple(answer["ddte"]["token_ids"])
                counts[key] = counts.get(key, 0) + 1
        p_value = chi2_p_value(exact, counts)
        assert (p_value > P_VALUE) == should_pass, f"verifier {verifier}: χ² p = {p_value:.2e}"


def case_concurrent_clients(pairs: dict, folder: Path) -> None:
    """32 clients at once: each answered, each with its own answer (the one its seed gives alone)."""
    bodies = [{"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "seed": seed} for seed in range(32)]
    with running(served(pairs["chat"], max_queue=64)) as base:
        alone = [post(base, "/v1/completions", body)[1]["ddte"]["token_ids"] for body in bodies[:4]]
        answers: list = [None] * len(bodies)

        def ask(i: int) -> None:
            answers[i] = post(base, "/v1/completions", bodies[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert all(a is not None and a[0] == 200 for a in answers), [a and a[0] for a in answers]
        assert [a[1]["ddte"]["token_ids"] for a in answers[:4]] == alone
        assert len({tuple(a[1]["ddte"]["token_ids"]) for a in answers}) > 1


class GatedDecoder:
    """The real decoding step, but each step first waits for ``gate`` (so a test can hold the worker busy)."""

    def __init__(self, decoder, gate: threading.Event) -> None:
        self.decoder, self.gate = decoder, gate

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)

    def step(self):
        assert self.gate.wait(60)
        return self.decoder.step()


def case_queue_and_disconnect(pairs: dict, folder: Path) -> None:
    """A full queue answers 429 at once; a client that leaves mid-stream stops its generation, and the server goes
    on serving."""
    import http.client

    gate = threading.Event()
    serve = served(pairs["chat"], max_queue=1)
    serve.decoder = GatedDecoder(serve.decoder, gate)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    with running(serve) as base:
        results: list = []
        first = threading.Thread(target=lambda: results.append(post(base, "/v1/completions", body)))
        first.start()
        deadline = time.time() + 10
        while _metric(base, "ddte_requests_running") < 1:  # the worker holds it, at the gate
            assert time.time() < deadline, "the first request never started"
            time.sleep(0.05)
        second = threading.Thread(target=lambda: results.append(post(base, "/v1/completions", body)))
        second.start()  # waits in the queue
        while _queue_depth(base) < 1:
            assert time.time() < deadline, "the second request never queued"
            time.sleep(0.05)
        status, answer = post(base, "/v1/completions", body)
        assert status == 429 and answer["error"]["type"] == "rate_limit_error", answer
        gate.set()
        first.join(60)
        second.join(60)
        assert [r[0] for r in results] == [200, 200]
        # a stream of many tokens, left after its first chunk
        host, port = base.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 400, "stream": True}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        connection.close()
        deadline = time.time() + 30
        while _metric(base, "ddte_requests_running") != 0:
            assert time.time() < deadline, "the generation went on after its client left"
            time.sleep(0.1)
        assert _metric(base, "ddte_generation_tokens_total") < 16 + 400  # two answers of 8, and the cut stream
        wait_until(lambda: outcomes(base).get(("completions", "499")) == 1, "the left stream was not counted 499")
        assert outcomes(base) == {("completions", "200"): 2, ("completions", "429"): 1,
                                  ("completions", "499"): 1}, outcomes(base)
        assert post(base, "/v1/completions", body)[0] == 200


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _queue_depth(base: str) -> int:
    with urllib.request.urlopen(base + "/health", timeout=10) as response:
        return json.loads(response.read())["queue_depth"]


BAD = [
    (b"{not json", "not valid JSON"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 10**6}, "does not fit"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": 3}, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": PROMPT, "seed": "7"}, "seed"),
    ({"model": MODEL, "prompt": PROMPT, "stop": [1]}, "stop"),
    ({"model": MODEL, "prompt": PROMPT, "n": 0}, "n must be in [1, 64]"),
    ({"model": MODEL, "prompt": PROMPT, "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": PROMPT}, "model is required"),
    ({"model": MODEL, "prompt": ""}, "prompt is empty"),
    ({"model": MODEL, "prompt": [5, 99999]}, "token ids"),
    ([1, 2], "JSON object"),
    ({"model": MODEL, "prompt": PROMPT, "logit_bias": {"5": 3}}, "logit_bias"),
    ({"model": MODEL, "prompt": PROMPT, "logprobs": 30}, "logprobs must be in [0, 20]"),
]


def case_bad_inputs(pairs: dict, folder: Path) -> None:
    """Each bad request: a 400 with an OpenAI error object naming the problem; the server keeps serving."""
    with running(served(pairs["chat"])) as base:
        for body, words in BAD:
            status, answer = post(base, "/v1/completions", None if isinstance(body, bytes) else body,
                                  raw=body if isinstance(body, bytes) else None)
            assert status == 400 and words in answer["error"]["message"], (body, status, answer)
            assert answer["error"]["type"] == "invalid_request_error"
        status, answer = post(base, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard",
                                                                                           "content": "x"}]})
        assert status == 400 and answer["error"]["param"] == "messages"
        assert post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})[0] == 200
    plain = served(pairs["chat"])  # as the shipped pair: a tokenizer without a chat template
    plain.pair.tokenizer = RecordingTokenizer(plain.pair.tokenizer, chat_template=False)
    with running(plain) as base:
        status, answer = post(base, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
        assert status == 400 and "--pair qwen-coder" in answer["error"]["message"], answer


def case_stop_strings(pairs: dict, folder: Path) -> None:
    """A stop string ends the answer before it (finish_reason "stop"), streamed or not."""
    with running(served(pairs["chat"])) as base:
        status, full = post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                      "temperature": 0})
        text = full["choices"][0]["text"]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        assert status == 200 and len(stop) == 2, full
        status, cut = post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                     "temperature": 0, "stop": stop})
        assert cut["choices"][0]["text"] == text[: text.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"


class RecordingTokenizer:
    """The pair's tokenizer, recording the thread of each tokenization; ``chat_template`` may be taken away."""

    def __init__(self, tokenizer, chat_template: bool = True) -> None:
        self.tokenizer, self.threads = tokenizer, []
        if not chat_template:
            self.chat_template = None

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def case_body_edges(pairs: dict, folder: Path) -> None:
    """Issue #54, class 1: a lone UTF-16 surrogate (prompt, message or key), a body nested 100,000 deep, bytes that
    are not UTF-8 and a body over the limit are each one OpenAI error object (400, 413), counted in /metrics, with
    nothing logged; a client that leaves halfway through its body is counted 499, with nothing logged; prompts are
    tokenized off the event loop."""
    serve = served(pairs["chat"])
    serve.max_body_bytes = 256 * 1024
    serve.pair.tokenizer = tokenizer = RecordingTokenizer(serve.pair.tokenizer)
    start = b'{"model": "tiny", '
    bodies = [
        ("/v1/completions", start + b'"prompt": "a\\ud800b"}', 400, "lone surrogate"),
        ("/v1/chat/completions", start + b'"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
         "lone surrogate"),
        ("/v1/completions", start + b'"prompt": "x", "\\ud800": 1}', 400, "lone surrogate"),
        ("/v1/completions", start + b'"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests deeper"),
        ("/v1/completions", start + b'"prompt": "\xff"}', 400, "not UTF-8"),
        ("/v1/completions", start + b'"prompt": "' + b"x" * (300 * 1024) + b'"}', 413, "over 262144 bytes"),
        ("/v1/completions", start + b'"prompt": "' + b"word " * 20_000 + b'"}', 400, "no room left"),
    ]
    with running(serve) as base, logged() as records:
        for path, raw, status, words in bodies:
            got, answer = post(base, path, None, raw=raw)
            assert got == status and words in answer["error"]["message"], (raw[:60], got, answer)
            assert answer["error"]["type"] == "invalid_request_error", answer
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as left:
            left.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + start)
        wait_until(lambda: outcomes(base).get(("completions", "499")) == 1, "the client that left was not counted")
        assert post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})[0] == 200
        assert outcomes(base) == {("chat", "400"): 1, ("completions", "400"): 5, ("completions", "413"): 1,
                                  ("completions", "499"): 1, ("completions", "200"): 1}, outcomes(base)
    no_traceback(records)
    assert tokenizer.threads and SERVER_THREAD not in tokenizer.threads, tokenizer.threads


class SteppedDecoder:
    """The real decoding step, but each step first waits for ``gate`` and sleeps ``step_seconds``, and a ``fail``
    set makes it raise (so a test can hold the worker busy, or fail a stream)."""

    def __init__(self, decoder, gate: threading.Event, step_seconds: float = 0.0) -> None:
        self.decoder, self.gate, self.step_seconds = decoder, gate, step_seconds
        self.fail = False

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)

    def step(self):
        assert self.gate.wait(60)
        if self.fail:
            raise RuntimeError("the decoder broke")
        time.sleep(self.step_seconds)
        return self.decoder.step()


def case_outcomes(pairs: dict, folder: Path) -> None:
    """Issue #54, class 2: a queued client that leaves leaves /health's queue depth and its place in the queue; a
    stream that fails or is left is counted 500 or 499, not 200; max_completion_tokens null means absent, and every
    given max_tokens field is checked."""
    gate = threading.Event()
    serve = served(pairs["chat"], max_queue=1)
    serve.decoder = decoder = SteppedDecoder(serve.decoder, gate)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    host_port = None
    with running(serve) as base, logged() as records:
        host_port = base.removeprefix("http://").split(":")
        results: list = []
        first = threading.Thread(target=lambda: results.append(post(base, "/v1/completions", body)))
        first.start()
        wait_until(lambda: _metric(base, "ddte_requests_running") == 1, "the first request never started")
        leaving = http.client.HTTPConnection(host_port[0], int(host_port[1]), timeout=30)
        leaving.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        wait_until(lambda: _queue_depth(base) == 1, "the leaving request never queued")
        leaving.close()
        wait_until(lambda: _queue_depth(base) == 0, "/health counts a client that left")
        assert _metric(base, "ddte_queue_depth") == 0
        second = threading.Thread(target=lambda: results.append(post(base, "/v1/completions", body)))
        second.start()  # the place the leaver held: queued, not refused
        wait_until(lambda: _queue_depth(base) == 1, "the second request never queued")
        gate.set()
        first.join(60)
        second.join(60)
        assert [r[0] for r in results] == [200, 200], results
        decoder.fail = True
        with urllib.request.urlopen(urllib.request.Request(
                base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                headers={"Content-Type": "application/json"}), timeout=30) as response:
            events = response.read().decode()
        assert '"type": "server_error"' in events and "[DONE]" not in events, events
        decoder.fail = False
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        status, answer = post(base, "/v1/chat/completions", {**chat, "max_completion_tokens": None, "max_tokens": 3})
        assert status == 200 and answer["usage"]["completion_tokens"] <= 3, answer
        status, answer = post(base, "/v1/chat/completions", {**chat, "max_completion_tokens": 4, "max_tokens": "x"})
        assert status == 400 and answer["error"]["param"] == "max_tokens", answer
        status, answer = post(base, "/v1/completions", {**body, "stream": None, "seed": None})
        assert status == 200 and answer["object"] == "text_completion", answer
        wait_until(lambda: outcomes(base).get(("completions", "499")) == 1, "the client that left was not counted")
        assert outcomes(base) == {("completions", "200"): 3, ("completions", "499"): 1, ("completions", "500"): 1,
                                  ("chat", "200"): 1, ("chat", "400"): 1}, outcomes(base)
    no_traceback(records)


def case_stop_and_drain(pairs: dict, folder: Path) -> None:
    """Issue #54, class 2: SIGTERM answers the queued request 503 at once while the running one goes on to finish
    (200); with a drain of 1 s, a running stream that would not finish is cut (an error event, counted 503) and the
    server stops. Both through ddte/serve/server.py's serve() on this process's main thread, as the CLI runs it."""
    from ddte.serve.app import create_app
    from ddte.serve.server import listen_socket, serve, url_of

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    for drain_seconds in (30.0, 1.0):
        gate = threading.Event()
        serving = served(pairs["chat"], max_queue=4, eos=False)  # the cut stream would not end on its own
        serving.decoder = SteppedDecoder(serving.decoder, gate, step_seconds=0.0 if drain_seconds > 1 else 0.2)
        app, sock = create_app(serving), listen_socket("127.0.0.1", 0)
        base, results = url_of(sock), {}
        if drain_seconds > 1:
            driver = threading.Thread(target=_queued_get_503, args=(base, body, gate, results))
        else:
            driver = threading.Thread(target=_running_is_cut, args=(base, body, gate, results))
        driver.start()
        serve(app, sock, app.state.worker, drain_seconds)
        driver.join(60)
        counted = dict(app.state.metrics.requests)
        if drain_seconds > 1:
            assert results["queued"][0] == 503 and results["queued"][1]["error"]["type"] == "server_error", results
            assert results["running"][0] == 200, results
            assert counted == {("completions", "200"): 1, ("completions", "503"): 1}, counted
        else:
            assert '"type": "server_error"' in results["stream"] and "[DONE]" not in results["stream"], results
            assert counted == {("completions", "503"): 1}, counted


def _queued_get_503(base: str, body: dict, gate: threading.Event, results: dict) -> None:
    wait_until(lambda: _answers(base), "the server did not come up", 30)
    running = threading.Thread(target=lambda: results.update(running=post(base, "/v1/completions", body)))
    running.start()
    wait_until(lambda: _metric(base, "ddte_requests_running") == 1, "the running request never started")
    queued = threading.Thread(target=lambda: results.update(queued=post(base, "/v1/completions", body)))
    queued.start()
    wait_until(lambda: _queue_depth(base) == 1, "the second request never queued")
    os.kill(os.getpid(), signal.SIGTERM)
    queued.join(30)  # answered while the running request is still held at the gate
    assert "queued" in results and "running" not in results, results
    gate.set()
    running.join(60)


def _running_is_cut(base: str, body: dict, gate: threading.Event, results: dict) -> None:
    wait_until(lambda: _answers(base), "the server did not come up", 30)
    gate.set()
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(
        {**body, "max_tokens": 400, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        first = response.readline().decode()
        os.kill(os.getpid(), signal.SIGTERM)
        results["stream"] = first + response.read().decode()


def _answers(base: str) -> bool:
    try:
        urllib.request.urlopen(base + "/health", timeout=2).close()
        return True
    except OSError:
        return False


def case_signal(pairs: dict, folder: Path) -> None:
    """The CLI: --port 0 prints the port it bound; --cors-origin answers a preflight from that origin; a second
    server on that port is one line, exit 2, and never says it serves; SIGINT while a request streams lets it finish
    and exits 0; --host ::1 prints http://[::1]:PORT, which answers, and SIGTERM exits 0."""
    serve = [sys.executable, "-m", "ddte", "serve", "--pair", str(pairs["chat"]), "--model-name", MODEL]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*serve, "--port", "0", "--cors-origin", "http://ui.test"], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        base = _serving_url(proc)
        assert base.startswith("http://127.0.0.1:") and not base.endswith(":0"), base
        wait_until(lambda: _answers(base), "ddte serve did not answer at the URL it printed", 60)
        resident = _metric(base, "ddte_process_resident_memory_bytes")  # then the peak, which is never below it
        assert 0 < resident <= _metric(base, "ddte_process_peak_resident_memory_bytes")
        preflight = urllib.request.Request(base + "/v1/completions", method="OPTIONS", headers={
            "Origin": "http://ui.test", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(preflight, timeout=10) as response:
            assert response.headers["access-control-allow-origin"] == "http://ui.test", dict(response.headers)
        port = base.rsplit(":", 1)[1]
        second = subprocess.run([*serve, "--port", port], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2 and "serving" not in second.stderr, second.stderr
        assert second.stderr.strip().splitlines() == [f"ddte serve: error: cannot listen on 127.0.0.1:{port} "
                                                      "(Address already in use)"], second.stderr
        request = urllib.request.Request(base + "/v1/completions", data=json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.readline().startswith(b"data: ")
            proc.send_signal(signal.SIGINT)
            rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        assert proc.wait(60) == 0, "ddte serve did not exit 0 after a signal"
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = subprocess.Popen([*serve, "--host", "::1", "--port", "0"], cwd=REPO, env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        base = _serving_url(proc)
        assert base.startswith("http://[::1]:"), base
        wait_until(lambda: _answers(base), "ddte serve did not answer at the URL it printed", 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "ddte serve did not exit 0 after a signal"
    finally:
        if proc.poll() is None:
            proc.kill()


def _serving_url(proc: subprocess.Popen, seconds: float = 120) -> str:
    """The URL on ddte serve's "serving ... on URL (peak RSS ...; Ctrl-C stops)" line of stderr (read by a thread,
    which goes on reading so that the server never blocks on a full pipe)."""
    import queue

    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline, seen = time.time() + seconds, []
    while (line := lines.get(timeout=max(deadline - time.time(), 0.01))) is not None:
        if line.startswith("serving "):
            assert " GB; Ctrl-C stops)" in line and "(peak RSS " in line, line
            return line.split(" on ")[-1].split()[0]
        seen.append(line)
    raise AssertionError(f"ddte serve exited before it served: {''.join(seen)[-2000:]}")


def run_cases(cases: dict, argv: list[str]) -> int:
    """Run the cases ``argv[1:]`` (each ``cases["case_" + name]``) on the pairs made in folder ``argv[0]``; each prints
    ``ok NAME (seconds)`` when it passes."""
    folder, names = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    pairs = make_pairs(folder)
    for name in names:
        started = time.perf_counter()
        cases[f"case_{name}"](pairs, folder)
        print(f"ok {name} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


def main(argv: list[str]) -> int:
    return run_cases(globals(), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
