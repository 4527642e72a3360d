"""How ``ddte serve`` listens and stops: the socket bound before uvicorn starts (so the URL printed is the one bound,
``--port 0`` included, and a taken port is one line), uvicorn run on it, and a bounded drain.

A stop (Ctrl-C or SIGTERM) stops accepting, fails the queued requests at once (503), lets the running ones finish for
at most :data:`DRAIN_SECONDS` (then cuts them: 503, or an error event for a stream), and returns once the answers are
sent: the signal is how a server is asked to stop, so the command exits 0. A second Ctrl-C during the drain cuts the
running requests at once and ends the command as any interrupted ddte command ends (one line, exit 130); the app's
shutdown still runs, so no task is left for the event loop to cancel (uvicorn skips it then, and the lifespan task's
CancelledError was logged as a traceback).
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
ANSWER_SECONDS = 10  # after the drain: how long uvicorn waits for the answers to be sent before it cancels them
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
    server = _server(config, worker, drain_seconds)
    server.run(sockets=[sock])
    if server.force_exit:  # a second Ctrl-C: the drain was cut short
        raise KeyboardInterrupt


async def drain(worker: Worker, seconds: float, forced=lambda: False) -> None:
    """Fail the queued requests (503) at once, wait up to ``seconds`` for the running ones (or until ``forced()``:
    a second Ctrl-C), then cut them (503)."""
    worker.close()
    deadline = time.monotonic() + seconds
    while worker.running is not None and time.monotonic() < deadline and not forced():
        await asyncio.sleep(0.05)
    worker.cut_running()


def _server(config, worker: Worker, drain_seconds: float):
    """uvicorn's server, except that a stop first stops accepting and drains the worker (before uvicorn waits for
    open requests to be answered), that the signal that stopped it is not raised again afterwards, and that a forced
    stop (a second Ctrl-C) still shuts the app down (its lifespan: the worker's thread), which uvicorn would skip."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second signal of either kind (uvicorn forces on a second SIGINT only)
                self.force_exit = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            for listener in self.servers:
                listener.close()
            await drain(worker, drain_seconds, lambda: self.force_exit)
            await super().shutdown(sockets)
            if self.force_exit:  # uvicorn skips the app's shutdown then; its lifespan task would be cancelled
                await self.lifespan.shutdown()

    return Server(config)
