"""Expansion decided while drafting, measured offline: per-node rules and a learned per-node model, cross-fitted.

The rules, their signals and their fitting are selector/expander/expansion_fit.py's; this module reads the episodes of a
data set and scores the rules on them.

Each union tree of the data set is one drafting episode: its trunk is a real draw of the draft, so the action a rule
picks on it is scored with that tree's own exact Ê[τ+1] (the per-tree labels of schema 2) and the latency model's
T̂. Rule parameters, the static action and the learned head are fitted on the other folds of prompts and scored on
the held-out fold (cross-fitted by prompt); the scored trees never influence the choice made on them. Figures are
stream throughputs (decode/cost/throughput.py): per root, Ê and T̂ are averaged over its trees (the episodes a step
at that position could draw), and the roots are combined as N / Σ T̂/Ê; as ratios to the best static action.
"""

from __future__ import annotations

import numpy as np

from decode.cost.throughput import per_root_best, stream_terms
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.fit.machine_fit import cross_fitted_ratios
from selector.expander.expansion_fit import (
    EpisodeData,
    _Index,
    best_rule,
    candidate_rules,
    episode_sums,
    fit_beta_head,
    folds_by_prompt,
    out_of_fold_beta,
    predict_beta,
    rule_terms,
    static_best,
)


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
        self.root_time_roots = 0  # roots a root-time choice was scored on
        self.group_roots: dict[str, int] = {}

    def report(self, grouped: bool) -> dict:
        static_tp = self.totals["static"][0] / self.totals["static"][1]
        root_time = {name: self.totals.pop(name) for name in ("root_time", "root_time_static") if name in self.totals}
        out = {name: (be / step) / static_tp for name, (be, step) in self.totals.items()}
        if root_time:
            own, static_sums = root_time["root_time"], root_time["root_time_static"]
            out["root_time"] = (own[0] / own[1]) / (static_sums[0] / static_sums[1]) if own[1] > 0 else float("nan")
            out["root_time_roots"] = self.root_time_roots
        beta_true = np.concatenate([b.reshape(-1) for b in self.signals.pop("beta_true")])
        out["corr_with_beta"] = {name: float(np.corrcoef(np.concatenate([s.reshape(-1) for s in parts]),
                                                         beta_true)[0, 1])
                                 for name, parts in self.signals.items() if name not in ("beta", "entropy")}
        out["rules"] = self.rules
        out["leaves_static"] = {name: left / episodes for name, (left, episodes) in self.leaves.items()}
        if grouped:
            out["by_group"] = {group: {name: (n / t) / (sums["static"][0] / sums["static"][1])
                                       for name, (n, t) in sums.items() if name != "static"}
                               | {"roots": self.group_roots[group]} for group, sums in sorted(self.by_group.items())}
        return out


def _score_fold(data: EpisodeData, test_rows: np.ndarray, l_max: int, k_max: int, tally: _Tally,
                root_choice: np.ndarray | None, extra: dict[str, np.ndarray] | None, groups: np.ndarray | None
                ) -> None:
    """Fit every signal's rule and the static action on the other folds; add their scores on ``test_rows``."""
    train_rows = np.setdiff1d(np.arange(len(data.be)), test_rows)
    train, test = data.take(train_rows), data.take(test_rows)
    static = static_best(train)
    _add(tally.totals, "static", _static_sums(test, static))
    _add_groups(tally.by_group, groups, "static", stream_terms(np.nanmean(test.be[:, :, static], axis=1),
                                                               test.step[:, static], test.per_step))
    if groups is not None:
        for group, count in zip(*np.unique(groups, return_counts=True), strict=True):
            tally.group_roots[str(group)] = tally.group_roots.get(str(group), 0) + int(count)
    on_test = test.node_signals()
    signals = {
        **{name: (values, on_test[name]) for name, values in train.node_signals().items()},
        "learned": (out_of_fold_beta(train), predict_beta(fit_beta_head(train), test)),
        "beta": (train.beta, test.beta),
        **{name: (values[train_rows], values[test_rows]) for name, values in (extra or {}).items()},
    }
    for name, (fit_on, score_on) in signals.items():
        rule = best_rule(train, fit_on, candidate_rules(fit_on, l_max, k_max), tally.index)
        terms, columns = rule_terms(test, score_on, rule, tally.index)
        tally.rules.setdefault(name, []).append(rule.describe())
        _add(tally.totals, name, (float(terms[0].sum()), float(terms[1].sum())))
        _add_groups(tally.by_group, groups, name, terms)
        left = tally.canonical[columns] != tally.canonical[static]
        _add(tally.leaves, name, (float(left.sum()), float(columns.size)))
        tally.signals.setdefault(name, []).append(score_on)
    if root_choice is not None:
        scored = np.flatnonzero(root_choice[test_rows] >= 0)
        _add(tally.totals, "root_time", _root_sums(test.take(scored), root_choice[test_rows][scored]))
        tally.root_time_roots += len(scored)
        _add(tally.totals, "root_time_static", _static_sums(test.take(scored), static))
    _add(tally.totals, "oracle", _oracle_sums(test))
    tally.signals.setdefault("beta_true", []).append(test.beta)


