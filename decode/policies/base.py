"""Policies choose the tree shape at the root of each step, as strategies (after HF's CandidateGenerator).

A policy comes in two halves. A :class:`PolicySource` is what a spec or a file holds, built once (a loaded selector,
an expander, a policy file's choices): it serves every generation, at any sampling configuration, through
``start(sampling)``, which makes the :class:`Policy` that runs that one generation (its runner). A runner's
``choose(root)`` returns the action from what is known at the root only; ``observe(outcome)`` sees how the step went.
Choosing from root information only keeps every verifier lossless: the shape is independent of the draft samples of
this step.

A runner declares what it needs from the decoder on its class, so no caller guesses or tests a name:
``needs_root_features`` (the root features of decode.policies.features, and with them the latency table),
``needs_draft_hidden`` (the draft's hidden state at the root and at each trunk node, nothing of the target's),
``stateful`` (it keeps state across the steps of a generation), ``decides_per_node`` (it also decides while the
trunk is drafted: the action ``choose`` returns is the widest tree of the step, and ``halts`` may end its trunk early
at any node, from the draft's own state there; decode/drafting/delayed.py) and ``shares_budget`` (a batch decides
its tree together with the other requests' from what each knew before the step: decode/policies/budget.py). The
decoder reads the capabilities of what ``start`` returned. The built-in policies (static, adaptive, entropy) hold
nothing to load: each is its own source, and starts itself (a fresh copy where it keeps state). Every kind of policy
is one entry of decode/policies/kinds.py; decode/policies/build.py (``build_policy``) builds any policy source from
its spec (decode/policies/spec.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode.drafting.actions import Action

if TYPE_CHECKING:  # the interface itself is light: listing policy names must not import torch
    import torch

    from decode.cost.table import LatencyTable
    from decode.drafting.delayed import TrunkNode
    from decode.drafting.sampling import SamplingConfig
    from decode.policies.features import RootFeatures


@dataclass
class RootState:
    """What a policy may look at when the step starts.

    Attributes:
        context_length: tokens in the context, the root token included.
        q_root: ``(V,)`` the draft's distribution after the root.
        max_depth: the deepest tree that still fits the context window and the token budget.
        sampling: the generation's sampling settings (p and q are formed with them).
        features: the root feature vector (decode.policies.features), for a policy that needs it.
        latency: the decoder's latency table (decode.cost.table), when it has one.
    """

    context_length: int
    q_root: torch.Tensor
    max_depth: int
    sampling: SamplingConfig
    features: RootFeatures | None = None
    latency: LatencyTable | None = None


@dataclass
class StepOutcome:
    """What happened in one step: the action, the accepted length τ and the tokens emitted; the decoder also
    gives the root's context length and the step's wall time (drafting, target pass, verification, bookkeeping)."""

    action: Action
    accepted: int
    emitted: int
    context_length: int | None = None
    seconds: float | None = None


class Policy:
    """The runner of one generation: ``choose`` the action at a root, ``observe`` the step's outcome.

    Capabilities, declared on the class: ``needs_root_features`` (``choose`` reads ``root.features`` and
    ``root.latency``), ``needs_draft_hidden`` (``halts`` reads ``node.hidden``), ``stateful`` (it keeps state across
    steps: its source starts a fresh one per generation) and ``decides_per_node`` (``halts`` is asked at every
    trunk node).
    """

    name: str = ""
    needs_root_features: bool = False
    needs_draft_hidden: bool = False
    stateful: bool = False
    decides_per_node: bool = False
    shares_budget: bool = False  # a batch decides its tree with the others' (decode/policies/budget.py)

    def choose(self, root: RootState) -> Action:
        raise NotImplementedError

    def halts(self, node: TrunkNode) -> bool:
        """Whether the trunk of this step stops growing at ``node`` (``decides_per_node`` policies only)."""
        raise NotImplementedError(f"{type(self).__name__} does not decide per node")

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn by default."""

    def network_seconds(self) -> list[float]:
        """Wall time of each network call this policy made in its generation (none without a network)."""
        return []


