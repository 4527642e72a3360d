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
    depth_counts: Counter = field(default_factory=Counter)  # steps by drafted depth (per-position acceptance)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall_seconds: float = 0.0
    first_token_seconds: float = 0.0  # from the request's start to its first tokens (the prompt runs in that step)
    network_seconds: list[float] = field(default_factory=list)  # each network call or per-node decision

    def record_step(self, action: str, depth: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.new_tokens += emitted
        self.accepted_tokens += accepted
        self.drafted_depth += depth
        self.action_counts[action] += 1
        self.accepted_counts[accepted] += 1
        self.depth_counts[depth] += 1

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
        self.depth_counts.update(other.depth_counts)
        for phase in PHASES:
            self.seconds[phase] += other.seconds[phase]
        self.wall_seconds += other.wall_seconds
        self.first_token_seconds += other.first_token_seconds
        self.network_seconds.extend(other.network_seconds)

    def summary(self) -> str:
        """One line: tokens, target passes, block efficiency, acceptance rate, tokens/s and the share of each phase."""
        split = ", ".join(f"{k} {v / max(self.wall_seconds, 1e-12):.0%}" for k, v in self.seconds.items())
        return (f"{self.new_tokens} tokens in {self.steps} target passes, block efficiency "
                f"{self.block_efficiency:.2f}, acceptance rate {self.acceptance_rate:.2f}, "
                f"{self.tokens_per_second:.1f} tokens/s (time: {split})")

    def vs_plain_decoding(self, plain_target_s: float | None = None) -> str:
        """One line on what plain (autoregressive) decoding would have needed: one target pass per new token, after
        the same prefill (every prompt token but the last, which the first step's pass covers, as a step of ours
        does). The passes avoided; then target time, where it is known for both: ``plain_target_s`` prices plain
        decoding's passes at a one-token target pass (:func:`plain_target_seconds`, from a latency table) beside
        this run's measured target time. Without it, only this run's time is given: its passes run trees, dearer
        than a one-token pass, so avoided passes × this run's mean pass would overstate the saving."""
        avoided = self.new_tokens - self.steps  # >= 0: every step emits at least one token
        ours = self.seconds.get("target", 0.0)
        line = (f"vs plain decoding: {self.steps} target passes instead of {self.new_tokens} (one per new token): "
                f"{avoided} avoided")
        if plain_target_s is None:
            per_pass = ours / self.steps if self.steps else 0.0
            return (f"{line}; this run's target passes took {ours:.2f} s ({1000 * per_pass:.1f} ms each, a "
                    "whole tree: a one-token pass costs less, so the time plain decoding needs is not known here)")
        per_token = plain_target_s / self.new_tokens if self.new_tokens else 0.0
        spent = sum(self.seconds.get(phase, 0.0) for phase in ("draft", "verify", "policy"))
        return (f"{line}; target time {ours:.2f} s against plain decoding's ≈ {plain_target_s:.2f} s "
                f"({1000 * per_token:.1f} ms per one-token pass, latency table): ≈ {plain_target_s - ours:.2f} s "
                f"saved on the target, against {spent:.2f} s of drafting, verifying and policy")

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


def plain_target_seconds(one_token_ms, prompt_tokens: int, new_tokens: int) -> float:
    """Target seconds plain decoding spends on ``new_tokens`` after a ``prompt_tokens`` prompt: one one-token pass
    per new token, the k-th over a cache of ``prompt_tokens - 1 + k`` tokens (the prefill holds every prompt token
    but the last, which the first pass runs). ``one_token_ms(length)``: a one-token target pass over a cache of
    ``length`` tokens (a latency table's ``target(length, 1)``)."""
    return sum(one_token_ms(prompt_tokens - 1 + k) for k in range(new_tokens)) / 1000
