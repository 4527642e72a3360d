"""How a generation that ended is reported, the same for one request at a time and for a batch: its figures into
``/metrics`` (whatever happened to it), and its answer to the client (unless the client left)."""

from __future__ import annotations

import time

from ddte.serve.job import ServedChoice
from ddte.serve.metrics import ServerMetrics


def record(metrics: ServerMetrics, job: ServedChoice, stats) -> None:
    """One generation ended (whole, stopped, cancelled or failed; ``stats`` a ``decode.stats.GenerationStats``, empty
    for one that never ran): its tokens, TTFT (queueing included) and TPOT (after the first step) into ``metrics``."""
    ttft = job.first_token_at - job.enqueued if job.first_token_at is not None else None
    done = time.perf_counter()
    tpot = ((done - job.first_token_at) / (stats.new_tokens - 1)
            if job.first_token_at is not None and stats.new_tokens > 1 else None)
    metrics.finished(len(job.prompt_ids), stats, ttft, tpot)


def answer(job: ServedChoice, generation, method: str, seed: int) -> None:
    """Send the result of ``generation`` (a ``decode.engine.Generation``) to the client, unless it left."""
    if job.cancelled.is_set() and not job.stop_hit:
        return  # nobody is listening
    reason = "stop" if job.stop_hit or (generation.stopped_by == "eos" and job.request.max_tokens) else "length"
    job.finish(reason, ddte_object(generation, job.answered, method, seed))


def empty_stats():
    """The statistics of a generation that never ran a step."""
    from decode.stats import GenerationStats

    return GenerationStats()


def ddte_object(generation, tokens: list[int], method: str, seed: int) -> dict:
    """What ddte adds to OpenAI's response: the method, the seed (a request sent again with it gets the same answer),
    steps, mean acceptance length, draft and accepted tokens, the actions the policy chose, and the token ids
    answered (``tokens``: up to the one that completed a stop string)."""
    stats = generation.stats
    return {"method": method, "seed": seed, "steps": stats.steps,
            "mean_acceptance_length": stats.new_tokens / stats.steps if stats.steps else None,
            "draft_tokens": stats.drafted_depth, "accepted_tokens": stats.accepted_tokens,
            "actions": dict(stats.action_counts), "token_ids": list(tokens)}