class PolicySource:
    """What a spec or a file holds, built once: ``start(sampling)`` makes the :class:`Policy` of one generation."""

    name: str = ""

    def start(self, sampling: SamplingConfig) -> Policy:
        raise NotImplementedError

    def describe(self, sampling: SamplingConfig) -> str:
        """One line on what serves a generation at ``sampling`` (for summaries)."""
        return self.name

    def sampling_note(self, sampling: SamplingConfig) -> str | None:
        """One line when this source's choices were measured at other sampling settings than ``sampling``, so the
        nearest stands in (decode/policies/files/sampling_table.py); None when they hold at any (the built-in
        policies) or were measured there."""
        return None


class StaticPolicy(Policy, PolicySource):
    """The same action every step; its own source (it keeps no state)."""

    name = "static"

    def __init__(self, action: Action) -> None:
        self.action = action

    def start(self, sampling: SamplingConfig) -> StaticPolicy:
        return self

    def choose(self, root: RootState) -> Action:
        return self.action

    def describe(self, sampling: SamplingConfig) -> str:
        return f"static {self.action}"


class AdaptiveLengthPolicy(Policy, PolicySource):
    """HF assisted generation's heuristic schedule on a single path: +2 after a fully accepted draft, else -1; its own
    source, which starts a fresh schedule per generation."""

    name = "adaptive"
    stateful = True

    def __init__(self, initial: int = 4, minimum: int = 1, maximum: int = 16) -> None:
        if not 1 <= minimum <= initial <= maximum:
            raise ValueError(f"need 1 <= minimum <= initial <= maximum, got {minimum}, {initial}, {maximum}")
        self.initial, self.minimum, self.maximum = initial, minimum, maximum
        self.length = initial

    def start(self, sampling: SamplingConfig) -> AdaptiveLengthPolicy:
        return AdaptiveLengthPolicy(self.initial, self.minimum, self.maximum)

    def choose(self, root: RootState) -> Action:
        return Action(1, self.length, 0)

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.accepted >= outcome.action.depth:
            self.length = min(self.maximum, self.length + 2)
        else:
            self.length = max(self.minimum, self.length - 1)


class EntropyStopPolicy(Policy, PolicySource):
    """AdaEDL-style: draft a single path of up to ``max_length`` tokens, stopping at the first node whose draft
    entropy (nats) exceeds ``threshold``, where the draft is too unsure for its next token to be accepted.

    The length is a stopping time of the draft's own laws, which keeps every verifier lossless
    (tests/decode/exact/test_stopping.py). An expander's entropy signal is the same rule with a threshold per depth."""

    name = "entropy"
    decides_per_node = True

    def __init__(self, max_length: int = 8, threshold: float = 2.0) -> None:
        from decode.policies.halting import HaltingRule

        if max_length < 1 or not 0 < threshold < float("inf"):
            raise ValueError(f"need max_length >= 1 and a finite threshold > 0, got {max_length}, {threshold}")
        self.action, self.threshold = Action(1, max_length, 0), threshold
        self.rule = HaltingRule(-threshold, 0, max_length, 1, 0)  # the expanders' rule on minus the entropy

    def start(self, sampling: SamplingConfig) -> EntropyStopPolicy:
        return self

    def choose(self, root: RootState) -> Action:
        return self.action

    def halts(self, node: TrunkNode) -> bool:
        from decode.drafting.sampling import law_entropy  # the interface module stays free of torch

        return self.rule.halts(node.depth, lambda: -law_entropy(node.q))

    def describe(self, sampling: SamplingConfig) -> str:
        return f"entropy stop (up to {self.action.l1} tokens, halting where H > {self.threshold:g} nats)"

    def __repr__(self) -> str:
        return f"EntropyStopPolicy(max_length={self.action.l1}, threshold={self.threshold:g})"

