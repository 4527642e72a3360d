"""One decoding worker: jobs (a request's choices, :class:`ddte.serve.job.Job`) queue in arrival order and one
thread decodes them on the loaded pair, up to ``--max-batch`` together in one batch (a :class:`Batch`: jobs join the
running batch between its steps, as slots free, and leave it when done or cancelled; continuous batching; one at a
time where the batch holds one).

The queue is bounded: a full queue refuses at once (the app answers 429) instead of letting a client hang.
"""

from __future__ import annotations

import collections
import secrets
import threading
from typing import Protocol

from ddte.serve.job import ServedChoice


class Batch(Protocol):
    """What the worker drives in batch mode (the app's :class:`ddte.serve.batching.BatchRunner`): ``admit`` starts a
    job in the batch (False: it failed alone, answered already), ``step`` advances every admitted job once and
    returns those that ended (answered, or cancelled), ``fail_all`` answers every admitted job with an error and
    empties the batch (a step that raised)."""

    size: int

    def admit(self, job: ServedChoice) -> bool: ...

    def step(self) -> list[ServedChoice]: ...

    def fail_all(self, message: str) -> None: ...


class Worker:
    """The queue and the one thread that decodes up to ``batch.size`` jobs together.

    The queue holds at most ``max_queue`` jobs whose clients are still there beyond the running batch: the jobs in
    the batch do not count, nor as many waiting ones as the batch has free slots (they join it at its next step), so
    ``--max-batch B --max-queue Q`` takes B + Q requests at once and refuses the next. A job leaving the batch frees
    its slot for the queue at once, before the next step. A job whose client left is dropped from the queue (and from
    its depth) when the next job is queued or taken.
    """

    def __init__(self, max_queue: int, batch: Batch) -> None:
        self._batch = batch
        self.max_queue = max_queue
        self._queued: collections.deque[ServedChoice] = collections.deque()
        self._ready = threading.Condition()
        self.active: list[ServedChoice] = []  # the jobs decoding now
        self._taken = 0  # jobs taken from the queue into the batch and not out of it yet (under the lock)
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name="ddte-serve-worker", daemon=True)

    @property
    def running(self) -> ServedChoice | None:
        """A job decoding now (None: the worker is idle)."""
        active = self.active
        return active[0] if active else None

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: ServedChoice) -> bool:
        """Queue ``job``; False when the queue is full or the server is closing."""
        with self._ready:
            self._drop_left()
            if self.closing or len(self._queued) >= self.max_queue + self._room():
                return False
            self._queued.append(job)
            self._ready.notify()
        return True

    def depth(self) -> int:
        """Jobs waiting whose clients are still there."""
        with self._ready:
            return sum(not job.cancelled.is_set() for job in self._queued)

    def close(self) -> None:
        """Refuse new jobs and fail the queued ones (503); the running one goes on. Called when the server is asked
        to stop, before it waits for open requests."""
        with self._ready:
            self.closing = True
            queued, self._queued = list(self._queued), collections.deque()
            self._ready.notify()
        for job in queued:
            job.fail("the server is shutting down", status=503)

    def cut_running(self) -> None:
        """Cancel the running jobs (each generation ends at its next step) and answer them 503."""
        for running in list(self.active):
            running.cancel()
            running.fail("the server stopped before this request finished", status=503)

    def stop(self, timeout: float) -> None:
        """:meth:`close`, cancel the running jobs (each generation ends at its next step), and wait up to ``timeout``
        seconds for the thread to end."""
        self.close()
        for running in list(self.active):
            running.cancel()
        self.thread.join(timeout)

    def _drop_left(self) -> None:
        self._queued = collections.deque(job for job in self._queued if not job.cancelled.is_set())

    def _room(self) -> int:
        """Free slots in the batch (under the lock): as many queued jobs join it at its next step."""
        return max(self._batch.size - self._taken, 0)

    def _take(self, wait: bool) -> list[ServedChoice] | None:
        """As many queued jobs whose clients are still there as the batch has room for, waiting for one when
        ``wait`` (the batch is empty); None once the worker is closing and ``wait``: nothing is left to decode."""
        with self._ready:
            while True:
                self._drop_left()
                if self.closing:
                    return None if wait else []
                if self._queued or not wait:
                    taken = [self._queued.popleft() for _ in range(min(self._room(), len(self._queued)))]
                    self._taken += len(taken)
                    return taken
                self._ready.wait()

    def _left(self, count: int) -> None:
        """``count`` jobs left the batch (ended, or failed to join): their slots are the queue's room at once."""
        with self._ready:
            self._taken -= count

    def _loop(self) -> None:
        """Continuous batching: between steps, queued jobs join while the batch has room; each step advances every
        job in it; a job leaves when it ends or its client left. Closing admits no one, and the batch decodes on
        until its jobs end (a stop's drain cuts them after its deadline)."""
        batch = self._batch
        while (jobs := self._take(wait=not self.active)) is not None:
            admitted = [job for job in jobs if batch.admit(job)]
            self._left(len(jobs) - len(admitted))
            self.active = self.active + admitted
            if not self.active:
                continue
            try:
                ended = batch.step()
            except Exception as err:  # one step serves every job in it: they fail together, never the worker
                batch.fail_all(f"generation failed: {_first_line(err)}")
                ended = list(self.active)
            still = [job for job in self.active if job not in ended]
            self._left(len(self.active) - len(still))
            self.active = still


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def new_seed() -> int:
    """A seed for a request that gave none."""
    return secrets.randbits(63)
