"""Root features: the ONE implementation, called by the decoder at each root and by data_gen (docs/architecture.md).

At a root the selector sees three hidden-state blocks and a scalar vector (algorithms.md §3.6):

* the target's final hidden state at the previous token (the last token the target has run),
* the draft's final hidden states at the previous token and at the root token,
* scalars, in :data:`SCALAR_NAMES` order: entropies of p_prev, q_prev and q_root; KL(p_prev‖q_prev),
  KL(q_prev‖p_prev) and ‖p_prev − q_prev‖₁; context length, temperature and top-p; and the latency model's
  draft and target pass times at this context length.

This module owns the feature contract: :data:`HIDDEN_NAMES`, :data:`SCALAR_NAMES` and their version. Data sets store
the blocks under these names and the exported selector takes them as its inputs.

The distributions are the ones sampling uses (temperature and top-p applied). KL terms clamp probabilities at
:data:`EPS`, so the zeros of top-p or greedy decoding give large, finite values instead of infinities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decode.drafting.sampling import EPS, SamplingConfig

FEATURE_SCHEMA_VERSION = 1  # bump when a name, its order or its meaning changes: old selectors are then refused
HIDDEN_NAMES = ("target_hidden_prev", "draft_hidden_prev", "draft_hidden_root")
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


@dataclass
class RootFeatures:
    """Features of one root. Hidden blocks are float32 ``(H_target,)``, ``(H_draft,)``, ``(H_draft,)``."""

    target_hidden_prev: torch.Tensor
    draft_hidden_prev: torch.Tensor
    draft_hidden_root: torch.Tensor
    scalars: torch.Tensor  # (len(SCALAR_NAMES),) float32


def hidden_sizes(target_hidden: int, draft_hidden: int) -> dict[str, int]:
    """Width of each hidden block of :data:`HIDDEN_NAMES` for a pair with these hidden sizes."""
    return dict(zip(HIDDEN_NAMES, (int(target_hidden), int(draft_hidden), int(draft_hidden)), strict=True))


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
    # One stacked log and one (3, 3) product give all five information terms: cross[i, j] = Σ_v P_i(v)·log P_j(v),
    # so H(P_i) = −cross[i, i] and KL(P_i‖P_j) = cross[i, i] − cross[i, j]. Elementwise per-term code ran ~40 small
    # kernels over the vocabulary every step; this runs five.
    probs = torch.stack([p_prev, q_prev, q_root]).float()  # (3, V)
    cross = (probs @ probs.clamp_min(EPS).log().T).tolist()
    l1 = float((probs[0] - probs[1]).abs().sum())
    draft_ms, target_ms = pass_times_ms(context_length)
    values = [
        -cross[0][0],
        -cross[1][1],
        -cross[2][2],
        max(cross[0][0] - cross[0][1], 0.0),  # ≥ 0 in exact arithmetic; the difference can round just below
        max(cross[1][1] - cross[1][0], 0.0),
        l1,
        float(context_length),
        float(sampling.temperature),
        float(sampling.top_p),
        float(draft_ms),
        float(target_ms),
    ]
    scalars = torch.tensor(values, dtype=torch.float32)
    return RootFeatures(
        target_hidden_prev.detach().float().cpu(),
        draft_hidden_prev.detach().float().cpu(),
        draft_hidden_root.detach().float().cpu(),
        scalars,
    )
