"""Online calibration of an expander's halting rule: the acceptance it realizes, per bin of its signal, moves where
the trunk stops, near the fitted threshold and nowhere else.

A fitted rule halts the trunk at depth d where the signal falls below θ, a threshold chosen on the training mix. A
workload that accepts more (or less) than that mix wants the trunk longer (or shorter) at the same signal.
:class:`AcceptanceCalibration` counts, over every step its source served (every request at one sampling
configuration of one verifier), each trunk token whose acceptance the step revealed: the token drawn at depth d is
*tested* when the d tokens before it were accepted, and *accepted* when the accepted length reached d + 1. Binned by
the signal at the node that drew it (bins: deciles of the fit set's signal), that is the realized conditional
acceptance β̃(bin), shrunk toward the pooled rate. At a node whose signal lies within ``reach`` bins of θ's, once
its bin has ``min_count`` tested tokens, the node grows the trunk where the marginal rule on β̃ and the machine's
chain times says growing pays (decode/policies/halting.py ``marginal_gain``, the marginal rule's signal above 1), and
halts otherwise; anywhere else the fitted rule decides. So the calibrated rule moves θ by at most ``reach`` bins of
the signal's fitted distribution either way (the bound), and with too little evidence it is the fitted rule, except
that a trunk the fitted rule halts in a band bin still short of evidence grows one token more on every
``explore_every``-th step the source serves (counted over earlier steps): the bins just below θ, where the fitted
rule always halts, would otherwise never be tested, and the threshold could only rise.

Lossless: a decision reads the draft's state at this step's trunk nodes, the machine's step times and the counts of
earlier steps' outcomes (of this request and of the others the source served), never the current step's target
outputs: the decoder closes every request's step, where the counts grow, after every tree of the step was drafted
(tests/decode/exact/test_calibration.py, with a negative control that counts the current step first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from decode.policies.halting import marginal_gain

__all__ = ["AcceptanceCalibration"]

BINS = 10  # deciles of the fit set's signal
REACH = 2  # bins either side of θ's where the calibration may decide
MIN_COUNT = 12  # tested tokens a bin needs before its rate decides
PRIOR = 4.0  # pseudo-tokens at the pooled rate each bin's rate is shrunk toward
EXPLORE_EVERY = 4  # steps between two explorations of a bin short of evidence


@dataclass
class AcceptanceCalibration:
    """Realized acceptance of trunk tokens by bin of the signal at the node that drew them (module docstring).

    Attributes:
        edges: ``(B - 1,)`` increasing inner bin edges (bin b holds edges[b-1] <= signal < edges[b]).
        band: ``(first, last)`` the bins, inclusive, where the calibration may decide.
        theta: the fitted threshold (the rule halts below it).
        tested: ``(B,)`` tokens whose acceptance a step revealed, per bin; ``accepted``: ``(B,)`` of them accepted.
        steps: the steps recorded so far (every request's).
    """

    edges: np.ndarray
    band: tuple[int, int]
    theta: float
    min_count: int = MIN_COUNT
    explore_every: int = EXPLORE_EVERY
    tested: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)
    steps: int = field(init=False, default=0)
    _explored: int = field(init=False, default=-1)  # the step count at the last exploration

    def __post_init__(self) -> None:
        self.tested = np.zeros(len(self.edges) + 1, dtype=np.int64)
        self.accepted = np.zeros(len(self.edges) + 1, dtype=np.int64)

    @classmethod
    def around(cls, values: np.ndarray, theta: float, bins: int = BINS, reach: int = REACH,
               min_count: int = MIN_COUNT, explore_every: int = EXPLORE_EVERY) -> AcceptanceCalibration | None:
        """Bins from the deciles of ``values`` (the fit set's signal at the rule's decision depths, any shape) and
        the band of ``reach`` bins either side of θ's; None when the values hold fewer than two distinct values."""
        finite = np.asarray(values, dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        if np.unique(finite).size < 2:
            return None
        edges = np.unique(np.quantile(finite, np.linspace(0.0, 1.0, bins + 1)[1:-1]))
        if edges.size == 0:
            return None
        at = int(np.searchsorted(edges, theta, side="right"))
        return cls(edges, (max(at - reach, 0), min(at + reach, len(edges))), theta, min_count, explore_every)

    def bin(self, signal: float) -> int:
        return int(np.searchsorted(self.edges, signal, side="right"))

    @property
    def pooled(self) -> float:
        """The acceptance rate over every bin (0.5 before anything was tested)."""
        total = int(self.tested.sum())
        return float(self.accepted.sum()) / total if total else 0.5

    def rate(self, signal: float) -> float:
        """β̃ of the bin of ``signal``: its acceptance rate shrunk toward the pooled one by :data:`PRIOR` tokens."""
        b = self.bin(signal)
        return (float(self.accepted[b]) + PRIOR * self.pooled) / (float(self.tested[b]) + PRIOR)

    def decides(self, signal: float) -> bool:
        """Whether the calibration decides at a node with this signal (in the band, with enough tested tokens)."""
        b = self.bin(signal)
        return self.band[0] <= b <= self.band[1] and self.tested[b] >= self.min_count

    def halts(self, depth: int, signals: Mapping[int, float], chain_ms: np.ndarray) -> bool | None:
        """At trunk ``depth``: whether to halt by the marginal rule on β̃ (``signals``: the step's signal at each
        node so far, ``depth`` included; ``chain_ms (> depth + 1,)`` the step times of chains (1, d, 0)); False to
        explore; None where the fitted rule decides."""
        signal = signals[depth]
        if not self.decides(signal):
            b = self.bin(signal)
            due = self.steps % self.explore_every == 0 and self._explored != self.steps
            if self.band[0] <= b <= self.band[1] and signal < self.theta and due:
                self._explored = self.steps  # one token more, once in this step
                return False
            return None
        # β̃ at depths 0..depth, and one more entry so that the gain at ``depth`` reads T_{depth+1} - T_depth
        beta = np.array([self.rate(signals[d]) if d in signals else self.pooled for d in range(depth + 1)] + [0.0])
        gain = marginal_gain(beta, np.asarray(chain_ms[:depth + 2], dtype=np.float64))
        return bool(gain[depth] < 1.0)

    def record(self, signals: Mapping[int, float], trunk: int, accepted: int) -> None:
        """One step's outcome: the signal at each trunk node that computed one, the trunk's length (tokens drawn
        on it) and the accepted length τ. The token drawn at depth d < trunk was tested when τ >= d."""
        self.steps += 1
        for depth, signal in signals.items():
            if depth < trunk and accepted >= depth:
                b = self.bin(signal)
                self.tested[b] += 1
                self.accepted[b] += accepted >= depth + 1

    def describe(self) -> str:
        return (f"calibrated online: {int(self.tested.sum())} trunk tokens seen, acceptance {self.pooled:.2f}; "
                f"bins {self.band[0]}..{self.band[1]} of {len(self.edges) + 1} around θ")
