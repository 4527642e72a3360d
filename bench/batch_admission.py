"""Offline: what deciding a batch's trees node by node could gain over each request's best static tree.

``ddte serve --max-batch N`` decodes R requests per step: one draft pass per level over every growing trunk, one
target pass over every tree (decode/batch.py). This study asks, before building it, what issue 62's shared budget
could gain with a per-node policy: at every drafting level, the growing trunks' next tokens are admitted across the
batch, best expected gain first, while the batch's expected tokens per ms rise (the marginal rule of
decode/policies/halting.py, priced on the whole batch's passes, decode/cost/pricing.py ``passes_ms``). A trunk
that is admitted draws its next token; unless it is at the cap, the draft then runs that token, so the next level
can decide on its law (a node's signal reads the law it draws from, never the token drawn).

Batches of R roots are drawn from an expander file's fit set (decode/policies/fit/machine_fit.py: Ê[τ+1] of every tree
at every root, exact in the target, and the draft's signals at every trunk depth) and priced on this machine's latency
table with its batch ratios. Everything is cross-fitted by prompt folds: the static tree (every tree of the file's
grid, the same for every request) and each signal's calibration (β̂ of a node from its signal: Σ P_{d+1} / Σ P_d over
training nodes in its quantile bin, P_d the chance a chain's first d tokens are accepted, from the chains' labels)
are fitted on the other folds' prompts and scored on the fold's. ``beta`` reads the target's exact β at each node: an
oracle ceiling for any acceptance model under this admission rule, not a policy. Each admission policy runs twice:
stopping at its halting depth (``chain``) and drafting K = 2 leaves there (``branch``, the shipped expanders' terminal).

Beside them, decisions made at the root with no draft pass looking ahead (:func:`at_root`): each request's chain
admitted a token at a time by P̂ (β̂ of the root's signal, then each deeper depth's mean on the training folds); one
chain length for the whole batch (``one chain``, the shared budget's rule, decode/policies/budget.py); and the oracle
that knows every depth's exact P at the root.

Run: ``python -m bench.batch_admission --expander models/expanders/qwen-coder-traversal.onnx``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decode.cost.pricing import passes_ms, step_ms
from decode.cost.table import BatchCost, LatencyTable
from decode.drafting.actions import Action
from decode.policies.files.expander_file import ExpanderFileError, read_expander_metadata
from decode.policies.fit.machine_fit import FitSet
from decode.policies.fit.rule_fit import folds_by_prompt

SIGNALS = ("entropy", "top")  # calibrated into β̂ on the training folds
BINS = 12
BRANCH = 2  # leaves drafted at the halting depth in the ``branch`` variant


@dataclass(frozen=True)
class Episodes:
    """One sampling configuration's roots: ``be (N, s, A)`` per tree, ``survival (N, s, D + 1)`` P_d of the chain
    (P_0 = 1), ``signals`` name → ``(N, s, D + 1)``, ``lengths``/``prompts`` ``(N,)``."""

    actions: list[Action]
    be: np.ndarray
    survival: np.ndarray
    signals: dict[str, np.ndarray]
    lengths: np.ndarray
    prompts: np.ndarray
    cap: int

    @classmethod
    def from_fit_set(cls, fit_set: FitSet) -> Episodes:
        actions = [Action.parse(a).canonical() for a in fit_set.actions]
        chain = [actions.index(Action(1, d, 0)) for d in range(fit_set.l_max + 1)]
        be = np.nan_to_num(fit_set.be)
        chains = be[:, :, chain]
        survival = np.clip(np.concatenate([np.ones_like(chains[..., :1]), np.diff(chains, axis=-1)], axis=-1), 0, 1)
        return cls(actions, be, survival, fit_set.signals, fit_set.lengths, fit_set.prompts, fit_set.l_max)

    def tree_be(self, root: int, sample: int, action: Action) -> float:
        return float(self.be[root, sample, self.actions.index(action.canonical())])


def calibration(signal: np.ndarray, survival: np.ndarray, bins: int = BINS):
    """β̂ as a function of a node's signal: the ratio estimator Σ P_{d+1} / Σ P_d in the signal's quantile bin, fitted
    on ``signal`` and ``survival`` ``(n, s, D + 1)`` (depths 0..D − 1 decide)."""
    x, reach, start = signal[..., :-1].ravel(), survival[..., 1:].ravel(), survival[..., :-1].ravel()
    edges = np.quantile(x, np.linspace(0, 1, bins + 1)[1:-1])
    which = np.digitize(x, edges)
    beta = np.array([reach[which == b].sum() / max(start[which == b].sum(), 1e-12) for b in range(bins)])
    return lambda value: float(beta[np.digitize(value, edges)])


def static_step(action: Action, requests: int, length: float, table: LatencyTable) -> float:
    """T of a batch step in which every request drafts ``action``."""
    return step_ms([], length, table, [action] * requests)


def admitted(episodes: Episodes, batch: list[tuple[int, int]], length: float, table: LatencyTable,
             beta_at: Callable[[int, int], float], branch: bool) -> tuple[float, float]:
    """(Ê tokens, T ms) of one batch step decided node by node: at each level every growing trunk's next token has
    gain P̂ β̂ (``beta_at(request, depth)``); the admitted set is the prefix of the gains' order with the highest
    expected tokens per ms (the draft pass it then needs included), empty when none raises the rate. ``branch``: each
    request drafts K = 2 leaves at its halting depth (the decisions still price the chain's tokens only)."""
    requests, cap = len(batch), episodes.cap
    leaves = BRANCH if branch else 0
    depth, reach, growing, level_rows = [0] * requests, [1.0] * requests, list(range(requests)), []
    expected = float(requests)

    def cost(depths: list[int], rows: list[int]) -> float:
        return passes_ms(requests, rows, sum(1 + d + leaves for d in depths), length, table)

    for level in range(cap):
        if not growing:
            break
        gains = {r: reach[r] * beta_at(r, level) for r in growing}
        order = sorted(growing, key=gains.get, reverse=True)
        best, best_rate = 0, expected / cost(depth, level_rows)
        for k in range(1, len(order) + 1):
            deeper = [d + (r in order[:k]) for r, d in enumerate(depth)]
            ahead = [k] if level + 1 < cap or branch else []  # the law at the new depth: to decide, or to branch
            rate = (expected + sum(gains[r] for r in order[:k])) / cost(deeper, level_rows + ahead)
            if rate > best_rate:
                best, best_rate = k, rate
        growing = order[:best]
        for r in growing:
            depth[r], reach[r] = depth[r] + 1, gains[r]
            expected += gains[r]
        if growing and (level + 1 < cap or branch):
            level_rows.append(len(growing))
    terminal = [Action(BRANCH, d, 1) if branch else Action(1, d, 0) for d in depth]
    tokens = sum(episodes.tree_be(root, sample, action) for (root, sample), action in zip(batch, terminal, strict=True))
    return tokens, cost(depth, level_rows)


def at_root(episodes: Episodes, batch: list[tuple[int, int]], length: float, table: LatencyTable,
            reach: np.ndarray, common: bool = False) -> tuple[float, float]:
    """(Ê tokens, T ms) of one batch step whose chains are all decided at the root, each priced as the shared budget
    prices them (decode/cost/pricing.py ``step_ms``: no draft pass looks ahead, a chain of L runs L − 1 draft
    levels): tokens are admitted one at a time to the request whose next one has the highest ``reach`` ``(R, D + 1)``
    (P̂_d, the chance its first d tokens are accepted), the admission order's prefix with the most expected tokens per
    ms kept. ``common``: one length for every request (the shared budget's rule), the one with the most expected
    tokens per ms."""
    requests, cap = len(batch), episodes.cap

    def cost(depths: list[int]) -> float:
        return step_ms(depths, length, table)

    depth, expected = [0] * requests, float(requests)
    best, best_rate = list(depth), expected / cost(depth)
    while common and depth[0] < cap:
        depth = [d + 1 for d in depth]
        expected += float(reach[:, depth[0]].sum())
        if expected / cost(depth) > best_rate:
            best, best_rate = list(depth), expected / cost(depth)
    while not common:
        open_ = [r for r in range(requests) if depth[r] < cap]
        if not open_:
            break
        r = max(open_, key=lambda i: reach[i, depth[i] + 1])
        depth[r] += 1
        expected += reach[r, depth[r]]
        rate = expected / cost(depth)
        if rate > best_rate:
            best, best_rate = list(depth), rate
    tokens = sum(episodes.tree_be(i, s, Action(1, d, 0)) for (i, s), d in zip(batch, best, strict=True))
    return tokens, cost(best)


def study(episodes: Episodes, table: LatencyTable, sizes: list[int], batches: int, folds: int,
          seed: int) -> list[dict]:
    """Per batch size: tokens/s of the cross-fitted best static tree and of each admission policy (and the exact-β
    ceiling) over the same random batches of held-out roots, with their ratios to the static tree's."""
    rng = np.random.default_rng(seed)
    groups = folds_by_prompt(episodes.prompts, folds)
    samples = episodes.be.shape[1]
    statics = [a for a in episodes.actions if a.l2 <= 1]
    rows = []
    for size in sizes:
        totals: dict[str, list[float]] = {}
        chosen: dict[str, int] = {}
        for test in groups:
            train = np.setdiff1d(np.arange(len(episodes.lengths)), test)
            static = max(statics, key=lambda a: _static_rate(episodes, train, a, size, table))
            chosen[static.key] = chosen.get(static.key, 0) + 1
            betas = {name: calibration(episodes.signals[name][train], episodes.survival[train])
                     for name in SIGNALS if name in episodes.signals}
            trained = episodes.survival[train]
            depth_beta = trained[..., 1:].sum(axis=(0, 1)) / np.maximum(trained[..., :-1].sum(axis=(0, 1)), 1e-12)
            for _ in range(batches):
                batch = [(int(rng.choice(test)), int(rng.integers(samples))) for _ in range(size)]
                length = float(np.mean([episodes.lengths[i] for i, _ in batch]))
                _add(totals, "static", sum(episodes.tree_be(i, s, static) for i, s in batch),
                     static_step(static, size, length, table))
                readers = {name: _calibrated(episodes.signals[name], batch, beta) for name, beta in betas.items()}
                readers["beta (oracle)"] = _exact(episodes, batch)
                for name, read in readers.items():
                    for branch in (False, True):
                        _add(totals, f"{name}, {'branch' if branch else 'chain'}",
                             *admitted(episodes, batch, length, table, read, branch))
                for name, beta in betas.items():  # the root's signal, then each depth's mean β̂ on the training set
                    first = np.array([beta(episodes.signals[name][i, s, 0]) for i, s in batch])
                    reach = np.cumprod(np.concatenate([np.ones((size, 1)), first[:, None], np.tile(
                        depth_beta[1:], (size, 1))], axis=1), axis=1)[:, :episodes.cap + 1]
                    _add(totals, f"{name} at the root", *at_root(episodes, batch, length, table, reach))
                    _add(totals, f"{name}, one chain at the root", *at_root(episodes, batch, length, table, reach,
                                                                              common=True))
                exact = np.stack([episodes.survival[i, s] for i, s in batch])
                _add(totals, "beta at the root (oracle)", *at_root(episodes, batch, length, table, exact))
        base = totals["static"][0] / totals["static"][1]
        rows.append({"requests": size, "static": chosen,
                     "policies": {name: {"tokens_per_s": 1000 * t / ms, "ratio": t / ms / base}
                                  for name, (t, ms) in totals.items()}})
    return rows


def _static_rate(episodes: Episodes, rows: np.ndarray, action: Action, size: int, table: LatencyTable) -> float:
    """Tokens per ms of ``action`` for every request of a batch of ``size``, over the roots ``rows`` (each root's
    step priced at its own context length)."""
    column = episodes.actions.index(action)
    tokens = episodes.be[rows][:, :, column].mean(axis=1)
    ms = np.array([static_step(action, size, float(episodes.lengths[i]), table) for i in rows]) / size
    return float(tokens.sum() / ms.sum())


def _calibrated(signal: np.ndarray, batch: list[tuple[int, int]], beta: Callable[[float], float]):
    return lambda r, d: beta(signal[batch[r][0], batch[r][1], d])


def _exact(episodes: Episodes, batch: list[tuple[int, int]]):
    """The oracle: β at depth d from the target's labels (P_{d+1} / P_d)."""
    def read(r: int, d: int) -> float:
        p = episodes.survival[batch[r][0], batch[r][1]]
        return float(p[d + 1] / p[d]) if p[d] > 0 else 0.0
    return read


def _add(totals: dict[str, list[float]], name: str, tokens: float, ms: float) -> None:
    total = totals.setdefault(name, [0.0, 0.0])
    total[0] += tokens
    total[1] += ms


def pair_table(fingerprint: str, cache: Path) -> tuple[LatencyTable, Path]:
    """The newest latency table of this pair in ``cache``, with its batch costs where they were measured."""
    found = []
    for path in sorted(cache.glob("*.json")):
        if path.name.startswith(("batch-", "kernels-")):
            continue
        try:
            table = LatencyTable.from_json(path.read_text())
        except ValueError:
            continue
        if table.pair == fingerprint:
            found.append((path.stat().st_mtime, path, table))
    if not found:
        raise FileNotFoundError(f"no latency table of this pair in {cache}: run `ddte bench` or `ddte serve` with "
                                "the pair once on this machine, or pass --table")
    _, path, table = max(found, key=lambda item: item[0])
    batch = path.with_name(f"batch-{path.name}")
    if batch.is_file():
        table.batch = BatchCost.from_json(batch.read_text())
    return table, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_admission", description=__doc__.split("\n\n")[0])
    parser.add_argument("--expander", required=True, help="an expander file whose fit sets hold the episodes")
    parser.add_argument("--table", type=Path, help="a latency table (default: the newest of the expander's pair in "
                        "the machine cache, with its batch costs)")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8], help="batch sizes")
    parser.add_argument("--batches", type=int, default=200, help="random batches per fold and size")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the figures as JSON")
    args = parser.parse_args(argv)
    from ddte_core.paths import latency_cache

    try:
        metadata = read_expander_metadata(args.expander)
        if not metadata.fit_sets:
            raise ValueError(f"{args.expander} carries no fit sets (exported before they were stored)")
        if args.table is not None:
            table, where = LatencyTable.from_json(args.table.read_text()), args.table
        else:
            table, where = pair_table(metadata.pair_fingerprint, latency_cache())
    except (ExpanderFileError, OSError, ValueError) as err:
        print(f"batch_admission: {err}", file=sys.stderr)
        return 2
    print(f"machine: {table.machine or '(not recorded)'}; table {where}; batch costs "
          f"{'measured' if table.batch else 'none (a one-sequence pass per pass)'}")
    report = []
    for index, rule in enumerate(metadata.rules):
        episodes = Episodes.from_fit_set(FitSet.from_dict(metadata.fit_sets[index]))
        rows = study(episodes, table, args.requests, args.batches, args.folds, args.seed)
        print(f"\n{metadata.verifier} T={rule.temperature:g}: tokens/s over the cross-fitted best static tree "
              f"({len(episodes.lengths)} roots, {args.batches} batches per fold)")
        names = list(rows[0]["policies"])
        print("| requests | static tree | " + " | ".join(names) + " |")
        print("|---:|---|" + "---:|" * len(names))
        for row in rows:
            statics = ", ".join(f"{k} ×{n}" for k, n in row["static"].items())
            cells = [f"{row['policies'][n]['tokens_per_s']:.1f}" if n == "static" else
                     f"{row['policies'][n]['ratio']:.3f}×" for n in names]
            print(f"| {row['requests']} | {statics} | " + " | ".join(cells) + " |")
        report.append({"verifier": metadata.verifier, "temperature": rule.temperature, "rows": rows})
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"machine": table.machine, "table": str(where), "configs": report},
                                          indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
