"""Honest per-generation statistics, with the names engines and Spec-Bench use.

* block efficiency: tokens emitted per target (verification) pass, correction/bonus token included
  (= Spec-Bench "mean accepted tokens", vLLM "mean acceptance length");
* acceptance rate: accepted draft tokens per drafted depth, the extra token excluded;
* tokens/s: new tokens over the wall time of the whole generation, prefill included.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PHASES = ("prefill", "draft", "target", "verify", "policy", "other")  # a steered draft's δ counts as the draft's


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0  # = target verification passes
    draft_calls: int = 0
    accepted_tokens: int = 0
    drafted_depth: int = 0
    action_counts: Counter = field(default_factory=Counter)
    accepted_counts: Counter = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall_seconds: float = 0.0
    network_seconds: list[float] = field(default_factory=list)  # each network call or per-node decision

    def record_step(self, action: str, depth: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.new_tokens += emitted
        self.accepted_tokens += accepted
        self.drafted_depth += depth
        self.action_counts[action] += 1
        self.accepted_counts[accepted] += 1

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_depth if self.drafted_depth else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def merge(self, other: GenerationStats) -> None:
        """Accumulate another generation's statistics into this one."""
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.draft_calls += other.draft_calls
        self.accepted_tokens += other.accepted_tokens
        self.drafted_depth += other.drafted_depth
        self.action_counts.update(other.action_counts)
        self.accepted_counts.update(other.accepted_counts)
        for phase in PHASES:
            self.seconds[phase] += other.seconds[phase]
        self.wall_seconds += other.wall_seconds
        self.network_seconds.extend(other.network_seconds)

    def summary(self) -> str:
        """One line: tokens, target passes, block efficiency, acceptance rate, tokens/s and the share of each phase."""
        split = ", ".join(f"{k} {v / max(self.wall_seconds, 1e-12):.0%}" for k, v in self.seconds.items())
        return (f"{self.new_tokens} tokens in {self.steps} target passes, block efficiency "
                f"{self.block_efficiency:.2f}, acceptance rate {self.acceptance_rate:.2f}, "
                f"{self.tokens_per_second:.1f} tokens/s (time: {split})")

    def vs_plain_decoding(self) -> str:
        """One line on what plain (autoregressive) decoding would have needed: one target pass per new token, after
        the same prefill (every prompt token but the last, which the first step's pass covers, as a step of ours
        does). The passes avoided, and the target time they stand for at this run's mean target pass (a tree pass
        costs a little more than AR's one-token pass, so the time reads slightly high; ``ddte bench`` times AR)."""
        avoided = self.new_tokens - self.steps  # >= 0: every step emits at least one token
        per_pass = self.seconds.get("target", 0.0) / self.steps if self.steps else 0.0
        return (f"vs plain decoding: {self.steps} target passes instead of {self.new_tokens} (one per new token): "
                f"{avoided} avoided, ≈ {avoided * per_pass:.2f} s of target time at {1000 * per_pass:.1f} ms per "
                "pass")

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_passes": self.steps,
            "draft_calls": self.draft_calls,
            "block_efficiency": self.block_efficiency,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_s": self.tokens_per_second,
            "wall_seconds": self.wall_seconds,
            "seconds": dict(self.seconds),
            "action_histogram": {str(k): v for k, v in sorted(self.action_counts.items())},
            "accepted_length_histogram": {str(k): v for k, v in sorted(self.accepted_counts.items())},
        }
