"""Expansion decided while drafting, fitted: per-node halting rules and a learned per-node acceptance model.

At trunk depth d = 0, 1, … a per-node policy sees the draft's state at that node and decides: go on with the trunk,
or halt and draft a terminal there: stop (the single path (1, d, 0)) or branch into K i.i.d. branches of L2 tokens
(the tree (K, d, L2)). Its decision at node d may use only the draft's own draws and laws up to d, so the halting
depth is a stopping time of the draft's filtration and every verifier of delayed trees stays exact.

Every rule here is a threshold rule ``R(signal, θ, floor, cap, terminal)``: continue while d < floor, or while
d < cap and signal_d ≥ θ; at the halting depth d* draft the terminal. The signals:

* ``top``: the draft's top probability at the node (or minus its ``entropy``): the draft's own confidence;
* ``learned``: β̂_d, a ridge regression of the node's acceptance β = 1 − TV(p, q) on the draft's hidden state,
  entropy, top probability, depth and the root scalars (a learned acceptance head, after SpecDec++);
* ``beta``: the exact β_d (an oracle: it needs the target's law, which a policy may not see while drafting).

This module holds the episodes and what is fitted on them: the rules and their search, the machine-free
profiles, the learned head and the prompt folds. selector/expansion.py scores them offline, cross-fitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data_gen.throughput import best_static, time_per_token
from decode.drafting.actions import Action
from decode.policies.guard import RuleProfile, StaticProfile, harmonic_mean, length_quantiles
from decode.policies.halting import HaltingRule as Rule  # the rule the decoder runs
from decode.policies.halting import halting_depth
from decode.policies.signals import SIGNALS, TrunkArrays, signal_names


@dataclass
class EpisodeData:
    """One verifier at one sampling configuration: every (root, tree) episode.

    Attributes:
        be: ``(N, s, A)`` per-tree Ê[τ+1]; step: ``(N, A)`` T̂; prompts: ``(N,)`` prompt ids.
        top, entropy: ``(N, s, D)`` the draft's top probability and entropy at trunk depths 0..D-1 (D = L_max + 1).
        beta: ``(N, s, D)`` the exact 1 − TV at those nodes.
        features: ``(N, s, D, F)`` what the learned head sees at each node.
        trunk_pass_ms: ``(N,)`` one draft pass at the root's context length (the latency model's t_q(l, 1)): what
            a rule pays for looking at a node it then stops at (:func:`rule_step_ms`).
        actions: the action list (column order of ``be`` and ``step``).
        lengths: ``(N,)`` the roots' context lengths (what a machine-free profile of the fit keeps:
            decode/policies/guard.py).
        draw_q, draw_rank, draw_top: ``(N, s, D)`` the trunk's draws (decode/policies/signals.py ``TrunkArrays``);
            None for collections made before they were stored.
    """

    be: np.ndarray
    step: np.ndarray
    prompts: np.ndarray
    top: np.ndarray
    entropy: np.ndarray
    beta: np.ndarray
    features: np.ndarray
    trunk_pass_ms: np.ndarray
    actions: list[Action] = field(default_factory=list)
    lengths: np.ndarray | None = None
    draw_q: np.ndarray | None = None
    draw_rank: np.ndarray | None = None
    draw_top: np.ndarray | None = None

    def take(self, rows: np.ndarray) -> EpisodeData:
        def cut(values: np.ndarray | None) -> np.ndarray | None:
            return None if values is None else values[rows]

        return EpisodeData(self.be[rows], self.step[rows], self.prompts[rows], self.top[rows], self.entropy[rows],
                           self.beta[rows], self.features[rows], self.trunk_pass_ms[rows], self.actions,
                           cut(self.lengths), cut(self.draw_q), cut(self.draw_rank), cut(self.draw_top))

    def trunk_arrays(self) -> TrunkArrays:
        """The trunk states every registered signal reads offline."""
        return TrunkArrays(self.top, self.entropy, self.draw_q, self.draw_rank, self.draw_top)

    def node_signals(self) -> dict[str, np.ndarray]:
        """``(N, s, D)`` every registered per-node signal these episodes can compute (decode/policies/signals.py)."""
        arrays = self.trunk_arrays()
        return {name: SIGNALS[name].offline(arrays) for name in signal_names(arrays)}


class _Index:
    """Column of each (K, L1, L2) in the data set's action list, by canonical tree."""

    def __init__(self, actions: list[Action]) -> None:
        self.column = {a.canonical(): i for i, a in enumerate(actions)}

    def __call__(self, k: int, l1: int, l2: int) -> int:
        return self.column[Action(k, l1, l2).canonical()]


