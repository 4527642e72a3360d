"""The serve worker's queue arithmetic (ddte/serve/worker.py): ``--max-queue`` counts only the requests waiting beyond
the running batch, so ``--max-batch B --max-queue Q`` takes B + Q simultaneous requests and refuses the rest, and a
job that leaves the batch frees its slot for the queue at once.

A fake batch stands for the decoder: its steps wait for the test to release them, so no job ends before the test
says, and the counts do not depend on how fast the worker thread runs.
"""

from __future__ import annotations

import threading
import time

import pytest

from ddte.serve.worker import Worker

WAIT_S = 30.0  # a deadline for the worker thread to reach a state, never a measured time


class FakeJob:
    """What the worker reads of a job: whether its client left, and how to fail it."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.failed: str | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def fail(self, message: str, status: int = 500) -> None:
        self.failed = message


class GatedBatch:
    """A batch of ``size`` whose every step waits for :meth:`release`; a step ends the jobs the test marked."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.jobs: list[FakeJob] = []
        self.to_end: list[FakeJob] = []
        self.stepping = threading.Event()
        self._go = threading.Semaphore(0)
        self._lock = threading.Lock()

    def admit(self, job) -> bool:
        with self._lock:
            self.jobs.append(job)
        return True

    def step(self) -> list:
        self.stepping.set()
        self._go.acquire()
        with self._lock:
            ended = [job for job in self.to_end if job in self.jobs]
            self.jobs = [job for job in self.jobs if job not in ended]
            self.to_end = []
        return ended

    def release(self, end: list | None = None) -> None:
        with self._lock:
            self.to_end = list(end or [])
        self._go.release()

    def fail_all(self, message: str) -> None:
        self.jobs = []


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _submit_together(worker: Worker, count: int) -> list[bool]:
    """``count`` submissions from ``count`` threads at once; whether each was taken."""
    results: list[bool | None] = [None] * count
    start = threading.Barrier(count)

    def one(i: int) -> None:
        start.wait()
        results[i] = worker.submit(FakeJob())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    return [bool(r) for r in results]


def _stop(worker: Worker, batch: GatedBatch) -> None:
    worker.close()
    for _ in range(64):
        batch.release(list(batch.jobs))
    worker.thread.join(WAIT_S)


@pytest.mark.parametrize("max_batch, max_queue, requests", [(8, 16, 32), (4, 8, 10), (4, 8, 13), (1, 2, 5),
                                                              (3, 1, 9)])
def test_simultaneous_requests_beyond_the_batch_and_the_queue_are_refused_and_no_others(max_batch, max_queue,
                                                                                         requests):
    batch = GatedBatch(max_batch)
    worker = Worker(max_queue, batch)
    worker.start()
    try:
        taken = _submit_together(worker, requests)
        assert sum(taken) == min(requests, max_batch + max_queue), taken
        # the worker fills the batch from the queue at its next step: the rest still waits
        batch.release()
        _until(lambda: len(batch.jobs) == min(sum(taken), max_batch), "the batch never filled")
        assert worker.depth() == sum(taken) - len(batch.jobs)
        assert worker.submit(FakeJob()) == (sum(taken) < max_batch + max_queue)  # refused once both are full
    finally:
        _stop(worker, batch)


def test_a_job_leaving_the_batch_frees_queue_room_at_once():
    """Two jobs end in a step: two more requests are taken before the next step runs, the third refused."""
    batch = GatedBatch(4)
    worker = Worker(8, batch)
    worker.start()
    try:
        assert all(_submit_together(worker, 12))
        batch.release()
        _until(lambda: len(batch.jobs) == 4, "the batch never filled")
        assert not worker.submit(FakeJob())
        batch.stepping.clear()
        batch.release(end=batch.jobs[:2])  # two jobs end in this step; the next step waits for the test
        _until(batch.stepping.is_set, "the next step never started")
        assert len(batch.jobs) == 4  # two queued jobs joined the batch
        assert worker.submit(FakeJob()) and worker.submit(FakeJob())
        assert not worker.submit(FakeJob())
    finally:
        _stop(worker, batch)


def test_a_job_that_fails_to_join_frees_its_slot():
    batch = GatedBatch(2)
    batch.admit = lambda job: False  # every job fails alone before it joins
    worker = Worker(1, batch)
    worker.start()
    try:
        for _ in range(5):  # one after another: each failed job's slot is free again
            assert worker.submit(FakeJob())
            _until(lambda: worker.depth() == 0 and worker._taken == 0, "the job never left")
        assert all(_submit_together(worker, 3))  # 2 slots free + 1 queued
    finally:
        _stop(worker, batch)
