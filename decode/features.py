"""Root features: the ONE implementation, called by the decoder at each root and by data_gen (design.md).

At a root the selector sees three hidden-state blocks and a scalar vector (algorithms.md §3.6):

* the target's final hidden state at the previous token (the last token the target has run),
* the draft's final hidden states at the previous token and at the root token,
* scalars, in :data:`SCALAR_NAMES` order: entropies of p_prev, q_prev and q_root; KL(p_prev‖q_prev),
  KL(q_prev‖p_prev) and ‖p_prev − q_prev‖₁; context length, temperature and top-p; and the latency model's
  draft and target pass times at this context length.

The distributions are the ones sampling uses (temperature and top-p applied). KL terms clamp probabilities at
:data:`EPS`, so the zeros of top-p or greedy decoding give large, finite values instead of infinities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decode.sampling import SamplingConfig

SCALAR_NAMES = (
    "entropy_p_prev",
    "entropy_q_prev",
    "entropy_q_root",
    "kl_p_q_prev",
    "kl_q_p_prev",
    "l1_p_q_prev",
    "context_length",
    "temperature",
    "top_p",
    "draft_ms",
    "target_ms",
)
EPS = 1e-9


@dataclass
class RootFeatures:
    """Features of one root. Hidden blocks are float32 ``(H_target,)``, ``(H_draft,)``, ``(H_draft,)``."""

    target_hidden_prev: torch.Tensor
    draft_hidden_prev: torch.Tensor
    draft_hidden_root: torch.Tensor
    scalars: torch.Tensor  # (len(SCALAR_NAMES),) float32


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last axis; zero-probability tokens contribute nothing."""
    return -(probs * probs.clamp_min(EPS).log()).sum(-1)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) in nats over the last axis, with both sides clamped at EPS."""
    return (p * (p.clamp_min(EPS).log() - q.clamp_min(EPS).log())).sum(-1)


def root_features(
    target_hidden_prev: torch.Tensor,
    draft_hidden_prev: torch.Tensor,
    draft_hidden_root: torch.Tensor,
    p_prev: torch.Tensor,
    q_prev: torch.Tensor,
    q_root: torch.Tensor,
    context_length: int,
    sampling: SamplingConfig,
    pass_times_ms: Callable[[int], tuple[float, float]],
) -> RootFeatures:
    """The feature vector of a root.

    Args:
        target_hidden_prev: ``(H_target,)`` target hidden state at the previous token.
        draft_hidden_prev: ``(H_draft,)`` draft hidden state at the previous token.
        draft_hidden_root: ``(H_draft,)`` draft hidden state at the root token.
        p_prev, q_prev: ``(V,)`` target and draft distributions after the previous token (the root's law).
        q_root: ``(V,)`` draft distribution after the root.
        context_length: tokens in the context, the root included.
        sampling: temperature and top-p in force.
        pass_times_ms: ``l -> (draft ms, target ms)`` for one pass at context length l (the latency model).
    """
    p_prev, q_prev, q_root = p_prev.float(), q_prev.float(), q_root.float()
    draft_ms, target_ms = pass_times_ms(context_length)
    scalars = torch.stack(
        [
            entropy(p_prev),
            entropy(q_prev),
            entropy(q_root),
            kl_divergence(p_prev, q_prev),
            kl_divergence(q_prev, p_prev),
            (p_prev - q_prev).abs().sum(),
            torch.tensor(float(context_length)),
            torch.tensor(float(sampling.temperature)),
            torch.tensor(float(sampling.top_p)),
            torch.tensor(float(draft_ms)),
            torch.tensor(float(target_ms)),
        ]
    ).float()
    return RootFeatures(
        target_hidden_prev.detach().float().cpu(),
        draft_hidden_prev.detach().float().cpu(),
        draft_hidden_root.detach().float().cpu(),
        scalars.cpu(),
    )
