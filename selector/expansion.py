"""Expansion decided while drafting, measured offline: per-node rules and a learned per-node model, cross-fitted.

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

Each union tree of the data set is one drafting episode: its trunk is a real draw of the draft, so the action a rule
picks on it is scored with that tree's own exact Ê[τ+1] (the per-tree labels of schema 2) and the latency model's
T̂. Rule parameters, the static action and the learned head are fitted on the other folds of prompts and scored on
the held-out fold (cross-fitted by prompt); the scored trees never influence the choice made on them. Figures are
stream throughputs (data_gen/throughput.py): per root, Ê and T̂ are averaged over its trees (the episodes a step at
that position could draw), and the roots are combined as N / Σ T̂/Ê; as ratios to the best static action.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data_gen.throughput import best_static, time_per_token
from decode.drafting.actions import Action
from decode.policies.guard import RuleProfile, StaticProfile, harmonic_mean, length_quantiles
from decode.policies.halting import HaltingRule as Rule  # the rule the decoder runs
from decode.policies.halting import halting_depth


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

    def take(self, rows: np.ndarray) -> EpisodeData:
        return EpisodeData(self.be[rows], self.step[rows], self.prompts[rows], self.top[rows], self.entropy[rows],
                           self.beta[rows], self.features[rows], self.trunk_pass_ms[rows], self.actions,
                           None if self.lengths is None else self.lengths[rows])


class _Index:
    """Column of each (K, L1, L2) in the data set's action list, by canonical tree."""

    def __init__(self, actions: list[Action]) -> None:
        self.column = {a.canonical(): i for i, a in enumerate(actions)}

    def __call__(self, k: int, l1: int, l2: int) -> int:
        return self.column[Action(k, l1, l2).canonical()]


def rule_throughput(data: EpisodeData, signal: np.ndarray, rule: Rule, index: _Index) -> tuple[float, float]:
    """(roots, Σ ms per token) of a rule over every episode (:func:`_episode_sums`)."""
    terms, _ = rule_terms(data, signal, rule, index)
    return float(len(terms)), float(terms.sum())


def rule_terms(data: EpisodeData, signal: np.ndarray, rule: Rule, index: _Index) -> tuple[np.ndarray, np.ndarray]:
    """(``(N,)`` each root's ms per token under ``rule``, ``(N, s)`` the action column each episode drafts): each
    root's Ê and T̂ averaged over its trees, as :func:`_episode_sums` combines them."""
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


def _episode_sums(be: np.ndarray, step: np.ndarray) -> tuple[float, float]:
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
        roots, time = _episode_sums(data.be[rows, trees, columns], rule_step_ms(data, rule, depth, columns))
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


def evaluate_expansion(data: EpisodeData, l_max: int, k_max: int, folds: int = 5,
                       root_choice: np.ndarray | None = None, extra: dict[str, np.ndarray] | None = None,
                       groups: np.ndarray | None = None) -> dict:
    """Cross-fitted stream-throughput ratios to the best static action of: the rules on ``top``, ``entropy``,
    ``learned`` β̂, exact ``beta`` and each of ``extra`` (``(N, s, D)`` signals computed without these roots'
    labels, e.g. by an acceptance model trained on other prompts: only their rules are fitted per fold), a root-time
    choice (``root_choice``, ``(N,)`` action indices, if given; -1 leaves a root out, and ``root_time`` is then the
    ratio to the static action on the roots left in, counted in ``root_time_roots``) and the per-tree oracle
    (hindsight, for scale). Also the correlation of each signal with β on the scored nodes, each rule's share of
    episodes that draft another tree than the fold's static one (``leaves_static``), and with ``groups`` (``(N,)`` a
    label per root, e.g. its prompt's category) every ratio per group (``by_group``: each group's roots scored by the
    rules fitted on the other folds, against the same static)."""
    tally = _Tally(data.actions)
    for test_rows in folds_by_prompt(data.prompts, folds):
        _score_fold(data, test_rows, l_max, k_max, tally, root_choice, extra,
                    None if groups is None else groups[test_rows])
    return tally.report(groups is not None)


