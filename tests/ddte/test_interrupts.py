"""Interrupts end every command as ddte's others end (issue 72, round 5): one line, the conventional exit code (130 for
Ctrl-C, ddte/cli.py), no traceback from a library's own shutdown (Lightning's graceful one, a client thread, uvicorn's
cancelled tasks).
"""

from __future__ import annotations

from ddte.cli import main


def test_ctrl_c_while_a_selector_trains_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """`ddte train` fits with Lightning too: its graceful shutdown's exit 1 is ddte's interrupt, one line and 130."""
    import os
    import signal

    from selector.root.model import SelectorModule
    from selector.root.synthetic import write_synthetic_dataset
    from tests.factories import TINY_TRAIN_CONFIG

    data = write_synthetic_dataset(tmp_path / "data", n_prompts=8, roots_per_prompt=4, hidden=(32, 16))
    real, calls = SelectorModule.training_step, []

    def interrupted_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SelectorModule, "training_step", interrupted_step)
    before = signal.getsignal(signal.SIGINT)
    capsys.readouterr()
    code = main(["train", "--config", str(TINY_TRAIN_CONFIG), "--data", str(data), "--tracking-uri",
                 f"sqlite:///{tmp_path / 'mlflow.db'}", f"run.output_dir={tmp_path / 'runs'}", "trainer.max_epochs=3"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 130 and err == ["ddte train: interrupted"], (code, err)
    assert signal.getsignal(signal.SIGINT) is before


SERVE_SCRIPT = """
import os, signal, sys, threading
from contextlib import asynccontextmanager
from fastapi import FastAPI
from ddte.serve.server import listen_socket, serve

SIGNALS = int(sys.argv[1])


class Worker:  # a request that runs until it is cut
    def __init__(self):
        self.closed, self.cut = threading.Event(), False

    @property
    def running(self):
        return None if self.cut else "a job"

    def close(self):
        self.closed.set()

    def cut_running(self):
        self.cut = True


worker = Worker()


def stop():
    os.kill(os.getpid(), signal.SIGINT)
    if SIGNALS == 2:
        worker.closed.wait(60)  # the drain has begun
        os.kill(os.getpid(), signal.SIGINT)
    else:
        worker.closed.wait(60)
        worker.cut = True  # the running request ends by itself


@asynccontextmanager
async def lifespan(app):
    threading.Thread(target=stop, daemon=True).start()  # the server's signal handlers are in place by now
    yield


try:
    serve(FastAPI(lifespan=lifespan), listen_socket("127.0.0.1", 0), worker, drain_seconds=30)
except KeyboardInterrupt:
    print("interrupted", worker.cut)
    sys.exit(130)
print("stopped", worker.cut)
"""


def test_a_second_ctrl_c_while_serve_drains_ends_it_at_once_in_one_line(tmp_path):
    """A first Ctrl-C drains (exit 0 once the running request ends); a second one during the drain cuts the running
    request at once and interrupts (130), and uvicorn's shutdown leaves no task to be cancelled with a traceback."""
    import subprocess
    import sys

    from tests.factories import REPO

    script = tmp_path / "serve_stop.py"
    script.write_text(SERVE_SCRIPT)
    for signals, code, said in ((1, 0, "stopped True"), (2, 130, "interrupted True")):
        out = subprocess.run([sys.executable, str(script), str(signals)], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == code and out.stdout.strip() == said, (signals, out.returncode, out.stdout,
                                                                      out.stderr[-3000:])
        assert "Traceback" not in out.stderr and "CancelledError" not in out.stderr, out.stderr[-3000:]


def test_ctrl_c_on_bench_serve_is_one_line_and_its_clients_print_nothing(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the clients stream: `ddte bench-serve` says one line and exits 130; the client threads, whose
    streams then fail as the server stops, print no traceback."""
    import contextlib
    import os
    import signal
    import threading

    import bench.serve_load as load
    from tests.factories import save_tiny_pair

    pair = save_tiny_pair(tmp_path / "pair", vocab=4096)
    capsys.readouterr()  # the saving's progress lines
    streaming, server_gone, thread_errors = threading.Barrier(3), threading.Event(), []

    @contextlib.contextmanager
    def fake_server(*_, **__):
        try:
            yield "http://127.0.0.1:9", ["kernels: target default, draft default"]
        finally:
            server_gone.set()  # the stop: every open stream fails

    def stream(*_, **__):
        if threading.current_thread() is threading.main_thread():
            return 0.01, 0.02, 2  # the warm-up request
        streaming.wait(30)
        server_gone.wait(30)
        raise ConnectionError("Connection reset by peer")

    def interrupt_once_streaming():
        streaming.wait(30)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(load, "live_server", fake_server)
    monkeypatch.setattr(load, "stream_one", stream)
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_errors.append(args.exc_value))
    threading.Thread(target=interrupt_once_streaming, daemon=True).start()
    code = main(["bench-serve", "--pair", str(pair / "pair.yaml"), "--max-batch", "2", "--clients", "2",
                 "--requests", "2", "--max-new-tokens", "4"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 130 and err == ["ddte bench-serve: interrupted"], (code, err)
    for thread in [t for t in threading.enumerate() if t.name.endswith("(client)")]:
        thread.join(30)  # the clients' failed streams have ended
    assert not thread_errors, thread_errors
