"""Random sources for drafting and verification.

Verifiers and tree samplers draw randomness only through two calls, ``bernoulli(prob)`` and
``categorical(weights)``. In production that is a seeded ``torch.Generator``; in the exact tests a
replaying source walks every branch of the same code with its probability, so the code that is proven
lossless is the code that runs.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RandomSource(Protocol):
    def bernoulli(self, prob: float) -> bool:
        """True with probability ``min(1, max(0, prob))``."""
        ...

    def categorical(self, weights: torch.Tensor) -> int:
        """An index drawn with probability proportional to ``weights`` (shape ``(V,)``, non-negative)."""
        ...


class TorchRandom:
    """A :class:`RandomSource` backed by a ``torch.Generator`` (reproducible under a seed)."""

    def __init__(self, generator: torch.Generator | int | None = None) -> None:
        if isinstance(generator, int) or generator is None:
            seed = generator
            generator = torch.Generator()
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        self.generator = generator

    def uniform(self) -> float:
        return float(torch.rand((), dtype=torch.float64, generator=self.generator))

    def bernoulli(self, prob: float) -> bool:
        # U ~ Uniform[0, 1) gives P(U < prob) = prob exactly for prob in [0, 1].
        return self.uniform() < prob

    def categorical(self, weights: torch.Tensor) -> int:
        # Inverse-CDF sampling: one cumsum and one binary search, no normalisation pass.
        cdf = torch.cumsum(weights, dim=0)
        total = float(cdf[-1])
        if not total > 0.0:
            raise ValueError("cannot sample from an all-zero distribution")
        u = torch.tensor([self.uniform() * total], dtype=cdf.dtype, device=cdf.device)
        index = int(torch.searchsorted(cdf, u, right=True))
        # u < total, but rounding can put it past the last positive entry; step back onto the support.
        index = min(index, weights.numel() - 1)
        while float(weights[index]) <= 0.0:
            index -= 1
        return index