class _Tally:
    """What :func:`evaluate_expansion` adds up over its folds."""

    def __init__(self, actions: list[Action]) -> None:
        self.index = _Index(actions)
        self.canonical = np.array([a.canonical().key for a in actions], dtype=object)
        self.totals: dict[str, list[float]] = {}
        self.by_group: dict[str, dict[str, list[float]]] = {}
        self.leaves: dict[str, list[float]] = {}
        self.signals: dict[str, list[np.ndarray]] = {}
        self.rules: dict[str, list[str]] = {}

    def report(self, grouped: bool) -> dict:
        static_tp = self.totals["static"][0] / self.totals["static"][1]
        root_time = {name: self.totals.pop(name) for name in ("root_time", "root_time_static") if name in self.totals}
        out = {name: (be / step) / static_tp for name, (be, step) in self.totals.items()}
        if root_time:
            own, static_sums = root_time["root_time"], root_time["root_time_static"]
            out["root_time"] = (own[0] / own[1]) / (static_sums[0] / static_sums[1]) if own[1] > 0 else float("nan")
            out["root_time_roots"] = int(own[0])  # the first of each pair of sums counts roots
        beta_true = np.concatenate([b.reshape(-1) for b in self.signals.pop("beta_true")])
        out["corr_with_beta"] = {name: float(np.corrcoef(np.concatenate([s.reshape(-1) for s in parts]),
                                                         beta_true)[0, 1])
                                 for name, parts in self.signals.items() if name not in ("beta", "entropy")}
        out["rules"] = self.rules
        out["leaves_static"] = {name: left / episodes for name, (left, episodes) in self.leaves.items()}
        if grouped:
            out["by_group"] = {group: {name: (n / t) / (sums["static"][0] / sums["static"][1])
                                       for name, (n, t) in sums.items() if name != "static"}
                               | {"roots": sums["static"][0]} for group, sums in sorted(self.by_group.items())}
        return out


def _score_fold(data: EpisodeData, test_rows: np.ndarray, l_max: int, k_max: int, tally: _Tally,
                root_choice: np.ndarray | None, extra: dict[str, np.ndarray] | None, groups: np.ndarray | None
                ) -> None:
    """Fit every signal's rule and the static action on the other folds; add their scores on ``test_rows``."""
    train_rows = np.setdiff1d(np.arange(len(data.be)), test_rows)
    train, test = data.take(train_rows), data.take(test_rows)
    static = static_best(train)
    _add(tally.totals, "static", _static_sums(test, static))
    _add_groups(tally.by_group, groups, "static", time_per_token(np.nanmean(test.be[:, :, static], axis=1),
                                                                 test.step[:, static]))
    signals = {
        "top": (train.top, test.top),
        "entropy": (-train.entropy, -test.entropy),
        "learned": (out_of_fold_beta(train), predict_beta(fit_beta_head(train), test)),
        "beta": (train.beta, test.beta),
        **{name: (values[train_rows], values[test_rows]) for name, values in (extra or {}).items()},
    }
    for name, (fit_on, score_on) in signals.items():
        rule = best_rule(train, fit_on, candidate_rules(fit_on, l_max, k_max), tally.index)
        terms, columns = rule_terms(test, score_on, rule, tally.index)
        tally.rules.setdefault(name, []).append(rule.describe())
        _add(tally.totals, name, (float(len(terms)), float(terms.sum())))
        _add_groups(tally.by_group, groups, name, terms)
        left = tally.canonical[columns] != tally.canonical[static]
        _add(tally.leaves, name, (float(left.sum()), float(columns.size)))
        tally.signals.setdefault(name, []).append(score_on)
    if root_choice is not None:
        scored = np.flatnonzero(root_choice[test_rows] >= 0)
        _add(tally.totals, "root_time", _root_sums(test.take(scored), root_choice[test_rows][scored]))
        _add(tally.totals, "root_time_static", _static_sums(test.take(scored), static))
    _add(tally.totals, "oracle", _oracle_sums(test))
    tally.signals.setdefault("beta_true", []).append(test.beta)


def _add_groups(by_group: dict, groups: np.ndarray | None, name: str, terms: np.ndarray) -> None:
    """Add each group's (roots, Σ ms per token) of ``terms`` ``(N,)`` under ``name``."""
    if groups is None:
        return
    for group in np.unique(groups):
        mask = groups == group
        _add(by_group.setdefault(str(group), {}), name, (float(mask.sum()), float(terms[mask].sum())))


def signal_ratios(data: EpisodeData, signals: dict[str, np.ndarray], l_max: int, k_max: int,
                  folds: int = 5) -> dict[str, float]:
    """Cross-fitted ratio to the best static action of the best threshold rule on each node signal ``(N, s, D)``
    (higher: the draft is surer), fitted and scored as in :func:`evaluate_expansion`: a signal computed elsewhere
    (bench/node_signals.py recomputes laws from the stored hidden states) is compared on the same footing."""
    index = _Index(data.actions)
    totals: dict[str, list[float]] = {}
    for test_rows in folds_by_prompt(data.prompts, folds):
        train_rows = np.setdiff1d(np.arange(len(data.be)), test_rows)
        train, test = data.take(train_rows), data.take(test_rows)
        _add(totals, "static", _static_sums(test, static_best(train)))
        for name, values in signals.items():
            _add(totals, name, _fold_rule(train, test, values[train_rows], values[test_rows], l_max, k_max, index)[1])
    static_tp = totals["static"][0] / totals["static"][1]
    return {name: (roots / time) / static_tp for name, (roots, time) in totals.items() if name != "static"}


