"""llama.cpp as a bench row (``ddte bench --llama-cpp PATH``): what a CPU user runs instead of ddte, beside it in
the same interleaved run, on the same prompts (as token ids), sampling and threads.

PATH names a ``llama-server`` binary (or the folder holding it) that the user built; nothing is fetched. The
server runs the pair's target GGUF (the file ``ddte fetch`` assembled, or a ``--target FILE.gguf``) on 127.0.0.1
with the bench's thread count, plain autoregressive decoding, and each prompt is one ``POST /completion`` with the
prompt cache off, so every row pays its prompt. Its sampler chain is cut to the target's law at the bench's settings
(temperature and top-p only: no top-k, min-p, typical-p or penalties). The row's times are the server's own
(``timings``: prompt processing, then the predicted tokens), which leave out HTTP; TPOT is its time per token after
the first.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from decode.drafting.sampling import SamplingConfig
from decode.stats import GenerationStats

KIND = "llama-cpp"
START_SECONDS = 120.0  # a 1.5B GGUF loads in seconds; a server that is not up by then failed


def server_binary(path: str | Path) -> Path:
    """The ``llama-server`` binary ``path`` names (the file, or a folder holding it or its ``bin/``); ValueError in
    one line otherwise."""
    path = Path(path).expanduser()
    for candidate in (path, path / "llama-server", path / "bin" / "llama-server"):
        if candidate.is_file():
            return candidate
    raise ValueError(f"--llama-cpp {path}: no llama-server there (build it: docs/results.md, 'llama.cpp beside ddte')")


def target_gguf(paths: dict[str, Path]) -> Path:
    """The GGUF file the pair's target was loaded from: a ``--target FILE.gguf``, or the file ``ddte fetch`` keeps
    beside the converted folder. ValueError naming what to pass otherwise."""
    target = Path(paths["target"])
    if target.suffix == ".gguf" and target.is_file():
        return target
    found = sorted(target.parent.glob("*.gguf")) if target.name == "hf" else []
    if len(found) == 1:
        return found[0]
    raise ValueError(f"--llama-cpp runs a GGUF, and the target {target} is not one (use a fetched pair such as "
                     "--pair qwen-coder, or --target FILE.gguf)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaCppServer:
    """A ``llama-server`` on one GGUF, started by :meth:`start` and stopped by :meth:`stop` (a context manager)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int) -> None:
        self.binary, self.gguf, self.threads, self.context = binary, gguf, threads, context
        self.url = ""
        self.process: subprocess.Popen | None = None

    def start(self) -> LlamaCppServer:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [str(self.binary), "-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
                   "--host", "127.0.0.1", "--port", str(port), "-c", str(self.context), "-np", "1"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.process.stderr.read() if self.process.stderr else "")[-400:]
                raise ChildProcessError(f"llama-server exited with {self.process.returncode}: {tail.strip()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise ChildProcessError(f"llama-server did not answer /health within {START_SECONDS:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> LlamaCppServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def complete(self, ids: list[int], seed: int, sampling: SamplingConfig, max_new: int) -> dict:
        """One completion of the token ids ``ids``; the server's ``timings`` (``prompt_ms``, ``predicted_ms``,
        ``predicted_n``)."""
        body = {"prompt": ids, "n_predict": max_new, "seed": seed, "cache_prompt": False,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0, "min_p": 0.0,
                "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "dry_multiplier": 0.0, "xtc_probability": 0.0, "samplers": ["top_p", "temperature"]}
        request = urllib.request.Request(f"{self.url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.loads(reply.read())["timings"]


class LlamaCppRunner:
    """The bench runner of the ``llama-cpp`` row (bench/decoding.py's runner interface: ``method``, ``notes``,
    :meth:`one`) on a started :class:`LlamaCppServer`."""

    def __init__(self, method, server: LlamaCppServer) -> None:
        self.method, self.server = method, server
        self.notes = {"engine": f"llama.cpp {server.binary.name} on {server.gguf.name}, {server.threads} thread(s)"}

    def one(self, ids: list[int], seed: int, sampling: SamplingConfig, max_new: int) -> GenerationStats:
        timings = self.server.complete(ids, seed, sampling, max_new)
        prompt, predicted, n = (float(timings["prompt_ms"]) / 1000, float(timings["predicted_ms"]) / 1000,
                                int(timings["predicted_n"]))
        stats = GenerationStats(new_tokens=n, wall_seconds=prompt + predicted)
        first = prompt + (predicted / n if n else 0.0)  # the prompt's pass and the first token, as the other rows
        stats.seconds["prefill"] += first
        stats.first_token_seconds = first
        return stats
