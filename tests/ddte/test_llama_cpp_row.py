"""bench/llama_cpp.py: the llama-cpp bench row against a stand-in ``llama-server`` (a small HTTP script with its
command line, /health and /completion), so the row's plumbing is checked where no llama.cpp is built: the server's
flags (the GGUF, threads, loopback, context), the body of each completion (token ids, no prompt cache, the sampler
chain cut to temperature and top-p), the row's times from the server's timings, and the refusals."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from bench.llama_cpp import LlamaCppRunner, LlamaCppServer, server_binary, target_gguf
from bench.method import Method
from decode.drafting.sampling import SamplingConfig

FAKE = '''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
log = open(LOG, "a")
log.write(json.dumps({"argv": args}) + "\\n"); log.flush()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"status": "ok"}')
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({"body": body}) + "\\n"); log.flush()
        n = body["n_predict"]
        reply = {"content": "x", "timings": {"prompt_ms": 10.0 * len(body["prompt"]), "predicted_ms": 50.0 * n,
                                             "predicted_n": n}}
        data = json.dumps(reply).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path) -> tuple[Path, Path]:
    binary, log = tmp_path / "bin" / "llama-server", tmp_path / "calls.jsonl"
    binary.parent.mkdir()
    binary.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{FAKE}")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary, log


def test_the_row_runs_the_target_gguf_and_reads_the_servers_timings(fake_server, tmp_path):
    binary, log = fake_server
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert server_binary(tmp_path) == binary and server_binary(binary.parent) == binary
    with LlamaCppServer(binary, gguf, threads=1, context=512) as server:
        runner = LlamaCppRunner(Method("llama-cpp"), server)
        stats = runner.one([1, 2, 3, 4], seed=7, sampling=SamplingConfig(0.6, 0.9), max_new=20)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    argv, body = calls[0]["argv"], calls[1]["body"]
    assert argv[argv.index("-m") + 1] == str(gguf) and argv[argv.index("-t") + 1] == "1"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("-c") + 1] == "512"
    assert body["prompt"] == [1, 2, 3, 4] and body["n_predict"] == 20 and body["seed"] == 7
    assert body["cache_prompt"] is False and body["samplers"] == ["top_p", "temperature"]
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.6, 0.9, 0, 0.0)
    assert stats.new_tokens == 20 and stats.wall_seconds == pytest.approx(0.04 + 1.0)
    assert stats.first_token_seconds == pytest.approx(0.04 + 0.05)  # the prompt, then one token's share
    assert server.process is None  # stopped on leaving


def test_what_the_row_refuses(tmp_path):
    with pytest.raises(ValueError, match="no llama-server there"):
        server_binary(tmp_path)
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(ValueError, match="runs a GGUF"):
        target_gguf({"target": folder})
    (tmp_path / "model-q4.gguf").write_bytes(b"GGUF")
    assert target_gguf({"target": folder}) == tmp_path / "model-q4.gguf"  # the fetched file beside the folder
    assert Method.parse("llama-cpp").is_hf and Method.parse("llama-cpp").key == "llama-cpp"


def test_a_server_that_exits_is_one_error(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('bad model file')\nsys.exit(3)\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(ChildProcessError, match="exited with 3: bad model file"):
        LlamaCppServer(binary, tmp_path / "m.gguf", 1, 256).start()


def test_a_llama_cpp_row_lets_the_bench_give_the_stock_weights_back():
    """The row reads its own GGUF, not the pair's stock weights: beside ddte rows alone, they are given back."""
    from ddte.commands.bench import stock_readers

    assert stock_readers([Method("llama-cpp"), Method.static("traversal", "1,3,0")]) == []
    assert stock_readers([Method("llama-cpp"), Method("ar"), Method("ar-kernels")]) == ["ar"]