def _fold_rule(train: EpisodeData, test: EpisodeData, fit_on: np.ndarray, score_on: np.ndarray, l_max: int,
               k_max: int, index: _Index) -> tuple[Rule, tuple[float, float]]:
    """The best rule on ``train``'s signal ``fit_on`` and its sums (:func:`_episode_sums`) on ``test``'s
    ``score_on``."""
    rule = best_rule(train, fit_on, candidate_rules(fit_on, l_max, k_max), index)
    return rule, rule_throughput(test, score_on, rule, index)


def _add(totals: dict, name: str, sums: tuple[float, float]) -> None:
    be, step = totals.get(name, [0.0, 0.0])
    totals[name] = [be + sums[0], step + sums[1]]


def _static_sums(data: EpisodeData, action: int) -> tuple[float, float]:
    return _episode_sums(data.be[:, :, action], data.step[:, action, None])


def _root_sums(data: EpisodeData, chosen: np.ndarray) -> tuple[float, float]:
    rows = np.arange(len(chosen))
    be = data.be[rows, :, chosen]  # (N, s)
    return _episode_sums(be, data.step[rows, chosen][:, None])


def _oracle_sums(data: EpisodeData) -> tuple[float, float]:
    ratio = np.where(np.isfinite(data.be), data.be / data.step[:, None, :], -np.inf)
    chosen = ratio.argmax(axis=-1)  # (N, s): hindsight, per tree
    rows, trees = np.indices(chosen.shape)
    return _episode_sums(data.be[rows, trees, chosen], data.step[rows, chosen])


# ---------------------------------------------------------------------------------------------------- loading


def load_episodes(folder, verifier: str) -> tuple[dict, dict[int, EpisodeData], dict[int, np.ndarray]]:
    """(metadata, episodes per sampling index, root-row indices per sampling index) of a schema-2 data set with
    trunk states; ValueError for one without them."""
    from data_gen.schema import TRUNK_COLUMNS, TRUNK_STATE_COLUMNS, trees_column
    from data_gen.store import read_metadata
    from decode.policies.features import SCALAR_NAMES
    from selector.data import _list_column

    metadata = read_metadata(folder)
    if verifier not in metadata.get("verifiers", []):
        raise ValueError(f"verifier '{verifier}': this data set has labels for {', '.join(metadata['verifiers'])}")
    table = _read_table(folder, ["prompt_id", "sampling_index", "scalars", "step_ms", trees_column(verifier),
                                 TRUNK_COLUMNS[1], *TRUNK_STATE_COLUMNS])
    n, s_trees = table.num_rows, int(metadata["trees_per_root"])
    depth, actions = metadata["l_max"] + 1, [Action.parse(a) for a in metadata["actions"]]
    hidden_size = int(metadata["hidden_sizes"]["draft_hidden_root"])
    be = _list_column(table, trees_column(verifier)).reshape(n, s_trees, len(actions)).astype(np.float64)
    step = _list_column(table, "step_ms").astype(np.float64)
    beta = _list_column(table, TRUNK_COLUMNS[1]).reshape(n, s_trees, -1)[:, :, :depth].astype(np.float64)
    hidden = _list_column(table, TRUNK_STATE_COLUMNS[0]).reshape(n, s_trees, depth, hidden_size)
    entropy = _list_column(table, TRUNK_STATE_COLUMNS[1]).reshape(n, s_trees, depth).astype(np.float64)
    top = _list_column(table, TRUNK_STATE_COLUMNS[2]).reshape(n, s_trees, depth).astype(np.float64)
    raw_scalars = _list_column(table, "scalars")
    trunk_pass_ms = raw_scalars[:, SCALAR_NAMES.index("draft_ms")].astype(np.float64)
    lengths = raw_scalars[:, SCALAR_NAMES.index("context_length")].astype(np.int64)
    scalars = acceptance_scalars(raw_scalars)
    depth_feature = np.broadcast_to(np.arange(depth, dtype=np.float32)[None, None, :, None], (n, s_trees, depth, 1))
    root = np.broadcast_to(scalars[:, None, None, :], (n, s_trees, depth, scalars.shape[1]))
    features = np.concatenate([hidden, entropy[..., None].astype(np.float32), top[..., None].astype(np.float32),
                               depth_feature, root], axis=-1)
    prompts = np.asarray(table.column("prompt_id").to_pylist(), dtype=object)
    sampling = table.column("sampling_index").to_numpy()
    episodes, rows_by_config = {}, {}
    for c in np.unique(sampling):
        rows = np.flatnonzero(sampling == c)
        rows_by_config[int(c)] = rows
        episodes[int(c)] = EpisodeData(be[rows], step[rows], prompts[rows], top[rows], entropy[rows], beta[rows],
                                       features[rows], trunk_pass_ms[rows], actions, lengths[rows])
    return metadata, episodes, rows_by_config


