"""An expander's rule fitted to the machine that runs it: the fitting episodes travel in the file, free of any
machine's times, and the decoder chooses the signal, θ, floor, cap, terminal and static fallback again on its own
latency table.

Ê[τ+1] of every tree, the draft's signals at every trunk node and the roots' context lengths depend on the pair, the
verifier, the sampling and the text, never on the machine; the step times do. A rule fitted on one machine's times
stops the trunk where that machine's next token stops paying: on a CPU whose wide target passes cost little more than
one-token ones longer trunks pay, and a threshold fitted elsewhere halts too early (results/NOTEBOOK.md has a CPU
where the shipped Qwen expanders lost so). :class:`FitSet` keeps the episodes a file was fitted on; :func:`refit`
prices them with the running machine's table and repeats the export's procedure there: every signal's best rule,
cross-fitted by prompt against the best static tree, the best signal kept only where its cross-fitted gain clears
``min_gain``, then refitted on every episode. The verdict is held-out on this machine's times: the in-sample
profiles of decode/policies/files/guard.py could not see a rule's optimism, and let the shipped rules run where they
lost.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from decode.cost.table import LatencyTable, draft_passes
from decode.cost.throughput import ROOT_PLACEMENTS
from decode.drafting.actions import Action
from decode.policies.fit.rule_fit import (
    ActionIndex,
    best_rule,
    candidate_rules,
    episode_sums,
    folds_by_prompt,
    rule_terms,
    static_throughputs,
)
from decode.policies.halting import HaltingRule, marginal_gain
from decode.policies.signals import SIGNALS

FOLDS = 5


def _encode(values: np.ndarray, dtype: str) -> dict:
    array = np.ascontiguousarray(values, dtype=dtype)
    return {"dtype": dtype, "shape": list(array.shape), "data": base64.b64encode(array.tobytes()).decode("ascii")}


def _decode(blob: dict) -> np.ndarray:
    if blob.get("dtype") not in ("<f2", "<i4"):
        raise ValueError(f"fit set array of dtype {blob.get('dtype')!r}, expected '<f2' or '<i4'")
    raw = base64.b64decode(blob["data"].encode("ascii"), validate=True)
    return np.frombuffer(raw, dtype=blob["dtype"]).reshape(blob["shape"]).astype(np.float64)


@dataclass(frozen=True)
class MachineEpisodes:
    """A fit set's episodes priced on one machine (decode/policies/fit/rule_fit.py ``Episodes``)."""

    be: np.ndarray  # (N, s, A)
    step: np.ndarray  # (N, A)
    trunk_pass_ms: np.ndarray  # (N,)
    actions: list[Action]
    prompts: np.ndarray  # (N,)
    per_step: bool  # the roots sample a loop's steps (decode/cost/throughput.py)

    def take(self, rows: np.ndarray) -> MachineEpisodes:
        return MachineEpisodes(self.be[rows], self.step[rows], self.trunk_pass_ms[rows], self.actions,
                               self.prompts[rows], self.per_step)


