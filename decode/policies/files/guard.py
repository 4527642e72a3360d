"""The never-lose guard's machine half: what each static tree and each halting rule earns, free of any machine's
times, so that the running machine's latency table picks the fallback.

A selector, an expander or a policy file is fitted on one machine, but the best static tree depends on the machine: on a
CPU where a target pass over 8 tokens costs little more than one pass, a wide delayed tree wins; on one where it costs
several, drafting nothing does. Ê[τ+1] of an action depends on the pair, the verifier, the sampling and the context,
never on the machine; only T̂ does (algorithms.md §3.5). A policy file therefore carries, per sampling configuration, a
:class:`StaticProfile` (mean Ê of every action over its fitting roots and those roots' context lengths) and, for a
halting rule, a :class:`RuleProfile` (the rule's mean Ê and the trees it drafted there). Under the latency table of the
machine it runs on, :meth:`StaticProfile.best` names that machine's best static tree and
:meth:`RuleProfile.tokens_per_ms` says whether the rule still beats it.

Throughput of a static action a over the fitting roots: Ē_a / mean over the roots' lengths l of T̂(l, a), where Ē_a is
the tokens per step the loop makes with it (decode/cost/throughput.py ``block_efficiency``: the harmonic mean of
its per-root Ê over trajectory positions, the plain mean over a loop's step starts) and the lengths are ≤ 16 quantiles
of the roots'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from decode.cost.pricing import mean_step_ms
from decode.cost.table import LatencyTable
from decode.cost.throughput import block_efficiency
from decode.drafting.actions import Action

LENGTH_QUANTILES = 16


def length_quantiles(lengths: np.ndarray) -> list[int]:
    """≤ 16 context lengths standing for the fitting roots' ``(N,)`` lengths (their quantiles, distinct)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.size == 0:
        raise ValueError("no root lengths to profile")
    points = np.quantile(lengths, (np.arange(LENGTH_QUANTILES) + 0.5) / LENGTH_QUANTILES)
    return sorted({int(round(p)) for p in points})


@dataclass(frozen=True)
class StaticProfile:
    """What each static tree earned on the fitting roots of one verifier at one sampling configuration.

    Attributes:
        actions: ``"K,L1,L2"`` of every action labelled at every fitting root.
        be: ``(A,)`` Ê[τ+1] over those roots (tokens per step), in ``actions`` order.
        lengths: the roots' context lengths (:func:`length_quantiles`).
    """

    actions: list[str]
    be: list[float]
    lengths: list[int]

    def __post_init__(self) -> None:
        if not self.actions or len(self.actions) != len(self.be):
            raise ValueError("a static profile needs one Ê per action")
        if not all(np.isfinite(v) and v >= 1.0 for v in self.be):
            raise ValueError("a static profile's Ê[τ+1] must be finite and >= 1")
        if not self.lengths or not all(isinstance(v, int) and v >= 1 for v in self.lengths):
            raise ValueError("a static profile needs its roots' context lengths (integers >= 1)")
        for text in self.actions:
            Action.parse(text)

    @classmethod
    def from_labels(cls, actions: Sequence[str], be: np.ndarray, lengths: np.ndarray,
                    per_step: bool = False) -> StaticProfile:
        """The profile of ``be`` ``(N, A)`` (Ê per root and action, NaN where unlabelled) at roots of ``(N,)``
        context lengths; actions unlabelled at any root are left out. ``per_step``: the roots sample a loop's step
        starts (the plain mean of Ê is then its tokens per step), else trajectory positions (the harmonic mean)."""
        be = np.asarray(be, dtype=np.float64)
        labelled = np.isfinite(be).all(axis=0)
        mean = np.asarray(block_efficiency(be[:, labelled], per_step))  # (A,): one per column of a 2-D be
        kept = [a for a, keep in zip(actions, labelled, strict=True) if keep]
        return cls(kept, [float(v) for v in mean], length_quantiles(lengths))

    @classmethod
    def from_dict(cls, data: dict) -> StaticProfile:
        try:
            return cls(list(data["actions"]), [float(v) for v in data["be"]], [int(v) for v in data["lengths"]])
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed static profile ({err})") from err

    def as_dict(self) -> dict:
        return asdict(self)

    def tokens_per_ms(self, table: LatencyTable) -> np.ndarray:
        """``(A,)`` each action's throughput under ``table``."""
        parsed = [Action.parse(a) for a in self.actions]
        return np.asarray(self.be) / mean_step_ms(table, self.lengths, parsed)

    def best(self, table: LatencyTable, among: Sequence[Action] | None = None) -> Action:
        """The static tree with the highest throughput under ``table`` (``among``: only these actions)."""
        rates = self.tokens_per_ms(table)
        if among is not None:
            allowed = {a.key for a in among}
            rates = np.where([a in allowed for a in self.actions], rates, -np.inf)
            if not np.isfinite(rates).any():
                raise ValueError("none of the allowed actions is in the static profile")
        return Action.parse(self.actions[int(np.argmax(rates))])


