"""Divergences between the target's and the draft's next-token laws, per position (DistillSpec's menu).

All take ``p`` (target) and ``log_q`` (draft log-probabilities) over the last axis, shape ``(..., V)``, and
return ``(...)``: one value per position. ``tvd`` is the one whose minimisation maximises the per-token
acceptance of speculative sampling directly: β = Σ min(p, q) = 1 − TV(p, q) (algorithms.md §8).
"""

from __future__ import annotations

import torch

EPS = 1e-12


def forward_kl(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) = Σ p (log p − log q): mass-covering; the usual distillation loss."""
    return (p * (p.clamp_min(EPS).log() - log_q)).sum(-1)


def reverse_kl(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(q‖p) = Σ q (log q − log p): mode-seeking."""
    q = log_q.exp()
    return (q * (log_q - p.clamp_min(EPS).log())).sum(-1)


def total_variation(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = ½ Σ |p − q| = 1 − β."""
    return 0.5 * (p - log_q.exp()).abs().sum(-1)


def jensen_shannon(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """JSD = ½ KL(p‖m) + ½ KL(q‖m), m = (p + q) / 2."""
    q = log_q.exp()
    log_m = (0.5 * (p + q)).clamp_min(EPS).log()
    return 0.5 * (p * (p.clamp_min(EPS).log() - log_m)).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1)


DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "tvd": total_variation, "jsd": jensen_shannon}


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """β = Σ min(p, q) = 1 − TV(p, q), per position."""
    return torch.minimum(p, q).sum(-1)
