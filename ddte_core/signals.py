"""A kill (SIGTERM) unwinds like Ctrl-C, so clean-up code runs: staging folders and temporary files are removed,
worker processes stopped."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt; the previous handler comes back afterwards."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# the MLflow client's calls that write to its store: a Ctrl-C inside one would leave a transaction open
_STORE_WRITES = ("log_batch", "log_metric", "log_param", "log_params", "set_tag", "set_terminated", "log_dict",
                 "log_figure", "log_artifact", "log_artifacts", "log_inputs", "log_text", "update_run",
                 "create_run", "delete_tag")


class _Deferred:
    """Ctrl-C and SIGTERM as KeyboardInterrupt, except inside a guarded call, where it waits for the call's end."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.fired = False

    def handle(self, signum, frame) -> None:
        self.fired = True
        if self.depth:
            self.pending = True
            return
        raise KeyboardInterrupt

    def guard(self, call):
        def guarded(*args, **kwargs):
            self.depth += 1
            try:
                return call(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth and self.pending:
                    self.pending = False
                    raise KeyboardInterrupt

        return guarded


@contextlib.contextmanager
def training_interrupts(client=None) -> Iterator[None]:
    """Around a Lightning ``fit`` (or ``validate``/``test``): Ctrl-C and SIGTERM end the command as every ddte command
    ends on them, a KeyboardInterrupt (one line, exit 130), and never inside a write of ``client`` (an
    ``MlflowClient``, the run's logger's; None: nothing to guard).

    Lightning catches a KeyboardInterrupt for its "graceful shutdown": it finalizes its loggers, ignores SIGINT from
    then on, and calls ``sys.exit(1)``. Here that exit becomes the KeyboardInterrupt it started as, and the handlers
    of both signals are put back. A signal that arrives while ``client`` writes to its store waits for the write to
    end: one cut short could leave the store's SQLite database locked for the shutdown's own writes (the run's
    status), which then fail, "database is locked", one traceback after another."""
    import threading

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    deferred = _Deferred()
    wrapped = [name for name in _STORE_WRITES if client is not None and callable(getattr(client, name, None))]
    for name in wrapped:
        setattr(client, name, deferred.guard(getattr(client, name)))
    previous = {sig: signal.signal(sig, deferred.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except SystemExit:
        if deferred.fired:  # Lightning's exit after it caught the interrupt
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for name in wrapped:
            delattr(client, name)  # the instance's wrapper goes: the class's method is seen again
