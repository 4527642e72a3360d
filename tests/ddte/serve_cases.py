"""`ddte serve` end to end, run as one script inside a loopback-only network namespace (tests/test_serve.py runs it
through tests/isolation.py): the server listens on 127.0.0.1 there, and every client request stays inside.

``python -m tests.ddte.serve_cases FOLDER CASE...`` builds tiny pairs in FOLDER, runs each CASE (a function below),
and prints ``ok CASE`` for each; an assertion error ends it with a traceback and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch

from ddte.serve.load import free_port

REPO = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):\n"
MODEL = "tiny"


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
    from decode.engine import SpeculativeDecoder
    from decode.pair import read_pair_config
    from decode.policies.deployment import build_policy
    from decode.verifiers import get_verifier

    pair = read_pair_config(pair_yaml).load()
    parsed = Method.parse(method)
    decoder = SpeculativeDecoder(pair.target, pair.draft, verifier or get_verifier(parsed.verifier),
                                 pair.eos_token_id if eos else None)
    return Served(MODEL, pair, decoder, build_policy(parsed.policy, pair, parsed.verifier), parsed.key, max_queue, 64)


@contextmanager
def running(serve):
    """The app of ``serve`` on uvicorn in a thread, on a free loopback port; its base URL."""
    import uvicorn

    from ddte.serve.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(serve), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
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


def case_exact_law(pairs: dict, folder: Path) -> None:
    """The first two tokens of 800 seeded T = 1 requests against the target's exact law (χ², as the loop tests); a
    server whose verifier is shown the wrong q fails the same test."""
    from decode.pair import read_pair_config
    from tests.decode.test_lossless import P_VALUE, SAMPLES, UniformDraftSpecInfer, chi2_p_value
    from tests.decode.test_lossless import PROMPT as IDS

    pair = read_pair_config(pairs["toy"]).load()
    with torch.inference_mode():
        first = torch.softmax(pair.target.model(torch.tensor([IDS])).logits[0, -1].double(), -1)
        second = torch.softmax(pair.target.model(torch.tensor([IDS + [a] for a in range(8)])).logits[:, -1].double(),
                               -1)
    exact = {(a, b): float(first[a] * second[a, b]) for a in range(8) for b in range(8)}
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
    """The real decoder, but each generation first waits for ``gate`` (so a test can hold the worker busy)."""

    def __init__(self, decoder, gate: threading.Event) -> None:
        self.decoder, self.gate, self.vocab = decoder, gate, decoder.vocab

    def generate(self, *args, **kwargs):
        assert self.gate.wait(60)
        return self.decoder.generate(*args, **kwargs)


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
    ({"model": MODEL, "prompt": PROMPT, "seed": -1}, "seed"),
    ({"model": MODEL, "prompt": PROMPT, "stop": [1]}, "stop"),
    ({"model": MODEL, "prompt": PROMPT, "n": 2}, "n must be 1"),
    ({"model": MODEL, "prompt": PROMPT, "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "gpt-4", "prompt": PROMPT}, "not served"),
    ({"prompt": PROMPT}, "model is required"),
    ({"model": MODEL, "prompt": ""}, "prompt is empty"),
    ({"model": MODEL, "prompt": [5, 99999]}, "token ids"),
    ([1, 2], "JSON object"),
    ({"model": MODEL, "prompt": PROMPT, "temprature": 0.5}, "unknown field 'temprature'"),
    ({"model": MODEL, "prompt": PROMPT, "logprobs": 3}, "log-probabilities"),
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


def case_signal(pairs: dict, folder: Path) -> None:
    """SIGINT while a request streams: that request finishes, the process exits 0."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ddte", "serve", "--pair", str(pairs["chat"]), "--port", str(port),
                             "--model-name", MODEL], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "ddte serve did not come up"
                time.sleep(0.2)
        request = urllib.request.Request(base + "/v1/completions", data=json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.readline().startswith(b"data: ")
            proc.send_signal(signal.SIGINT)
            rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def main(argv: list[str]) -> int:
    folder, names = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    pairs = make_pairs(folder)
    for name in names:
        globals()[f"case_{name}"](pairs, folder)
        print(f"ok {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
