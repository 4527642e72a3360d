"""Fitting a halting rule on episodes: the grid, the search, and the step time each episode pays.

One owner for the search that the offline fit (selector/expander/expansion_fit.py) and the decoder's refit on the
running machine (decode/policies/fit/machine_fit.py) both run, so a rule fitted at export and one refitted at load are
chosen by the same code. numpy only.

An *episode set* is anything with ``be`` ``(N, s, A)`` (each root's per-tree Ê[τ+1] of every action, NaN where the
verifier has no label), ``step`` ``(N, A)`` (T̂ of every action at the root's context length, on some machine),
``trunk_pass_ms`` ``(N,)`` (one draft pass there), ``actions`` (the A actions) and ``per_step`` (the roots sample
a loop's steps, else trajectory positions: decode/cost/throughput.py): selector's ``EpisodeData`` and
machine_fit's ``MachineEpisodes`` both are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from decode.cost.throughput import static_throughputs as static_over_roots
from decode.cost.throughput import stream_terms
from decode.drafting.actions import Action
from decode.policies.halting import HaltingRule, halting_depth


class Episodes(Protocol):
    """What a rule is fitted on (read only: a frozen dataclass serves)."""

    @property
    def be(self) -> np.ndarray: ...

    @property
    def step(self) -> np.ndarray: ...

    @property
    def trunk_pass_ms(self) -> np.ndarray: ...

    @property
    def actions(self) -> list[Action]: ...

    @property
    def per_step(self) -> bool: ...


class ActionIndex:
    """Column of each (K, L1, L2) in an action list, by canonical tree."""

    def __init__(self, actions: Sequence[Action]) -> None:
        self.column = {a.canonical(): i for i, a in enumerate(actions)}

    def __call__(self, k: int, l1: int, l2: int) -> int:
        return self.column[Action(k, l1, l2).canonical()]

    def terminal_columns(self, rule: HaltingRule) -> np.ndarray:
        """``(cap + 1,)`` the column of the tree ``rule`` drafts when it halts at each depth 0..cap."""
        return np.array([self(rule.k, d, rule.l2 if rule.k > 1 else 0) for d in range(rule.cap + 1)])


def terminals(l_max: int, k_max: int) -> list[tuple[int, int]]:
    """Every (K, L2) a rule may draft where it halts: stop, or K ≤ ``k_max`` branches of 1..``l_max`` tokens."""
    return [(1, 0)] + [(k, l2) for k in range(2, k_max + 1) for l2 in range(1, l_max + 1)]


def candidate_rules(signal: np.ndarray, l_max: int, k_max: int, thetas: int = 16) -> list[HaltingRule]:
    """The rule grid: θ at quantiles of the signal, floors 0..2, caps 1..L_max, every terminal."""
    values = np.unique(np.quantile(signal[np.isfinite(signal)], np.linspace(0.02, 0.98, thetas)))
    return [HaltingRule(float(t), f, c, k, l2) for t in values for f in (0, 1, 2) for c in range(1, l_max + 1)
            if f <= c for k, l2 in terminals(l_max, k_max)]


def looks_at_halting_node(rule: HaltingRule, depth: np.ndarray) -> np.ndarray:
    """Where an episode halted at ``depth`` pays one draft pass more than its tree's T̂: a chain stopped at
    1 ≤ d < cap, since the loop ran node d's forward to look at it and the static chain (1, d, 0) never runs it
    (nothing is drawn from the last node's law). A rule that branches drafts from the halting node's law, as the
    static tree does, and one that stops at the root or at its cap looks at no extra node."""
    if rule.k > 1 and rule.l2 > 0:
        return np.zeros(depth.shape, dtype=bool)
    return (depth >= 1) & (depth < rule.cap)


def rule_step_ms(data: Episodes, rule: HaltingRule, depth: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``(N, s)`` the step time of each episode under ``rule``, halted at ``depth`` on the trees ``columns``."""
    rows = np.arange(len(data.be))[:, None]
    return data.step[rows, columns] + data.trunk_pass_ms[:, None] * looks_at_halting_node(rule, depth)


def episode_sums(be: np.ndarray, step: np.ndarray, per_step: bool) -> tuple[float, float]:
    """(tokens, ms) of the stream for ``be`` ``(N, s)`` and ``step`` ``(N, s)`` or ``(N, 1)``: each root's Ê and T̂
    averaged over its trees (the episodes a step there could draw), then the roots combined as the decoding loop
    meets them (decode/cost/throughput.py): the throughput is the first over the second."""
    tokens, ms = stream_terms(np.nanmean(be, axis=1), step.mean(axis=1), per_step)
    return float(tokens.sum()), float(ms.sum())


def rule_terms(data: Episodes, signal: np.ndarray, rule: HaltingRule, index: ActionIndex
               ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """(``(N,)`` tokens and ``(N,)`` ms each root adds to the stream under ``rule`` halting on ``signal``
    ``(N, s, D)`` (:func:`~decode.cost.throughput.stream_terms`), ``(N, s)`` the action column each episode
    drafts)."""
    depth = halting_depth(signal, rule.theta, rule.floor, rule.cap)
    columns = index.terminal_columns(rule)[depth]
    rows, trees = np.arange(len(data.be))[:, None], np.arange(data.be.shape[1])[None, :]
    step = rule_step_ms(data, rule, depth, columns)
    return stream_terms(np.nanmean(data.be[rows, trees, columns], axis=1), step.mean(axis=1), data.per_step), columns


def best_rule(data: Episodes, signal: np.ndarray, rules: list[HaltingRule], index: ActionIndex) -> HaltingRule:
    """The rule with the highest stream throughput on ``data`` halting on ``signal`` ``(N, s, D)``, among the rules
    whose every action it can pick has a label for this verifier (the first of equals, in ``rules`` order).

    A rule can halt at any depth from its floor to its cap, on trees it is scored on later even where it never did on
    ``data``; a rule that could pick a tree the verifier has no label for (GBV on delayed trees) is left out, else a
    held-out score would read NaN. The rules sharing (θ, floor, cap) share their halting depths and are scored
    together, every terminal at once.
    """
    labelled = np.isfinite(data.be).all(axis=(0, 1))  # (A,) actions this verifier labels at every root
    groups: dict[tuple, list[tuple[HaltingRule, np.ndarray]]] = {}
    for rule in rules:
        lookup = index.terminal_columns(rule)
        if labelled[lookup[rule.floor:]].all():
            groups.setdefault((rule.theta, rule.floor, rule.cap), []).append((rule, lookup))
    if not groups:
        raise ValueError("no rule of the grid drafts only trees this verifier has labels for")
    rows, trees = np.arange(len(data.be))[None, :, None], np.arange(data.be.shape[1])[None, None, :]
    best, best_value = None, -np.inf
    for (theta, floor, cap), group in groups.items():
        depth = halting_depth(signal, theta, floor, cap)  # (N, s)
        columns = np.stack([lookup for _, lookup in group])[:, depth]  # (T, N, s)
        stops = np.array([not (rule.k > 1 and rule.l2 > 0) for rule, _ in group])  # (T,) chains pay looks
        looked = ((depth >= 1) & (depth < cap))[None] & stops[:, None, None]  # looks_at_halting_node, per terminal
        step = data.step[rows, columns] + data.trunk_pass_ms[None, :, None] * looked
        tokens, ms = stream_terms(np.nanmean(data.be[rows, trees, columns], axis=2), step.mean(axis=2),
                                  data.per_step)  # (T, N) each
        values = tokens.sum(axis=1) / ms.sum(axis=1)
        top = int(np.argmax(values))
        if values[top] > best_value:
            best, best_value = group[top][0], float(values[top])
    if best is None:
        raise ValueError("no rule of the grid has a finite throughput on these episodes")
    return best


def static_throughputs(data: Episodes) -> np.ndarray:
    """``(A,)`` the stream throughput of drafting each action every step (each root's Ê the mean over its trees);
    -inf for an action without a label on some root."""
    return static_over_roots(np.nanmean(data.be, axis=1), data.step, data.per_step)


def folds_by_prompt(prompts: np.ndarray, folds: int, seed: int = 0) -> list[np.ndarray]:
    """Row indices of ``folds`` groups of whole prompts (one group per prompt where there are fewer prompts than
    folds; the commands refuse a user's --folds above the prompt count before any work)."""
    unique = np.array(sorted(set(prompts.tolist())), dtype=object)
    order = unique[np.random.default_rng(seed).permutation(len(unique))]
    groups = np.array_split(order, min(folds, len(unique)))
    return [np.flatnonzero(np.isin(prompts, g)) for g in groups if len(g)]