PASS_TIME_SCALARS = ("draft_ms", "target_ms")  # the machine's speed, not the text's: no acceptance head reads them


def acceptance_scalars(scalars: np.ndarray) -> np.ndarray:
    """``(N, S)`` root scalars as the acceptance head sees them: the pass times zeroed. β depends on the two models
    and the text, not on how fast this machine ran; a head fitted on them shifts when decoding runs on a slower or
    faster machine than the collection did (a zero column gets a zero weight, so the decoder's values never count)."""
    from decode.policies.features import SCALAR_NAMES

    out = np.array(scalars, dtype=np.float32, copy=True)
    out[:, [SCALAR_NAMES.index(name) for name in PASS_TIME_SCALARS]] = 0.0
    return out


def _read_table(folder, columns: list[str]):
    """The columns of every shard, in shard order (the row order every reader here shares)."""
    from data_gen.store import list_shards, read_shards, shard_columns

    shards = list_shards(folder)
    names = set(shard_columns(shards[0])) if shards else set()
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{folder}: no {', '.join(missing)} (a schema-2 collection with trunk states is needed, "
                         "with labels for this verifier)")
    return read_shards(shards, columns)


def checked_root_selector(path, metadata: dict, verifier: str):
    """``(onnxruntime session, SelectorMetadata)`` of an exported selector, checked as the decoder checks it
    (decode/policies/selector.py): against the data set's ``metadata`` (its pair fingerprint and hidden sizes) and
    ``verifier``, which must be one the data set has labels for. ValueError (in one line) otherwise."""
    from decode.policies.onnx_session import policy_session
    from decode.policies.selector_file import SelectorMetadata

    if verifier not in metadata.get("verifiers", []):
        raise ValueError(f"--selector {verifier}={path}: this data set has labels for "
                         f"{', '.join(metadata.get('verifiers', []))}")
    session = policy_session(path, "selector")
    meta = SelectorMetadata.from_props(dict(session.get_modelmeta().custom_metadata_map), str(path))
    meta.check_compatible(str(path), verifier, metadata["hidden_sizes"],
                          metadata.get("pair", {}).get("fingerprint"))
    return session, meta


def selector_root_choices(path, folder, verifier: str) -> np.ndarray:
    """``(N,)`` the action an exported selector (with its never-lose guard) picks at every root of a data set (the
    rows of :func:`load_episodes`), on the latency model's T̂ (no online calibration offline); -1 at the roots of
    the prompts it was fitted on (its ``fit_prompts``), which an honest score must leave out."""
    from data_gen.schema import label_column
    from data_gen.store import read_metadata
    from decode.policies.features import HIDDEN_NAMES
    from selector.data import _list_column
    from selector.guard import decision_values, guarded_choice

    collected = read_metadata(folder)
    session, meta = checked_root_selector(path, collected, verifier)
    sampling = collected["sampling"]
    table = _read_table(folder, [*HIDDEN_NAMES, "scalars", "step_ms", "sampling_index", "prompt_id",
                                 label_column(verifier)])
    feeds = {name: _list_column(table, name) for name in (*HIDDEN_NAMES, "scalars")}
    step, be = _list_column(table, "step_ms"), _list_column(table, label_column(verifier))
    values = decision_values(session.run(None, feeds)[0], step, np.isfinite(be), meta.decision)
    config = table.column("sampling_index").to_numpy()
    chosen = np.zeros(table.num_rows, dtype=np.int64)
    for c, conf in enumerate(sampling):
        rows = config == c
        guard = meta.fallback_for(conf["temperature"], conf["top_p"])
        fallback = np.full(int(rows.sum()), meta.actions.index(guard.action))
        chosen[rows] = guarded_choice(values[rows], fallback, guard.margin)
    seen = np.isin(np.asarray(table.column("prompt_id").to_pylist(), dtype=str), list(meta.fit_prompts))
    chosen[seen] = -1
    return chosen
