"""`ddte serve` under load, measured from the client's side: ``python -m ddte.serve.load --pair shipped``.

Starts the app in this process on a free loopback port (127.0.0.1 only), then:

1. **Server against the loop.** One request at a time, alternating a direct ``SpeculativeDecoder.generate`` call
   (what ``ddte generate`` runs) with the same request through HTTP (non-streamed), same seeds: tokens/s of each,
   and the server's ratio with a paired bootstrap interval over requests.
2. **Concurrent clients.** For each client count, every client sends its requests back to back, streamed; per
   request the time to the first text (TTFT, queueing included) and the time per output token after it (TPOT:
   the rest of the request's time over its tokens but the first step's).
3. **Memory.** The process's resident memory after each level, to see that it stays flat.

Prints markdown tables and writes them as JSON (``--output``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch


def _stream(base: str, body: dict) -> tuple[float, float, int]:
    """One streamed completion: (seconds to the first text, seconds in all, tokens generated)."""
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


def _whole(base: str, body: dict) -> tuple[float, int]:
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - start, answer["usage"]["completion_tokens"]


def free_port() -> int:
    """A free TCP port on the loopback address."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _interval(ratios: list[float], seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    values = np.asarray(ratios)
    means = [values[rng.integers(0, len(values), len(values))].mean() for _ in range(2000)]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="shipped")
    parser.add_argument("--method", default="traversal@1,3,0")
    parser.add_argument("--prompt", default="def parse_header(line):\n")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=20, help="requests direct and through the server (alternating)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import uvicorn

    from ddte.serve.app import Served, create_app
    from ddte_core.machine import environment
    from decode.drafting.sampling import SamplingConfig

    pair, key, policy, decoder = _open_decoder(args.pair, args.method)
    served = Served("ddte", pair, decoder, policy, key, max_queue=max(args.clients) * args.requests_per_client)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    ids = list(pair.tokenizer(args.prompt)["input_ids"])
    body = {"model": "ddte", "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature}
    sampling = SamplingConfig(args.temperature)
    out: dict = environment() | {"pair": args.pair, "method": key, "max_tokens": args.max_tokens,
                 "temperature": args.temperature}

    out["server_vs_generate"] = _one_at_a_time(args, decoder, policy, ids, sampling, base, body, out["cpu"],
                                               key)
    rss_start = _rss_mb()
    levels = _levels(args, base, body)
    out["levels"], out["rss_mb_at_start"] = levels, rss_start
    print(f"\nresident memory: {rss_start:.0f} MB before the levels, {levels[-1]['rss_mb']:.0f} MB after")
    server.should_exit = True
    thread.join(30)
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _open_decoder(pair_name: str, method: str):
    """``(pair, method key, policy, decoder)`` opened as ddte serve opens them (decode/session.py: the policy checked
    against the pair, this machine's kernels, then its latency table where the policy reads one), so the script
    measures what the server runs; the session's lines printed as they come."""
    from decode.session import Hooks, PairRequest, open_session

    session = open_session(PairRequest(pair_name), method, hooks=Hooks(announce=print, report=print, progress=True))
    return session.pair, session.decoding.method.text, session.policy, session.decoder


def _one_at_a_time(args, decoder, policy, ids, sampling, base: str, body: dict, cpu: str, key: str) -> dict:
    """Alternating pairs of one request direct and one through the server: both tokens/s and their ratio."""
    from decode.drafting.rng import TorchRandom

    direct, through, ratios = [], [], []
    for i in range(args.pairs + 1):  # the first pair warms both paths up
        start = time.perf_counter()
        tokens = len(decoder.generate(ids, args.max_tokens, policy, TorchRandom(i), sampling).tokens)
        direct_rate = tokens / (time.perf_counter() - start)
        seconds, served_tokens = _whole(base, {**body, "seed": i})
        if i == 0:
            continue
        direct.append(direct_rate)
        through.append(served_tokens / seconds)
        ratios.append(through[-1] / direct_rate)
    low, high = _interval(ratios)
    print(f"One request at a time, {args.pairs} pairs ({key}, {args.max_tokens} tokens, T = "
          f"{args.temperature:g}, {cpu}):\n\n| path | tokens/s |\n|---|---:|\n"
          f"| generate (direct) | {statistics.fmean(direct):.1f} |\n| server | {statistics.fmean(through):.1f} |\n"
          f"\nserver / direct: {statistics.fmean(ratios):.3f} [{low:.3f}, {high:.3f}]\n")
    return {"direct_tokens_per_s": statistics.fmean(direct), "server_tokens_per_s": statistics.fmean(through),
            "ratio": statistics.fmean(ratios), "interval_95": [low, high], "pairs": args.pairs}


def _levels(args, base: str, body: dict) -> list[dict]:
    """Each level of concurrent streaming clients: TTFT, TPOT and resident memory after it."""
    levels = []
    print("| clients | requests | TTFT ms p50 | TTFT ms p90 | TPOT ms p50 | TPOT ms p90 | RSS MB after |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for clients in args.clients:
        records: list[tuple[float, float, int]] = []
        lock = threading.Lock()

        def client(k: int, records=records, lock=lock) -> None:
            for j in range(args.requests_per_client):
                record = _stream(base, {**body, "seed": 1000 * k + j})
                with lock:
                    records.append(record)

        workers = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        ttft = [1000 * r[0] for r in records]
        tpot = [1000 * (r[1] - r[0]) / max(r[2] - 1, 1) for r in records]
        level = {"clients": clients, "requests": len(records), "ttft_ms_p50": float(np.percentile(ttft, 50)),
                 "ttft_ms_p90": float(np.percentile(ttft, 90)), "tpot_ms_p50": float(np.percentile(tpot, 50)),
                 "tpot_ms_p90": float(np.percentile(tpot, 90)), "rss_mb": _rss_mb()}
        levels.append(level)
        print(f"| {clients} | {len(records)} | {level['ttft_ms_p50']:.0f} | {level['ttft_ms_p90']:.0f} | "
              f"{level['tpot_ms_p50']:.1f} | {level['tpot_ms_p90']:.1f} | {level['rss_mb']:.0f} |", flush=True)
    return levels


if __name__ == "__main__":
    raise SystemExit(main())
