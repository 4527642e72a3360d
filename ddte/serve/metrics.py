"""The server's counters and histograms, rendered in Prometheus' text format (``GET /metrics``).

Names follow vLLM's where one exists (draft and accepted tokens, mean acceptance length), and Prometheus' process
collector's for the resident memory (with its peak beside it, what the host must keep free), under the ``ddte_``
prefix. Every update takes one lock: the worker thread records a finished generation while the event loop renders.
"""

from __future__ import annotations

import threading
from collections import Counter

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
PASS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Histogram:
    """Cumulative buckets, a sum and a count (Prometheus' histogram)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(self.buckets, self.counts, strict=True)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class ServerMetrics:
    """What ``/metrics`` reports; ``queue_depth`` is read when rendering."""

    def __init__(self, queue_depth) -> None:
        self._lock = threading.Lock()
        self._queue_depth = queue_depth
        self.requests: Counter = Counter()  # (endpoint, outcome) -> n
        self.prompt_tokens = self.generated_tokens = self.draft_tokens = self.accepted_tokens = self.steps = 0
        self.actions: Counter = Counter()
        self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)  # requests per step (--max-batch > 1)
        self.pass_tokens = Histogram(PASS_BUCKETS)  # tokens in the step's shared target pass (--max-batch > 1)
        self.drafted_at: Counter = Counter()  # position i -> steps that drafted a token at depth i
        self.accepted_at: Counter = Counter()  # position i -> steps that accepted the draft token at depth i

    def batch_step(self, size: int, pass_tokens: int) -> None:
        """One step of a batch: how many requests it advanced and the tokens of its one target pass."""
        with self._lock:
            self.batch_size.observe(size)
            self.pass_tokens.observe(pass_tokens)

    def request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[endpoint, outcome] += 1

    def started(self) -> None:
        with self._lock:
            self.running += 1

    def finished(self, prompt_tokens: int, stats, ttft: float | None, tpot: float | None) -> None:
        """One generation done (whole, stopped, or cancelled): its statistics (``decode.stats.GenerationStats``)."""
        with self._lock:
            self.running -= 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += stats.new_tokens
            self.draft_tokens += stats.drafted_depth
            self.accepted_tokens += stats.accepted_tokens
            self.steps += stats.steps
            self.actions.update(stats.action_counts)
            for depth, steps in stats.depth_counts.items():  # a step of depth d drafted positions 1..d
                self.drafted_at.update(dict.fromkeys(range(1, depth + 1), steps))
            for accepted, steps in stats.accepted_counts.items():
                self.accepted_at.update(dict.fromkeys(range(1, accepted + 1), steps))
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP ddte_requests_total requests by endpoint and outcome: the HTTP status (a stream's when it "
                     "ends), 499 for a client that left", "# TYPE ddte_requests_total counter"]
            lines += [f'ddte_requests_total{{endpoint="{e}",outcome="{o}"}} {n}'
                      for (e, o), n in sorted(self.requests.items())]
            for name, value, help_text in (
                    ("ddte_prompt_tokens_total", self.prompt_tokens, "prompt tokens of finished requests"),
                    ("ddte_generation_tokens_total", self.generated_tokens, "tokens generated"),
                    ("ddte_spec_decode_num_draft_tokens_total", self.draft_tokens, "draft tokens verified (depth)"),
                    ("ddte_spec_decode_num_accepted_tokens_total", self.accepted_tokens, "draft tokens accepted"),
                    ("ddte_spec_decode_steps_total", self.steps, "target passes (decoding steps)")):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
            mean = self.generated_tokens / self.steps if self.steps else 0.0
            lines += ["# HELP ddte_spec_decode_mean_acceptance_length tokens per target pass, the bonus included",
                      "# TYPE ddte_spec_decode_mean_acceptance_length gauge",
                      f"ddte_spec_decode_mean_acceptance_length {mean:.6f}",
                      "# TYPE ddte_policy_decisions_total counter"]
            lines += [f'ddte_policy_decisions_total{{action="{a}"}} {n}' for a, n in sorted(self.actions.items())]
            lines += ["# TYPE ddte_queue_depth gauge", f"ddte_queue_depth {self._queue_depth()}",
                      "# TYPE ddte_requests_running gauge", f"ddte_requests_running {self.running}",
                      *_memory_lines(),
                      "# TYPE ddte_time_to_first_token_seconds histogram",
                      *self.ttft.lines("ddte_time_to_first_token_seconds"),
                      "# TYPE ddte_time_per_output_token_seconds histogram",
                      *self.tpot.lines("ddte_time_per_output_token_seconds"),
                      "# HELP ddte_batch_size requests advanced by one step of the batch (--max-batch > 1)",
                      "# TYPE ddte_batch_size histogram", *self.batch_size.lines("ddte_batch_size"),
                      "# HELP ddte_target_pass_tokens tokens in one step's shared target pass (--max-batch > 1)",
                      "# TYPE ddte_target_pass_tokens histogram", *self.pass_tokens.lines("ddte_target_pass_tokens")]
            return "\n".join(lines + self._per_position()) + "\n"

    def _per_position(self) -> list[str]:
        """Per-position acceptance (vLLM's ``spec_decode_num_accepted_tokens_per_pos``): at each depth of the drafted
        path, the steps that drafted there, those that accepted there, and their ratio. Called under the lock."""
        lines = ["# HELP ddte_spec_decode_num_drafts_per_pos steps that drafted a token at this position",
                 "# TYPE ddte_spec_decode_num_drafts_per_pos counter"]
        drafted = sorted(self.drafted_at.items())
        lines += [f'ddte_spec_decode_num_drafts_per_pos{{position="{i}"}} {n}' for i, n in drafted]
        lines += ["# HELP ddte_spec_decode_num_accepted_tokens_per_pos steps that accepted the token at this position",
                  "# TYPE ddte_spec_decode_num_accepted_tokens_per_pos counter"]
        lines += [f'ddte_spec_decode_num_accepted_tokens_per_pos{{position="{i}"}} {self.accepted_at[i]}'
                  for i in sorted(self.drafted_at)]
        lines += ["# HELP ddte_spec_decode_acceptance_rate_per_pos accepted over drafted at this position",
                  "# TYPE ddte_spec_decode_acceptance_rate_per_pos gauge"]
        return lines + [f'ddte_spec_decode_acceptance_rate_per_pos{{position="{i}"}} {self.accepted_at[i] / n:.6f}'
                        for i, n in drafted]


def _memory_lines() -> list[str]:
    """The process's resident memory now and its peak (the pair loaded, its kernels prepared, every request so far),
    in bytes; a gauge the platform cannot read is left out."""
    from ddte_core.memory import peak_rss_bytes, rss_bytes

    lines = []
    for name, value, help_text in (
            ("ddte_process_resident_memory_bytes", rss_bytes(), "resident memory of the server process now"),
            ("ddte_process_peak_resident_memory_bytes", peak_rss_bytes(),
             "peak resident memory of the server process (the pair loading and its kernels included)")):
        if value is not None:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
    return lines