def _add_groups(by_group: dict, groups: np.ndarray | None, name: str,
                terms: tuple[np.ndarray, np.ndarray]) -> None:
    """Add each group's (Σ tokens, Σ ms) of ``terms`` (each ``(N,)``) under ``name``."""
    if groups is None:
        return
    tokens, ms = terms
    for group in np.unique(groups):
        mask = groups == group
        _add(by_group.setdefault(str(group), {}), name, (float(tokens[mask].sum()), float(ms[mask].sum())))


def signal_ratios(data: EpisodeData, signals: dict[str, np.ndarray], l_max: int, k_max: int,
                  folds: int = 5) -> dict[str, float]:
    """Cross-fitted ratio to the best static action of the best threshold rule on each node signal ``(N, s, D)``
    (higher: the draft is surer), fitted and scored as in :func:`evaluate_expansion` and as a decoder's refit does
    (decode/policies/fit/machine_fit.py ``cross_fitted_ratios``): a signal computed elsewhere (bench/node_signals.py
    recomputes laws from the stored hidden states) is compared on the same footing."""
    return cross_fitted_ratios(data, signals, l_max, k_max, folds)


def _add(totals: dict, name: str, sums: tuple[float, float]) -> None:
    be, step = totals.get(name, [0.0, 0.0])
    totals[name] = [be + sums[0], step + sums[1]]


def _static_sums(data: EpisodeData, action: int) -> tuple[float, float]:
    return episode_sums(data.be[:, :, action], data.step[:, action, None], data.per_step)


def _root_sums(data: EpisodeData, chosen: np.ndarray) -> tuple[float, float]:
    rows = np.arange(len(chosen))
    be = data.be[rows, :, chosen]  # (N, s)
    return episode_sums(be, data.step[rows, chosen][:, None], data.per_step)


def _oracle_sums(data: EpisodeData) -> tuple[float, float]:
    n, s, a = data.be.shape
    step = np.broadcast_to(data.step[:, None, :], (n, s, a)).reshape(n * s, a)
    chosen = per_root_best(data.be.reshape(n * s, a), step, data.per_step).reshape(n, s)  # hindsight, per tree
    rows, trees = np.indices(chosen.shape)
    return episode_sums(data.be[rows, trees, chosen], data.step[rows, chosen], data.per_step)


# ---------------------------------------------------------------------------------------------------- loading


