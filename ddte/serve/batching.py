"""The one road from the worker's jobs to the decoding step: up to ``--max-batch`` jobs decoded together on one
``decode.batch.BatchDecoder`` (opened by decode/session.py), one at a time where it is 1 (continuous batching).

Each job (one choice of a request) joins the batch with its own prompt, sampling settings, seed, verifier and
policy, so it stays exactly the target's law at its own settings whatever else is in the batch
(tests/decode/exact/test_batch.py). After each step every job hears its tokens (and their log-probabilities, where
asked) through ``ServedChoice.on_step``; a job leaves the batch when it ends (EOS unless it ignores EOS, its
budget), when a stop string appears, or when its client left (checked before each step).
"""

from __future__ import annotations

from ddte.serve.job import ServedChoice
from ddte.serve.metrics import ServerMetrics
from ddte.serve.outcome import answer, empty_stats, record
from ddte.serve.worker import new_seed


class BatchRunner:
    """The jobs in the running batch of ``served.decoder`` (a ``BatchDecoder``), at most ``size``; the worker's
    :class:`~ddte.serve.worker.Batch`."""

    def __init__(self, served, metrics: ServerMetrics, size: int) -> None:
        if size < 1:
            raise ValueError(f"a batch holds at least 1 request, got {size}")
        self.served, self.metrics, self.size = served, metrics, size
        self._ids: dict[ServedChoice, tuple[int, int]] = {}  # job -> (its id in the decoder, its seed)

    def admit(self, job: ServedChoice) -> bool:
        """Start ``job`` in the batch (its prompt runs in the next step's passes); False when it failed, answered."""
        from decode.drafting.rng import TorchRandom
        from decode.generation import Job

        request, served = job.request, self.served
        seed = job.choice.seed if job.choice.seed is not None else new_seed()
        self.metrics.started()
        # a prompt scored alone (max_tokens 0) still runs one step: the prompt's pass gives its log-probabilities
        decode_job = Job(job.prompt_ids, max(request.max_tokens, 1), served.policy, TorchRandom(seed),
                               request.sampling, served.verifier, logprobs=request.logprobs,
                               prompt_logprobs=request.logprobs if request.echo else None,
                               stop_at_eos=not request.ignore_eos)
        try:
            rid = served.decoder.join(decode_job)
        except Exception as err:  # this request fails alone; the batch is as it was
            record(self.metrics, job, empty_stats())
            job.fail(f"generation failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
            return False
        self._ids[job] = (rid, seed)
        return True

    def step(self) -> list[ServedChoice]:
        """Jobs whose clients left leave; one step of the rest; the jobs that ended (each answered, or cancelled)."""
        decoder = self.served.decoder
        ended = [self._end(job, decoder.leave(self._ids[job][0])) for job in list(self._ids)
                 if job.cancelled.is_set()]
        if not self._ids:
            return ended
        reports = decoder.step()
        self.metrics.batch_step(len(reports), decoder.pass_tokens)
        jobs = {rid: job for job, (rid, _) in self._ids.items()}
        for rid, report in reports.items():
            job = jobs[rid]
            go_on = job.on_step(report.tokens, report.logprobs, report.prompt_logprobs)
            if report.finished is not None:
                ended.append(self._end(job, report.finished))
            elif not go_on:  # a stop string, or the client left
                ended.append(self._end(job, decoder.leave(rid)))
        return ended

    def fail_all(self, message: str) -> None:
        """A step raised: every job leaves and is answered ``message`` (500)."""
        for job, (rid, _) in list(self._ids.items()):
            del self._ids[job]
            try:
                stats = self.served.decoder.leave(rid).stats
            except Exception:  # the step broke off halfway: its caches drop the request as they can
                stats = empty_stats()
            record(self.metrics, job, stats)
            job.fail(message)

    def _end(self, job: ServedChoice, generation) -> ServedChoice:
        _, seed = self._ids.pop(job)
        record(self.metrics, job, generation.stats)
        answer(job, generation, self.served.method, seed)
        return job