def rule_throughput(data: EpisodeData, signal: np.ndarray, rule: Rule, index: _Index) -> tuple[float, float]:
    """(roots, Σ ms per token) of a rule over every episode (:func:`episode_sums`)."""
    terms, _ = rule_terms(data, signal, rule, index)
    return float(len(terms)), float(terms.sum())


def rule_terms(data: EpisodeData, signal: np.ndarray, rule: Rule, index: _Index) -> tuple[np.ndarray, np.ndarray]:
    """(``(N,)`` each root's ms per token under ``rule``, ``(N, s)`` the action column each episode drafts): each
    root's Ê and T̂ averaged over its trees, as :func:`episode_sums` combines them."""
    depth = halting_depth(signal, rule.theta, rule.floor, rule.cap)  # (N, s)
    columns = _columns(index, rule, depth)
    rows = np.arange(len(data.be))[:, None]
    trees = np.arange(data.be.shape[1])[None, :]
    step = rule_step_ms(data, rule, depth, columns)
    return time_per_token(np.nanmean(data.be[rows, trees, columns], axis=1), step.mean(axis=1)), columns


def rule_step_ms(data: EpisodeData, rule: Rule, depth: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``(N, s)`` the step time of each episode under ``rule``, halted at ``depth`` on the trees ``columns``.

    It is the halted tree's T̂, plus one draft pass where the rule stops a chain at 1 ≤ d < cap: to look at node d
    the loop ran its forward (decode/drafting/delayed.py), which the static chain (1, d, 0) never runs, since nothing is
    drawn from the last node's law. A rule that branches drafts from the halting node's law, as the static tree does,
    and one that stops at the root or at its cap looks at no extra node."""
    rows = np.arange(len(data.be))[:, None]
    step = data.step[rows, columns]
    if rule.k > 1 and rule.l2 > 0:
        return step
    looked = (depth >= 1) & (depth < rule.cap)
    return step + data.trunk_pass_ms[:, None] * looked


def episode_sums(be: np.ndarray, step: np.ndarray) -> tuple[float, float]:
    """(N, Σ_i T̄_i / Ē_i) for ``be`` ``(N, s)`` and ``step`` ``(N, s)`` or ``(N, 1)``: each root's Ê and T̂
    averaged over its trees (the episodes a step there could draw), then the roots combined as the decoding loop
    meets them (data_gen/throughput.py): the throughput is the first over the second."""
    return float(len(be)), float(time_per_token(np.nanmean(be, axis=1), step.mean(axis=1)).sum())


def candidate_rules(signal: np.ndarray, l_max: int, k_max: int, thetas: int = 16) -> list[Rule]:
    """The rule grid: θ at quantiles of the signal, floors 0..2, caps 1..L_max, every terminal."""
    values = np.unique(np.quantile(signal[np.isfinite(signal)], np.linspace(0.02, 0.98, thetas)))
    terminals = [(1, 0)] + [(k, l2) for k in range(2, k_max + 1) for l2 in range(1, l_max + 1)]
    return [Rule(float(t), f, c, k, l2) for t in values for f in (0, 1, 2) for c in range(1, l_max + 1) if f <= c
            for k, l2 in terminals]


def best_rule(data: EpisodeData, signal: np.ndarray, rules: list[Rule], index: _Index) -> Rule:
    """The rule with the highest stream throughput on ``data``, among the rules whose every action it can pick has a
    label for this verifier.

    A rule can halt at any depth from its floor to its cap, on trees it is scored on later even where it never did on
    ``data``; a rule that could pick a tree the verifier has no label for (GBV on delayed trees) is left out, else the
    held-out score would read NaN.
    """
    labelled = np.isfinite(data.be).all(axis=(0, 1))  # (A,) actions this verifier labels at every root
    admissible = [rule for rule in rules if labelled[[index(rule.k, d, rule.l2 if rule.k > 1 else 0)
                                                      for d in range(rule.floor, rule.cap + 1)]].all()]
    if not admissible:
        raise ValueError("no rule of the grid drafts only trees this verifier has labels for")
    best, best_value = admissible[0], -np.inf
    cache: dict[tuple, np.ndarray] = {}
    rows = np.arange(len(data.be))[:, None]
    trees = np.arange(data.be.shape[1])[None, :]
    for rule in admissible:
        key = (rule.theta, rule.floor, rule.cap)
        if key not in cache:
            cache[key] = halting_depth(signal, *key)
        depth = cache[key]
        columns = _columns(index, rule, depth)
        roots, time = episode_sums(data.be[rows, trees, columns], rule_step_ms(data, rule, depth, columns))
        value = roots / time
        if value > best_value:
            best, best_value = rule, value
    return best


def _columns(index: _Index, rule: Rule, depth: np.ndarray) -> np.ndarray:
    """The action column each episode drafts: the rule's terminal at its halting depth."""
    lookup = np.array([index(rule.k, d, rule.l2 if rule.k > 1 else 0) for d in range(rule.cap + 1)])
    return lookup[depth]


def static_profile(data: EpisodeData) -> StaticProfile:
    """The machine-free profile of every static action on ``data`` (decode/policies/guard.py): Ê averaged over each
    root's trees, then over the roots (harmonically: tokens per step)."""
    return StaticProfile.from_labels([a.key for a in data.actions], np.nanmean(data.be, axis=1), data.lengths)


def rule_profile(data: EpisodeData, signal: np.ndarray, rule: Rule, min_gain: float) -> RuleProfile:
    """The machine-free profile of ``rule`` halting on ``signal`` ``(N, s, D)`` over ``data`` (in-sample): its mean
    Ê, the share of episodes drafting each tree, the share paying one draft pass more (:func:`rule_step_ms`), and
    per tree the stream weight Σ 1/Ê of the roots that drafted it (``inverse_be``), which keeps what the rule is
    for: small trees where Ê is low, large ones where it is high (decode/policies/guard.py ``RuleProfile``)."""
    index = _Index(data.actions)
    depth = halting_depth(signal, rule.theta, rule.floor, rule.cap)  # (N, s)
    columns = _columns(index, rule, depth)
    rows = np.arange(len(data.be))[:, None]
    trees = np.arange(data.be.shape[1])[None, :]
    keys = np.array([a.canonical().key for a in data.actions], dtype=object)[columns]  # (N, s)
    shares = {str(k): float((keys == k).mean()) for k in np.unique(keys)}
    looked_at = np.zeros(depth.shape, dtype=bool) if rule.k > 1 and rule.l2 > 0 else (depth >= 1) & (depth < rule.cap)
    per_root = np.nanmean(data.be[rows, trees, columns], axis=1)  # (N,) Ē_i
    # the stream's Σ_i T̄_i / Ē_i, with T̄_i the mean over the root's trees, split by tree: Σ_tree T(tree) · w_tree
    weight = (1.0 / per_root)[:, None] / columns.size  # (N, 1): each episode's 1 / (N s Ē_i)
    inverse_be = {str(k): float((weight * (keys == k)).sum()) for k in shares}
    looked_inverse = float((weight * looked_at).sum())
    return RuleProfile(float(harmonic_mean(per_root)), shares, float(looked_at.mean()),
                       length_quantiles(data.lengths), min_gain, inverse_be, looked_inverse)


def static_best(data: EpisodeData) -> int:
    """The action with the highest stream throughput over every episode (labelled everywhere)."""
    return best_static(data.be.mean(axis=1), data.step)  # a static action: its root's Ê is the mean over trees


def fit_beta_head(data: EpisodeData, alpha: float = 10.0):
    """A ridge regression of β at every trunk node on its features (hidden state, entropy, top, depth, root)."""
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x = data.features.reshape(-1, data.features.shape[-1])
    y = data.beta.reshape(-1)
    keep = np.isfinite(y)
    return make_pipeline(StandardScaler(), Ridge(alpha=alpha)).fit(x[keep], y[keep])


def predict_beta(head, data: EpisodeData) -> np.ndarray:
    shape = data.features.shape[:-1]
    return head.predict(data.features.reshape(-1, data.features.shape[-1])).reshape(shape)


def out_of_fold_beta(data: EpisodeData, folds: int = 3) -> np.ndarray:
    """β̂ at every node of ``data``, each predicted by a head fitted on the other prompts (in-sample with a single
    prompt): the signal the rules are tuned on must be as noisy as the one they will be scored on."""
    groups = folds_by_prompt(data.prompts, folds, seed=1)
    if len(groups) < 2:
        return predict_beta(fit_beta_head(data), data)
    out = np.zeros_like(data.beta)
    for rows in groups:
        rest = np.setdiff1d(np.arange(len(data.be)), rows)
        out[rows] = predict_beta(fit_beta_head(data.take(rest)), data.take(rows))
    return out


def folds_by_prompt(prompts: np.ndarray, folds: int, seed: int = 0) -> list[np.ndarray]:
    """Row indices of ``folds`` groups of whole prompts (one group per prompt where there are fewer prompts than
    folds; the commands refuse a user's --folds above the prompt count before any work)."""
    unique = np.array(sorted(set(prompts.tolist())), dtype=object)
    order = unique[np.random.default_rng(seed).permutation(len(unique))]
    groups = np.array_split(order, min(folds, len(unique)))
    return [np.flatnonzero(np.isin(prompts, g)) for g in groups if len(g)]