def load_episodes(folder, verifier: str) -> tuple[dict, dict[int, EpisodeData], dict[int, np.ndarray]]:
    """(metadata, episodes per sampling index, root-row indices per sampling index) of a schema-2 data set with
    trunk states; ValueError for one without them."""
    from data_gen.schema import TRUNK_COLUMNS, TRUNK_DRAW_COLUMNS, TRUNK_STATE_COLUMNS, roots_per_step, trees_column
    from data_gen.store import read_metadata
    from decode.policies.features import SCALAR_NAMES
    from selector.root.root_data import list_column

    metadata = read_metadata(folder)
    if verifier not in metadata.get("verifiers", []):
        raise ValueError(f"verifier '{verifier}': this data set has labels for {', '.join(metadata['verifiers'])}")
    draw_columns = [c for c in TRUNK_DRAW_COLUMNS if c in metadata.get("trunk_columns", [])]  # schema 3 on
    table = _read_table(folder, ["prompt_id", "sampling_index", "scalars", "step_ms", trees_column(verifier),
                                 TRUNK_COLUMNS[1], *TRUNK_STATE_COLUMNS, *draw_columns])
    n, s_trees = table.num_rows, int(metadata["trees_per_root"])
    depth, actions = metadata["l_max"] + 1, [Action.parse(a) for a in metadata["actions"]]
    hidden_size = int(metadata["hidden_sizes"]["draft_hidden_root"])
    be = list_column(table, trees_column(verifier)).reshape(n, s_trees, len(actions)).astype(np.float64)
    step = list_column(table, "step_ms").astype(np.float64)
    beta = list_column(table, TRUNK_COLUMNS[1]).reshape(n, s_trees, -1)[:, :, :depth].astype(np.float64)
    hidden = list_column(table, TRUNK_STATE_COLUMNS[0]).reshape(n, s_trees, depth, hidden_size)
    entropy = list_column(table, TRUNK_STATE_COLUMNS[1]).reshape(n, s_trees, depth).astype(np.float64)
    top = list_column(table, TRUNK_STATE_COLUMNS[2]).reshape(n, s_trees, depth).astype(np.float64)
    draws = [list_column(table, c).reshape(n, s_trees, depth).astype(np.float64) for c in draw_columns] or [None] * 3
    raw_scalars = list_column(table, "scalars")
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
                                       features[rows], trunk_pass_ms[rows], actions, lengths[rows],
                                       *(None if d is None else d[rows] for d in draws),
                                       per_step=roots_per_step(metadata))
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
    from data_gen.store import read_shards, require_shards, shard_columns

    shards = require_shards(folder)
    names = set(shard_columns(shards[0]))
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{folder}: no {', '.join(missing)} (a schema-2 collection with trunk states is needed, "
                         "with labels for this verifier)")
    return read_shards(shards, columns)


def checked_root_selector(path, metadata: dict, verifier: str):
    """``(onnxruntime session, SelectorMetadata)`` of an exported selector, checked as the decoder checks it
    (decode/policies/selector.py): against the data set's ``metadata`` (its pair fingerprint and hidden sizes) and
    ``verifier``, which must be one the data set has labels for. ValueError (in one line) otherwise."""
    from decode.policies.files.selector_file import SelectorMetadata
    from decode.policies.onnx_session import policy_session

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
    from selector.root.guard import decision_values, guarded_choice
    from selector.root.root_data import list_column

    collected = read_metadata(folder)
    session, meta = checked_root_selector(path, collected, verifier)
    sampling = collected["sampling"]
    table = _read_table(folder, [*HIDDEN_NAMES, "scalars", "step_ms", "sampling_index", "prompt_id",
                                 label_column(verifier)])
    feeds = {name: list_column(table, name) for name in (*HIDDEN_NAMES, "scalars")}
    step, be = list_column(table, "step_ms"), list_column(table, label_column(verifier))
    values = decision_values(session.run(None, feeds)[0], step, np.isfinite(be), meta.decision)
    config = table.column("sampling_index").to_numpy()
    chosen = np.zeros(table.num_rows, dtype=np.int64)
    guards = meta.guard_table()
    for c, conf in enumerate(sampling):
        rows = config == c
        guard = guards.nearest(SamplingConfig(conf["temperature"], conf["top_p"]))
        fallback = np.full(int(rows.sum()), meta.actions.index(guard.action))
        chosen[rows] = guarded_choice(values[rows], fallback, guard.margin)
    seen = np.isin(np.asarray(table.column("prompt_id").to_pylist(), dtype=str), list(meta.fit_prompts))
    chosen[seen] = -1
    return chosen
