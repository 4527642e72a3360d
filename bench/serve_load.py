"""`ddte serve` under concurrent load, measured from the clients' side (``ddte bench-serve``).

For each ``--max-batch`` value a live server is started as its own process (``ddte serve --port 0`` on 127.0.0.1,
the command users run, its kernel line kept), and for each concurrency level that many clients of the real
``openai`` package stream the level's requests back to back (every level the same requests: prompt and seed by
index). Per level: aggregate output tokens/s (every client's tokens
over the level's wall time), time per output token of each request after its first text (TPOT), and time to the
first text (TTFT, queueing included). Optionally, first, one request at a time direct (``SpeculativeDecoder``, opened
through decode/session.py as the server opens it) against the same request through a ``--max-batch 1`` server.

This module prints nothing; ``progress`` hears a line per level. Imports no app code: the server is a process.
"""

from __future__ import annotations

import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

PROMPTS = ("def parse_header(line):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "def merge_sorted(a, b):\n", "import os\n\n\ndef walk_files(root):\n")


@dataclass(frozen=True)
class LoadPlan:
    """What to run: the server's pair, method, torch threads and kernels (as ``ddte serve`` takes them; kernels None:
    the pair's own, auto), and the clients'."""

    pair: str = "shipped"
    method: str = "traversal@1,3,0"
    threads: int = 1
    kernels: str | None = None
    max_batches: tuple[int, ...] = (1, 4)
    clients: tuple[int, ...] = (1, 2, 4, 8)
    requests: int = 8  # per level (at least one per client)
    max_tokens: int = 64
    temperature: float = 0.6
    prompts: tuple[str, ...] = PROMPTS

    @property
    def server_args(self) -> tuple[str, ...]:
        kernels = ("--kernels", self.kernels) if self.kernels else ()
        return ("--pair", self.pair, "--method", self.method, "--threads", str(self.threads), *kernels)


def check_plan(plan: LoadPlan) -> None:
    """ValueError (one line) for what the server would refuse only once it runs, asked before it starts: the method
    (its grammar, its file), the pair (its config, its fetched models, the kernels asked of its dtypes), and each
    request (max_tokens with the longest prompt within the pair's context; the app checks the temperature)."""
    from decode.pair import check_kernel_request, find_tokenizer_dir, load_tokenizer, pair_context_limit
    from decode.pair_spec import read_pair_config
    from decode.policies.spec import parse_verifier_spec

    try:
        parse_verifier_spec(plan.method)[1].check_file()
    except (ValueError, KeyError) as err:
        raise ValueError(f"--method {plan.method}: {err.args[0] if err.args else err}") from err
    pair = read_pair_config(plan.pair)
    pair.check_available()
    check_kernel_request(pair, "cpu", None, plan.kernels)
    limit = pair_context_limit(pair)
    folder = find_tokenizer_dir(pair.target, pair.tokenizer)
    if limit is None or folder is None:
        return  # the server answers what it cannot take; the bench then stops on its first refusal
    tokenizer = load_tokenizer(folder)
    longest = max(len(tokenizer(prompt)["input_ids"]) for prompt in plan.prompts)
    if plan.max_tokens > limit - longest:
        raise ValueError(f"--max-new-tokens {plan.max_tokens} does not fit: the pair's context is {limit} tokens and "
                         f"the longest prompt holds {longest}, leaving {limit - longest}")


@dataclass(frozen=True)
class Level:
    """One (max_batch, clients) level: aggregate output tokens/s; TPOT and TTFT in ms over its requests."""

    max_batch: int
    clients: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    tpot_ms_p50: float
    tpot_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_p90: float


@contextmanager
def live_server(server_args: Sequence[str], max_batch: int, max_queue: int, seconds: float = 1800):
    """A ``ddte serve`` process on a free loopback port; yields ``(base URL, the lines it printed before serving)``.
    SIGTERM at the end (it drains and exits 0). RuntimeError if it exits before it serves."""
    argv = [sys.executable, "-m", "ddte", "serve", "--host", "127.0.0.1", "--port", "0", "--max-batch",
            str(max_batch), "--max-queue", str(max_queue), *server_args]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:  # goes on reading, so that the server never blocks on a full pipe
        for line in proc.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen, deadline = [], time.time() + seconds
    try:
        while (line := lines.get(timeout=max(deadline - time.time(), 0.01))) is not None:
            if line.startswith("serving "):
                break
            seen.append(line)
        else:
            raise RuntimeError(f"ddte serve exited before it served: {' / '.join(seen[-5:])}")
        yield line.split(" on ")[-1].split()[0], seen
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except BaseException:  # it did not drain in time, or a second Ctrl-C: no server outlives the bench
                proc.kill()
                proc.wait()
                if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                    raise


def stream_one(base: str, prompt: str, max_tokens: int, temperature: float, seed: int) -> tuple[float, float, int]:
    """One streamed completion through the openai client: (seconds to the first text, seconds in all, tokens)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
    start, first, tokens = time.perf_counter(), None, 0
    for chunk in client.completions.create(model="ddte", prompt=prompt, max_tokens=max_tokens, seed=seed,
                                           temperature=temperature, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


def run_level(base: str, plan: LoadPlan, max_batch: int, clients: int) -> Level:
    """``clients`` threads streaming the level's requests back to back, each taking the next: request i asks prompt
    ``i mod len(prompts)`` with seed i, so every level runs the same requests (at least ``clients`` of them)."""
    records: list[tuple[float, float, int]] = []
    todo = iter(range(max(plan.requests, clients)))
    lock = threading.Lock()
    failures: list[str] = []

    def client() -> None:
        while True:
            with lock:
                i = None if failures else next(todo, None)
            if i is None:
                return
            try:
                record = stream_one(base, plan.prompts[i % len(plan.prompts)], plan.max_tokens, plan.temperature, i)
            except Exception as err:  # a refusal or a lost server: the level stops, one line says why
                with lock:
                    failures.append(f"request {i}: {_first_line(err)}")
                return
            with lock:
                records.append(record)

    # daemons: a Ctrl-C ends the bench at once (the server is stopped), never waiting on a client's open stream
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"the server at {base} failed {failures[0]}")
    tokens = sum(r[2] for r in records)
    tpot = [1000 * (r[1] - r[0]) / (r[2] - 1) for r in records if r[2] > 1]
    ttft = [1000 * r[0] for r in records]
    return Level(max_batch, clients, len(records), tokens, seconds, tokens / seconds,
                 float(np.percentile(tpot, 50)) if tpot else float("nan"),
                 statistics.fmean(tpot) if tpot else float("nan"), float(np.percentile(ttft, 50)),
                 float(np.percentile(ttft, 90)))


def sweep(plan: LoadPlan, progress: Callable[[str], None] = lambda line: None) -> tuple[list[Level], dict]:
    """Every level of ``plan``, one live server per ``max_batch``; ``(levels, each server's printed lines by
    max_batch)``. Each server first answers one request unmeasured (the first passes allocate)."""
    levels, printed = [], {}
    for max_batch in plan.max_batches:
        with live_server(plan.server_args, max_batch, max(plan.requests, *plan.clients)) as (base, lines):
            printed[max_batch] = lines
            progress(f"--max-batch {max_batch}: serving at {base}")
            try:
                stream_one(base, plan.prompts[0], min(plan.max_tokens, 8), plan.temperature, 0)
            except Exception as err:  # the server refused or failed its first request: one line, not a traceback
                raise RuntimeError(f"the server at {base} failed its first request: {_first_line(err)}") from err
            for clients in plan.clients:
                levels.append(run_level(base, plan, max_batch, clients))
                progress(markdown_row(levels[-1]))
    return levels, printed


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300]}" if text else type(err).__name__


TABLE_HEAD = ("| --max-batch | clients | requests | output tokens/s (all clients) | TPOT ms p50 | TPOT ms mean | "
              "TTFT ms p50 | TTFT ms p90 |\n|---:|---:|---:|---:|---:|---:|---:|---:|")


def markdown_row(level: Level) -> str:
    return (f"| {level.max_batch} | {level.clients} | {level.requests} | {level.tokens_per_s:.2f} | "
            f"{level.tpot_ms_p50:.1f} | {level.tpot_ms_mean:.1f} | {level.ttft_ms_p50:.0f} | "
            f"{level.ttft_ms_p90:.0f} |")


def markdown_table(levels: Sequence[Level]) -> str:
    return "\n".join([TABLE_HEAD, *(markdown_row(level) for level in levels)])


def as_json(levels: Sequence[Level]) -> list[dict]:
    return [asdict(level) for level in levels]


def plot(levels: Sequence[Level], path: str, title: str) -> None:
    """Aggregate tokens/s and TPOT against clients, one line per ``--max-batch``, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for max_batch in sorted({level.max_batch for level in levels}):
        rows = [level for level in levels if level.max_batch == max_batch]
        clients = [level.clients for level in rows]
        left.plot(clients, [level.tokens_per_s for level in rows], marker="o", label=f"--max-batch {max_batch}")
        right.plot(clients, [level.tpot_ms_p50 for level in rows], marker="o", label=f"--max-batch {max_batch}")
    for axis, label in ((left, "output tokens/s, all clients"), (right, "TPOT ms (p50)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def against_generate(plan: LoadPlan, pairs: int, progress: Callable[[str], None] = lambda line: None) -> dict:
    """One request at a time, ``pairs`` times (after one pair to warm up): direct on a decoder opened through
    decode/session.py as ``ddte serve`` opens it, then the same request (same seed) through a live ``--max-batch 1``
    server, not streamed. Mean tokens/s of each and the mean of their ratio with a bootstrap 95 % interval."""
    from openai import OpenAI

    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.session import PairRequest, open_session

    session = open_session(PairRequest(plan.pair), plan.method, plan.kernels)
    ids = list(session.pair.tokenizer(plan.prompts[0])["input_ids"])
    sampling = SamplingConfig(plan.temperature)
    direct, through = [], []
    with live_server(plan.server_args, 1, 1) as (base, _):
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
        for i in range(pairs + 1):
            start = time.perf_counter()
            tokens = len(session.decoder.generate(ids, plan.max_tokens, session.policy, TorchRandom(i),
                                                  sampling).tokens)
            direct_rate = tokens / (time.perf_counter() - start)
            start = time.perf_counter()
            answer = client.completions.create(model="ddte", prompt=plan.prompts[0], max_tokens=plan.max_tokens,
                                               seed=i, temperature=plan.temperature)
            if i > 0:  # the first pair warms both paths up
                direct.append(direct_rate)
                through.append(answer.usage.completion_tokens / (time.perf_counter() - start))
                progress(f"pair {i}: direct {direct[-1]:.1f} tokens/s, server {through[-1]:.1f}")
    ratios = np.asarray(through) / np.asarray(direct)
    rng = np.random.default_rng(0)
    means = [ratios[rng.integers(0, len(ratios), len(ratios))].mean() for _ in range(2000)]
    return {"direct_tokens_per_s": statistics.fmean(direct), "server_tokens_per_s": statistics.fmean(through),
            "ratio": float(ratios.mean()), "interval_95": [float(np.percentile(means, 2.5)),
                                                           float(np.percentile(means, 97.5))], "pairs": pairs}
