"""The optimisation schedule every ddte trainer uses: AdamW with a linear warmup, then a cosine decay of the learning
rate to ``min_lr_ratio * lr`` at ``steps``. One type owns its fields, their check and the rate at each step, so the
pair recipe and ``ddte distill`` cannot drift apart; each subclasses it with its own defaults and extra fields."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class OptimSchedule:
    """Attributes:
    steps: optimiser steps (the cosine reaches its floor there).
    lr: the peak learning rate; min_lr_ratio: the floor as a fraction of it.
    warmup_steps: steps of linear warmup from lr / warmup_steps.
    weight_decay: AdamW's, on matrices only; grad_clip: the gradient-norm clip.
    max_minutes: stop after this much training wall time, whatever ``steps`` says (None: no cap).
    """

    steps: int = 400
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_minutes: float | None = None

    def problem(self) -> str | None:
        """What is wrong with these values, in one line; None when nothing is."""
        if self.steps < 1:
            return f"steps must be >= 1, got {self.steps}"
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup_steps >= 0 and self.grad_clip > 0):
            return "need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0, grad_clip > 0"
        if self.max_minutes is not None and not self.max_minutes > 0:
            return f"max_minutes must be > 0 or null, got {self.max_minutes}"
        return None

    def lr_at(self, step: int) -> float:
        """The learning rate of optimiser step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
