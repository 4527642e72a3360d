"""How ``ddte serve`` listens and stops: the socket bound before uvicorn starts (so the URL printed is the one bound,
``--port 0`` included, and a taken port is one line), uvicorn run on it, and a bounded drain.

A stop (Ctrl-C or SIGTERM) stops accepting, fails the queued requests at once (503), lets the running ones finish for
at most :data:`DRAIN_SECONDS` (then cuts them: 503, or an error event for a stream), and returns once the answers are
sent: the signal is how a server is asked to stop, so the command exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddte.serve.worker import Worker

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB (--max-body-kib): a whole context of text or token ids is far less
DRAIN_SECONDS = 30.0  # how long a stop waits for the running request; the queued ones are answered 503 at once
ANSWER_SECONDS = 10.0  # after the drain: how long uvicorn waits for the answers to be sent before it cancels them
BACKLOG = 2048  # uvicorn's default


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) and listening.

    Raises:
        OSError: with a one-line message, when the port is taken or the host is not an address here.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may bind while old ones TIME_WAIT
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({err.strerror or err})") from err
    return sock


def url_of(sock: socket.socket) -> str:
    """The base URL a bound socket is reached at (an IPv6 address in brackets, the port the one bound)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def serve(app, sock: socket.socket, worker: Worker, drain_seconds: float = DRAIN_SECONDS) -> None:
    """Serve ``app`` on ``sock`` until a signal, then stop: see the module's docstring. ``worker`` is the app's
    (``app.state.worker``)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=ANSWER_SECONDS)
    _server(config, worker, drain_seconds).run(sockets=[sock])


async def drain(worker: Worker, seconds: float) -> None:
    """Fail the queued requests (503) at once, wait up to ``seconds`` for the running ones, then cut them (503)."""
    worker.close()
    deadline = time.monotonic() + seconds
    while worker.running is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    worker.cut_running()


def _server(config, worker: Worker, drain_seconds: float):
    """uvicorn's server, except that a stop first stops accepting and drains the worker (before uvicorn waits for
    open requests to be answered), and that the signal that stopped it is not raised again afterwards."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            for listener in self.servers:
                listener.close()
            await drain(worker, drain_seconds)
            await super().shutdown(sockets)

    return Server(config)