@dataclass(frozen=True)
class RuleProfile:
    """What a halting rule earned on its fitting roots (in-sample).

    Attributes:
        be: its Ê[τ+1] over the roots (each root's mean over its trees, then the roots' tokens per step: the plain
            mean over step roots, the harmonic mean over position roots; decode/cost/throughput.py).
        trees: the fraction of episodes that drafted each tree (``"K,L1,L2"`` → fraction, summing to 1).
        looked: the fraction of episodes that paid one draft pass more than their tree's T̂ (a chain stopped at
            1 ≤ d < cap: the loop ran node d's forward to look at it; selector/expander/expansion_fit.py
            ``rule_step_ms``).
        lengths: the roots' context lengths (:func:`length_quantiles`).
        inverse_be: per tree, Σ over the episodes that drafted it of 1 / (N s Ē_i) (Ē_i: its root's Ê; over step
            roots 1 / (N s mean Ē)): the stream
            throughput under any table is then 1 / Σ_tree T(tree) · inverse_be[tree] (+ the looks), which keeps the
            rule's pairing of small trees with low Ê. None in files written before it: then Ê / mean T, which
            drops that pairing and reads a rule low.
        looked_inverse: the same weight summed over the episodes that paid a look.
    """

    be: float
    trees: dict[str, float]
    looked: float
    lengths: list[int]
    min_gain: float = field(default=0.0)
    inverse_be: dict[str, float] | None = None
    looked_inverse: float = 0.0

    @classmethod
    def from_dict(cls, data: dict) -> RuleProfile:
        try:
            inverse = data.get("inverse_be")
            return cls(float(data["be"]), {str(k): float(v) for k, v in data["trees"].items()},
                       float(data["looked"]), [int(v) for v in data["lengths"]], float(data.get("min_gain", 0.0)),
                       None if inverse is None else {str(k): float(v) for k, v in inverse.items()},
                       float(data.get("looked_inverse", 0.0)))
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"malformed rule profile ({err})") from err

    def as_dict(self) -> dict:
        return asdict(self)

    def tokens_per_ms(self, table: LatencyTable) -> float:
        """The rule's stream throughput under ``table`` (tokens per ms; see ``inverse_be``)."""
        look_ms = float(np.mean([table.draft(length, 1) for length in self.lengths]))
        if self.inverse_be is not None:
            actions = [Action.parse(a) for a in self.inverse_be]
            weights = np.asarray(list(self.inverse_be.values()))
            return 1.0 / (float(weights @ mean_step_ms(table, self.lengths, actions)) + self.looked_inverse * look_ms)
        actions = [Action.parse(a) for a in self.trees]
        weights = np.asarray(list(self.trees.values()))
        step = float(weights @ mean_step_ms(table, self.lengths, actions))
        return self.be / (step + self.looked * look_ms)

    def beats(self, static: StaticProfile, table: LatencyTable) -> bool:
        """Whether the rule's throughput under ``table`` clears the best static tree's by ``min_gain``."""
        return self.tokens_per_ms(table) >= (1.0 + self.min_gain) * float(static.tokens_per_ms(table).max())


def machine_note(table: LatencyTable | None, has_profile: bool) -> str:
    """Where a fallback came from, for ``describe`` lines ("" where nothing could have changed it)."""
    if table is not None and has_profile:
        return ", best on this machine's latency table"
    if table is not None:
        return ", the fitting machine's: the file carries no static profile"
    return ", as fitted" if has_profile else ""
