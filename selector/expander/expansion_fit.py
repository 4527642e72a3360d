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
profiles, the learned head and the prompt folds. selector/expander/expansion.py scores them offline, cross-fitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from decode.cost.throughput import best_static, block_efficiency
from decode.drafting.actions import Action
from decode.policies.files.guard import RuleProfile, StaticProfile, length_quantiles
from decode.policies.fit.rule_fit import ActionIndex as _Index
from decode.policies.fit.rule_fit import (  # noqa: F401  (the fit's names, re-exported for selector/)
    best_rule,
    candidate_rules,
    episode_sums,
    folds_by_prompt,
    looks_at_halting_node,
    rule_terms,
)
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
            decode/policies/files/guard.py).
        draw_q, draw_rank, draw_top: ``(N, s, D)`` the trunk's draws (decode/policies/signals.py ``TrunkArrays``);
            None for collections made before they were stored.
        per_step: the roots sample a reference loop's steps (``roots: steps``), else trajectory positions: how
            they stand for a stream (decode/cost/throughput.py).
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
    per_step: bool = False

    def take(self, rows: np.ndarray) -> EpisodeData:
        def cut(values: np.ndarray | None) -> np.ndarray | None:
            return None if values is None else values[rows]

        return EpisodeData(self.be[rows], self.step[rows], self.prompts[rows], self.top[rows], self.entropy[rows],
                           self.beta[rows], self.features[rows], self.trunk_pass_ms[rows], self.actions,
                           cut(self.lengths), cut(self.draw_q), cut(self.draw_rank), cut(self.draw_top),
                           self.per_step)

    def trunk_arrays(self) -> TrunkArrays:
        """The trunk states every registered signal reads offline."""
        return TrunkArrays(self.top, self.entropy, self.draw_q, self.draw_rank, self.draw_top)

    def node_signals(self) -> dict[str, np.ndarray]:
        """``(N, s, D)`` every registered per-node signal these episodes can compute (decode/policies/signals.py)."""
        arrays = self.trunk_arrays()
        return {name: SIGNALS[name].offline(arrays) for name in signal_names(arrays)}


def static_profile(data: EpisodeData) -> StaticProfile:
    """The machine-free profile of every static action on ``data`` (decode/policies/files/guard.py): Ê averaged over
    each root's trees, then over the roots as they stand for a stream (tokens per step)."""
    return StaticProfile.from_labels([a.key for a in data.actions], np.nanmean(data.be, axis=1), data.lengths,
                                     data.per_step)


def rule_profile(data: EpisodeData, signal: np.ndarray, rule: Rule, min_gain: float) -> RuleProfile:
    """The machine-free profile of ``rule`` halting on ``signal`` ``(N, s, D)`` over ``data`` (in-sample): its mean
    Ê, the share of episodes drafting each tree, the share paying one draft pass more (:func:`rule_step_ms`), and
    per tree the stream weight Σ 1/Ê of the roots that drafted it (``inverse_be``), which keeps what the rule is
    for: small trees where Ê is low, large ones where it is high (decode/policies/files/guard.py ``RuleProfile``)."""
    index = _Index(data.actions)
    depth = halting_depth(signal, rule.theta, rule.floor, rule.cap)  # (N, s)
    columns = index.terminal_columns(rule)[depth]
    rows = np.arange(len(data.be))[:, None]
    trees = np.arange(data.be.shape[1])[None, :]
    keys = np.array([a.canonical().key for a in data.actions], dtype=object)[columns]  # (N, s)
    shares = {str(k): float((keys == k).mean()) for k in np.unique(keys)}
    looked_at = looks_at_halting_node(rule, depth)
    per_root = np.nanmean(data.be[rows, trees, columns], axis=1)  # (N,) Ē_i
    # the stream's ms per token split by tree, Σ_tree T(tree) · w_tree: over position roots Σ_i T̄_i / Ē_i (T̄_i the
    # mean over the root's trees), each episode weighing 1 / (N s Ē_i); over step roots Σ_i T̄_i / Σ_i Ē_i, each
    # weighing 1 / (N s mean Ē)
    be = block_efficiency(per_root, data.per_step)
    if data.per_step:
        weight = np.full((len(per_root), 1), 1.0 / (be * columns.size))
    else:
        weight = (1.0 / per_root)[:, None] / columns.size  # (N, 1)
    inverse_be = {str(k): float((weight * (keys == k)).sum()) for k in shares}
    looked_inverse = float((weight * looked_at).sum())
    return RuleProfile(be, shares, float(looked_at.mean()), length_quantiles(data.lengths), min_gain, inverse_be,
                       looked_inverse)


def static_best(data: EpisodeData) -> int:
    """The action with the highest stream throughput over every episode (labelled everywhere)."""
    # a static action: its root's Ê is the mean over trees
    return best_static(data.be.mean(axis=1), data.step, data.per_step)


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
