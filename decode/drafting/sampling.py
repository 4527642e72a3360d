"""From logits to the exact distributions that drafting samples from and verification reads.

The same :class:`SamplingConfig` turns the target's logits into p and the draft's into q. A mismatch
here (temperature on one side only, top-p on one side only) is the most common way public
implementations lose losslessness (algorithms.md §5.2), so there is one function and both sides call it.

Temperature 0 means greedy decoding: the distribution is one-hot on the argmax (ties to the lowest id). Every
verifier on one-hot p and q reproduces the target's greedy output exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How next-token distributions are formed from logits.

    Attributes:
        temperature: 0 for greedy, else logits are divided by it before the softmax.
        top_p: nucleus threshold in (0, 1]; 1 keeps the whole vocabulary.
    """

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def distributions(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Next-token distributions, shape ``(..., V)`` float32, from logits of the same shape.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``. That is every token whose
    preceding mass in descending order is below ``top_p``, with ties broken by sort order. The kept tokens
    are renormalised.
    """
    logits = logits.float()
    if config.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        preceding = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = preceding >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


EPS = 1e-9  # the floor under a probability inside a log


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last axis; zero-probability tokens contribute nothing."""
    return -(probs * probs.clamp_min(EPS).log()).sum(-1)


def law_entropy(q: torch.Tensor) -> float:
    """:func:`entropy` (nats) of one law ``q`` ``(Vs,)``, as a float: the per-node signal. The drafting loop hands
    over its laws on the draft's support (a draft vocabulary is a sixth of SmolLM2's). On the CPU numpy's three
    operations beat :func:`entropy`'s four in the loop, where both are dominated by the cache refill after each
    draft forward."""
    if q.device.type != "cpu":
        return float(entropy(q))
    probs = q.numpy()
    return float(-np.dot(probs, np.log(np.maximum(probs, EPS))))
