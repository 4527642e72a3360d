"""Policies choose the tree shape at the root of each step (two methods, after HF's CandidateGenerator).

``choose(root)`` returns the action from what is known at the root only; ``observe(outcome)`` sees how the
step went. Choosing from root information only keeps every verifier lossless: the shape is independent of
the draft samples of this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from decode.drafting import Action


@dataclass
class RootState:
    """What a policy may look at when the step starts.

    Attributes:
        context_length: tokens in the context, the root token included.
        q_root: ``(V,)`` the draft's distribution after the root.
        max_depth: the deepest tree that still fits the context window and the token budget.
        features: the root feature vector (decode.features), when the decoder computes it.
        latency: the decoder's latency table (decode.latency), when it has one.
    """

    context_length: int
    q_root: torch.Tensor
    max_depth: int
    features: object | None = None
    latency: object | None = None


@dataclass
class StepOutcome:
    """What happened in one step: the action, the accepted length τ and the tokens emitted; the decoder also
    gives the root's context length and the step's wall time (drafting, target pass, verification, bookkeeping)."""

    action: Action
    accepted: int
    emitted: int
    context_length: int | None = None
    seconds: float | None = None


class Policy(Protocol):
    name: str

    def choose(self, root: RootState) -> Action: ...

    def observe(self, outcome: StepOutcome) -> None: ...


class StaticPolicy:
    """The same action every step."""

    name = "static"

    def __init__(self, action: Action) -> None:
        self.action = action

    def choose(self, root: RootState) -> Action:
        return self.action

    def observe(self, outcome: StepOutcome) -> None:
        pass


class AdaptiveLengthPolicy:
    """HF assisted generation's heuristic schedule on a single path: +2 after a fully accepted draft, else -1."""

    name = "adaptive"

    def __init__(self, initial: int = 4, minimum: int = 1, maximum: int = 16) -> None:
        if not 1 <= minimum <= initial <= maximum:
            raise ValueError(f"need 1 <= minimum <= initial <= maximum, got {minimum}, {initial}, {maximum}")
        self.length, self.minimum, self.maximum = initial, minimum, maximum

    def choose(self, root: RootState) -> Action:
        return Action(1, self.length, 0)

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.accepted >= outcome.action.depth:
            self.length = min(self.maximum, self.length + 2)
        else:
            self.length = max(self.minimum, self.length - 1)


class EntropyStopPolicy:
    """AdaEDL-style: draft a single path of up to ``max_length`` tokens, stopping at the first node whose draft
    entropy (nats) exceeds ``threshold``, where the draft is too unsure for its next token to be accepted."""

    name = "entropy"

    def __init__(self, max_length: int = 8, threshold: float = 2.0) -> None:
        if max_length < 1 or threshold <= 0:
            raise ValueError(f"need max_length >= 1 and threshold > 0, got {max_length}, {threshold}")
        self.action = Action(1, max_length, 0, stop_entropy=threshold)

    def choose(self, root: RootState) -> Action:
        return self.action

    def observe(self, outcome: StepOutcome) -> None:
        pass
