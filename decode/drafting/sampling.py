"""From logits to the exact distributions that drafting samples from and verification reads.

The same :class:`SamplingConfig` turns the target's logits into p and the draft's into q. A mismatch
here (temperature on one side only, top-p on one side only) is the most common way public
implementations lose losslessness (algorithms.md §5.2), so there is one function and both sides call it.

Every transform here (temperature, top-k, top-p, min-p) is a function of one row of logits alone, not of the path
that led to it: the verifier stays exact as long as q is the law the draft sampled from and p the target's law under
the same transform (tests/decode/exact/test_sampling_controls.py enumerates it, with negative controls). Transforms
that read the path (repetition, presence and frequency penalties) are not here.

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
        top_k: keep the ``top_k`` likeliest tokens; 0 keeps the whole vocabulary.
        min_p: keep the tokens whose probability is at least ``min_p`` times the likeliest one's; 0 keeps all.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def distributions(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Next-token distributions, shape ``(..., V)`` float32, from logits of the same shape.

    In order, as Hugging Face's and vLLM's samplers apply them: the temperature; top-k keeps the ``top_k`` likeliest
    tokens; top-p keeps the smallest set of likeliest tokens whose mass (under what top-k kept, renormalised)
    reaches ``top_p``: every token whose preceding mass in descending order is below ``top_p``, ties broken by sort
    order; min-p keeps the tokens at least ``min_p`` times as likely as the likeliest. The kept tokens are
    renormalised. Greedy (temperature 0) keeps the argmax alone, which every filter keeps.
    """
    logits = logits.float()
    if config.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if config.top_p < 1.0 or 0 < config.top_k < probs.shape[-1]:
        probs = _top_k_top_p(probs, config.top_k, config.top_p)
    if config.min_p > 0.0:
        # the likeliest token always stays, so no row empties; a row's ratios do not change when it is renormalised
        probs = probs.masked_fill(probs < config.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``probs`` ``(..., V)`` cut to its ``top_k`` likeliest (0: all), then to its top-p nucleus, renormalised."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if 0 < top_k < probs.shape[-1]:
        drop_sorted[..., top_k:] = True
        sorted_probs = sorted_probs.masked_fill(drop_sorted, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)  # top-p reads the law top-k left
    if top_p < 1.0:
        preceding = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted |= preceding >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


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
