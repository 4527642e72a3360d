"""The halting rule, one for every per-node policy and for the offline fit: where a trunk stops growing.

At trunk depth d = 0, 1, … a per-node policy computes one signal from the draft's own state (higher: surer) and
halts at the first depth with ``d >= cap`` or (``d >= floor`` and ``signal_d < θ``); there it drafts its terminal.
:class:`HaltingRule` answers node by node for the decoder (:meth:`HaltingRule.halts`) and for whole arrays of
episodes offline (:func:`halting_depth`): the same rule, so a fit scores what the loop runs. The entropy stop of
decode/policies/base.py is this rule on minus the entropy; :func:`marginal_gain` is the marginal rule's signal
(:func:`survival_gain` on a survival read from the trunk's draws).
The module needs numpy only: the policy interface imports it without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decode.drafting.actions import Action


def halting_depth(signal: np.ndarray, theta: float, floor: int, cap: int) -> np.ndarray:
    """``(...)`` the halting depth of each episode of ``signal`` ``(..., D)``: the first depth d where ``d >= cap`` or
    (``d >= floor`` and ``signal_d < θ``), :meth:`HaltingRule.halts` over arrays."""
    depth = signal.shape[-1]
    d = np.arange(depth)
    halt = (d >= cap) | ((d >= floor) & (signal < theta))
    halt[..., min(cap, depth - 1)] = True
    return halt.argmax(axis=-1)


def marginal_gain(beta: np.ndarray, chain_ms: np.ndarray) -> np.ndarray:
    """The marginal rule's signal ``(..., D)`` at trunk depths 0..D-1, from β̂ ``(..., D)`` at those nodes and the
    step times ``(..., D)`` of the chains (1, d, 0), d = 0..D-1: :func:`survival_gain` with the survival
    P_j = β̂_0 ⋯ β̂_{j-1}, the chance the first j trunk tokens are accepted before any of them is drawn (the threshold
    a rule fits stands near 1 where β̂ is calibrated)."""
    beta = np.clip(np.asarray(beta, dtype=np.float64), 0.0, 1.0)
    survival = np.concatenate([np.ones_like(beta[..., :1]), np.cumprod(beta, axis=-1)[..., :-1]], axis=-1)
    return survival_gain(survival, beta, chain_ms)


def survival_gain(survival: np.ndarray, beta: np.ndarray, chain_ms: np.ndarray) -> np.ndarray:
    """The marginal rule's signal ``(..., D)`` from the trunk's survival P ``(..., D)`` (P_d: the chance the d tokens
    drawn before depth d are all accepted, P_0 = 1), β̂ ``(..., D)`` of the token each node would draw next, and the
    step times ``(..., D)`` of the chains (1, d, 0), d = 0..D-1.

    A chain of d tokens yields E_d = P_0 + P_1 + … + P_d tokens in T_d; one more token adds P_d β̂_d tokens and
    T_{d+1} − T_d. The signal is the ratio of the two rates, (P_d β̂_d / (T_{d+1} − T_d)) / (E_d / T_d): growing pays
    while it is above 1. The last step's time difference is the previous one. A rule on it is a stopping time of the
    draft's draws as long as P_d and β̂_d read nothing past depth d.
    """
    survival = np.clip(np.asarray(survival, dtype=np.float64), 0.0, 1.0)
    beta = np.clip(np.asarray(beta, dtype=np.float64), 0.0, 1.0)
    chain = np.asarray(chain_ms, dtype=np.float64)
    reach = survival * beta  # P_{d+1} before x_{d+1} is drawn
    # summed as 1 + (P_1 + … + P_d): the order marginal_gain always summed in, so its values stay bit for bit
    expected = 1.0 + np.concatenate([np.zeros_like(survival[..., :1]), np.cumsum(survival[..., 1:], axis=-1)], axis=-1)
    added = np.diff(chain, axis=-1)
    added = np.concatenate([added, added[..., -1:]], axis=-1) if added.shape[-1] else np.ones_like(chain)
    return (reach / np.maximum(added, 1e-6)) / (expected / np.maximum(chain, 1e-6))


@dataclass(frozen=True)
class HaltingRule:
    """Halt the trunk at the first depth d with ``d >= cap`` or (``d >= floor`` and ``signal_d < theta``), then draft
    ``k`` branches of ``l2`` tokens there (``k == 1``: stop, the single path)."""

    theta: float
    floor: int
    cap: int
    k: int
    l2: int

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.cap or self.k < 1 or self.l2 < 0 or (self.k > 1 and self.l2 < 1):
            raise ValueError(f"not a halting rule: {self!r} (need 0 <= floor <= cap, K >= 1, and L2 >= 1 to branch)")

    def halts(self, depth: int, signal: float | Callable[[], float]) -> bool:
        """Whether the trunk stops growing at ``depth`` (the terminal is drafted there). ``signal`` may be a callable,
        then called only where the depth alone does not decide (``floor <= depth < cap``)."""
        if depth >= self.cap or depth < self.floor:
            return depth >= self.cap
        return (signal() if callable(signal) else signal) < self.theta

    @property
    def widest(self) -> Action:
        """The tree drafted when the trunk reaches the cap: the decoder's upper bound on the step's shape."""
        return Action(self.k, self.cap, self.l2) if self.k > 1 else Action(1, self.cap, 0)

    def tree_at(self, depth: int) -> Action:
        """The tree drafted when the trunk halts at ``depth``."""
        return Action(self.k, depth, self.l2) if self.k > 1 else Action(1, depth, 0)

    def describe(self) -> str:
        terminal = "stop" if self.k == 1 else f"branch K={self.k}, L2={self.l2}"
        return f"θ={self.theta:.3g}, floor {self.floor}, cap {self.cap}, then {terminal}"
