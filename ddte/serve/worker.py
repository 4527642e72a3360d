"""One decoding worker: requests queue in arrival order and one thread decodes them on the loaded pair, up to
``--max-batch`` together in one batch (a :class:`Batch`: requests join the running batch between its steps, as slots
free, and leave it when done or cancelled; continuous batching; one at a time where the batch holds one).

The queue is bounded: a full queue refuses at once
(the app answers 429) instead of letting a client hang. Each :class:`Job` turns the decoder's steps into text as
they come (after each step of the batch): it decodes the tokens so far, holds back what could still
become a stop string or is half a character, sends the rest to the client's event queue on the event loop, and asks
the decoder to stop when a stop string appears or the client has gone.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from ddte.serve.requests import CompletionRequest


@dataclass
class Event:
    """What the worker tells the waiting handler: ``text`` (a delta), ``done`` (with the result), or ``error``."""

    kind: str
    text: str = ""
    result: dict = field(default_factory=dict)
    status: int = 500


class Job:
    """One request on its way through the worker. Its events reach the handler's event loop thread-safely."""

    def __init__(self, request: CompletionRequest, tokenizer, loop: asyncio.AbstractEventLoop) -> None:
        self.request, self.tokenizer, self.loop = request, tokenizer, loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already final (sent, for a stream)
        self.text = ""  # a whole answer's final text, sent once with the result (no wake-up per step)
        self.stop_hit = False
        self.enqueued = time.perf_counter()
        self.first_token_at: float | None = None

    def cancel(self) -> None:
        """The client is gone: the generation ends at its next step, or never starts."""
        self.cancelled.set()

    def _put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _send_until(self, text: str, end: int) -> None:
        if end > self.sent:
            if self.request.stream:
                self._put(Event("text", text[self.sent:end]))
            self.text = text[:end]
            self.sent = end

    def on_step(self, emitted: list[int]) -> bool:
        """The decoder's step callback (worker thread): send what is final; False stops the generation."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.extend(emitted)
        if not self.request.stream and not self.request.stop:
            return not self.cancelled.is_set()  # nothing to send or match before the end
        text = self._text()
        found = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
        if found:
            self.stop_hit = True
            self._send_until(text, min(found))
            return False
        hold = max((len(s) for s in self.request.stop), default=1) - 1  # a stop string may still complete
        end = len(text) - hold
        while end > self.sent and text[end - 1] == "\ufffd":  # half a multi-byte character so far
            end -= 1
        self._send_until(text, end)
        return not self.cancelled.is_set()

    def finish(self, result: dict) -> None:
        """The generation ended: send the rest of the text (unless a stop string cut it) and the result."""
        if not self.stop_hit:
            text = self._text()
            self._send_until(text, len(text))
        self._put(Event("done", result={**result, "text": self.text}))

    def fail(self, message: str, status: int = 500) -> None:
        self._put(Event("error", text=message, status=status))


class Batch(Protocol):
    """What the worker drives in batch mode (the app's :class:`ddte.serve.batching.BatchRunner`): ``admit`` starts a
    job in the batch (False: it failed alone, answered already), ``step`` advances every admitted job once and
    returns those that ended (answered, or cancelled), ``fail_all`` answers every admitted job with an error and
    empties the batch (a step that raised)."""

    size: int

    def admit(self, job: Job) -> bool: ...

    def step(self) -> list[Job]: ...

    def fail_all(self, message: str) -> None: ...


class Worker:
    """The queue and the one thread that decodes up to ``batch.size`` jobs together.

    The queue holds at most ``max_queue`` jobs whose clients are still there (jobs in the running batch do not
    count): a job whose client left is dropped from the queue (and from its depth) when the next job is queued or
    taken.
    """

    def __init__(self, max_queue: int, batch: Batch) -> None:
        self._batch = batch
        self.max_queue = max_queue
        self._queued: collections.deque[Job] = collections.deque()
        self._ready = threading.Condition()
        self.active: list[Job] = []  # the jobs decoding now
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name="ddte-serve-worker", daemon=True)

    @property
    def running(self) -> Job | None:
        """A job decoding now (None: the worker is idle)."""
        active = self.active
        return active[0] if active else None

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when the queue is full or the server is closing."""
        with self._ready:
            self._drop_left()
            if self.closing or len(self._queued) >= self.max_queue:
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

    def _take(self, free: int, wait: bool) -> list[Job] | None:
        """Up to ``free`` queued jobs whose clients are still there, waiting for one when ``wait`` (the batch is
        empty); None once the worker is closing and ``wait``: nothing is left to decode."""
        with self._ready:
            while True:
                self._drop_left()
                if self.closing:
                    return None if wait else []
                if self._queued or not wait:
                    return [self._queued.popleft() for _ in range(min(free, len(self._queued)))]
                self._ready.wait()

    def _loop(self) -> None:
        """Continuous batching: between steps, queued jobs join while the batch has room; each step advances every
        job in it; a job leaves when it ends or its client left. Closing admits no one, and the batch decodes on
        until its jobs end (a stop's drain cuts them after its deadline)."""
        batch = self._batch
        while (jobs := self._take(batch.size - len(self.active), wait=not self.active)) is not None:
            self.active = self.active + [job for job in jobs if batch.admit(job)]
            if not self.active:
                continue
            try:
                ended = batch.step()
            except Exception as err:  # one step serves every job in it: they fail together, never the worker
                batch.fail_all(f"generation failed: {_first_line(err)}")
                ended = list(self.active)
            self.active = [job for job in self.active if job not in ended]


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def new_seed() -> int:
    """A seed for a request that gave none."""
    return secrets.randbits(63)