@dataclass(frozen=True)
class FitSet:
    """The episodes one sampling configuration's rule was fitted on, without step times.

    Attributes:
        actions: the A trees a rule of the grid may draft (``"K,L1,L2"``), the columns of ``be``.
        be: ``(N, s, A)`` per-tree Ê[τ+1] (NaN where the verifier has no label).
        lengths: ``(N,)`` each root's context length.
        prompts: ``(N,)`` each root's prompt, as a group number (the cross-fitting's folds).
        signals: name → ``(N, s, D)`` the signal at trunk depths 0..D-1, as the decoder computes it (β̂ signals
            out of fold: as noisy as on new prompts).
        l_max, k_max: the grid's bounds.
        roots: where the collection put its roots, ``"positions"`` or ``"steps"`` (how they stand for a stream:
            decode/cost/throughput.py); files written before it was recorded are positions.
    """

    actions: list[str]
    be: np.ndarray
    lengths: np.ndarray
    prompts: np.ndarray
    signals: dict[str, np.ndarray]
    l_max: int
    k_max: int
    roots: str = "positions"

    def __post_init__(self) -> None:
        if self.roots not in ROOT_PLACEMENTS:
            raise ValueError(f"a fit set's roots are positions or steps, not {self.roots!r}")
        n, s, a = self.be.shape
        if len(self.actions) != a or self.lengths.shape != (n,) or self.prompts.shape != (n,):
            raise ValueError("a fit set's labels, lengths and prompts must cover the same roots and actions")
        if any(v.shape[:2] != (n, s) or v.shape[2] != self.l_max + 1 for v in self.signals.values()):
            raise ValueError("a fit set's signals must be (roots, trees, l_max + 1)")

    def as_dict(self) -> dict:
        """JSON-ready: float16 and int32 arrays, base64 (no pickle)."""
        return {"actions": self.actions, "be": _encode(self.be, "<f2"), "lengths": _encode(self.lengths, "<i4"),
                "prompts": _encode(self.prompts, "<i4"), "l_max": self.l_max, "k_max": self.k_max,
                "signals": {name: _encode(values, "<f2") for name, values in self.signals.items()},
                "roots": self.roots}

    @classmethod
    def from_dict(cls, data: dict) -> FitSet:
        try:
            return cls(list(data["actions"]), _decode(data["be"]), _decode(data["lengths"]).astype(np.int64),
                       _decode(data["prompts"]).astype(np.int64),
                       {str(k): _decode(v) for k, v in data["signals"].items()}, int(data["l_max"]), int(data["k_max"]),
                       str(data.get("roots", "positions")))
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"malformed fit set ({err})") from err

    def on_machine(self, table: LatencyTable) -> MachineEpisodes:
        """The episodes with ``table``'s step times at each root's context length."""
        actions = [Action.parse(a) for a in self.actions]
        passes = draft_passes(actions)
        step = np.stack([table.step_ms_many(int(length), passes) for length in self.lengths])
        look = np.array([table.draft(int(length), 1) for length in self.lengths])
        return MachineEpisodes(self.be, step, look, actions, self.prompts, self.roots == "steps")

    def machine_signals(self, table: LatencyTable) -> dict[str, np.ndarray]:
        """Every signal a rule may halt on here: the stored ones and, from a β̂ signal, the marginal rule on this
        machine's chain times (decode/policies/signals.py ``NodeSignal.marginal_of``)."""
        out = dict(self.signals)
        for name, signal in SIGNALS.items():
            if signal.marginal_of in self.signals:
                chains = [Action(1, d, 0) for d in range(self.l_max + 1)]
                chain = np.stack([table.step_ms_many(int(length), chains) for length in self.lengths])
                out[name] = marginal_gain(self.signals[signal.marginal_of], chain[:, None, :])
        return out


@dataclass(frozen=True)
class MachineRule:
    """What :func:`refit` chose on one machine: ``signal`` and ``rule`` (None: the static ``fallback`` every step),
    and the cross-fitted ratio of each signal's rule to the best static tree there (``ratios``)."""

    signal: str
    rule: HaltingRule | None
    fallback: Action
    ratios: dict[str, float]


def refit(fit_set: FitSet, table: LatencyTable, min_gain: float, signals: tuple[str, ...] | None = None,
          folds: int = FOLDS) -> MachineRule:
    """The export's choice made again on ``table``: the signal (of ``signals``, default all) whose rule's
    cross-fitted gain over the best static tree is highest and clears ``min_gain``, refitted on every episode;
    else the best static tree there."""
    data = fit_set.on_machine(table)
    values = fit_set.machine_signals(table)
    names = [name for name in (signals or values) if name in values]
    ratios = cross_fitted_ratios(data, {name: values[name] for name in names}, fit_set.l_max, fit_set.k_max, folds)
    fallback = data.actions[int(np.argmax(static_throughputs(data)))].canonical()
    best = max(ratios, key=lambda name: ratios[name], default=None)
    if best is None or ratios[best] < 1.0 + min_gain:
        return MachineRule("static", None, fallback, ratios)
    index = ActionIndex(data.actions)
    rule = best_rule(data, values[best], candidate_rules(values[best], fit_set.l_max, fit_set.k_max), index)
    return MachineRule(best, rule, fallback, ratios)


def cross_fitted_ratios(data: MachineEpisodes, signals: dict[str, np.ndarray], l_max: int, k_max: int,
                        folds: int) -> dict[str, float]:
    """Per signal ``(N, s, D)``: the stream throughput of its best rule, fitted on the other folds of prompts and
    scored on each, over the static tree chosen the same way (the folds of the export's offline figures).
    ``data``: any episode set with prompts and ``take`` (selector's ``EpisodeData`` too)."""
    index = ActionIndex(data.actions)
    groups = folds_by_prompt(data.prompts, folds)
    if len(groups) < 2:
        return {}
    static_sums, sums = np.zeros(2), {name: np.zeros(2) for name in signals}  # (tokens, ms) held out
    for test_rows in groups:
        train_rows = np.setdiff1d(np.arange(len(data.be)), test_rows)
        train, test = data.take(train_rows), data.take(test_rows)
        static = int(np.argmax(static_throughputs(train)))
        static_sums += episode_sums(test.be[:, :, static], test.step[:, static, None], test.per_step)
        for name, values in signals.items():
            rule = best_rule(train, values[train_rows], candidate_rules(values[train_rows], l_max, k_max), index)
            (tokens, ms), _ = rule_terms(test, values[test_rows], rule, index)
            sums[name] += (tokens.sum(), ms.sum())
    static_rate = static_sums[0] / static_sums[1]
    return {name: float(total[0] / total[1] / static_rate) for name, total in sums.items()}
