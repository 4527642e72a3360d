"""The survival model's offline study: which inputs and how much dense data move its held-out loss, and where its
signals stand on the offline ladder beside the entropy rule and the exact-β oracle.

* **Held-out loss** (:func:`loss_rows`): cross-fitted by prompt on the dense set (selector/acceptance/survival.py
  ``heldout_cross_entropy``), the cross-entropy against the realized label of each feature set: the law alone (the
  no-draw model: what β̂ can know), the law with each group of the drawn token's features, all of them, and the
  hidden state's leading principal components on top; each on half and on all of the training prompts. Every row is
  scored on the same nodes (those whose drawn token's rank the set records).
* **Transfer** (:func:`transfer_rows`): the models fitted on every dense node, scored on the tree collection's trunk
  tokens (other prompts, step roots) against their realized acceptance, the collection's ``trunk_accept``.
* **Ladder** (:func:`ladder_rows`): the survival signals (``survival``: P_d β̂_d, ``survival_marginal``: the marginal
  rule on P and β̂) and the plain β̂ ones (``beta_hat``, ``beta_marginal``), from a model fitted on the dense set only,
  scored as ``ddte analyze --expansion`` scores every rule: the best threshold rule cross-fitted by prompt folds of
  the collection, as a ratio to the best static tree (selector/expander/expansion.py ``signal_ratios``). Two
  oracles, for scale, read the target: the exact β (``beta``), and a perfect ŝ (``survival_oracle``: the trunk
  tokens' realized acceptances in place of ŝ, times the exact β).

Run: ``python -m bench.survival --dense data/dense/qwen-60-124 --data data/collect/qwen-coder-60-steps``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from decode.policies.halting import marginal_gain
from selector.acceptance.acceptance import soft_cross_entropy
from selector.acceptance.survival import (
    DRAW_GROUPS,
    DenseDraws,
    draw_basis,
    fit_logistic,
    fit_survival,
    heldout_cross_entropy,
    law_basis,
    load_dense_draws,
    survival_signals,
)

FOLDS = 8  # dense prompt folds of the held-out loss
COMPONENTS = 16  # the hidden state's principal components tried on top of the basis
VERIFIERS = ("specinfer", "traversal")
LADDER = ("entropy", "beta_hat", "beta_marginal", "survival", "survival_marginal", "beta", "survival_oracle")


def binary_entropy(label: np.ndarray) -> float:
    """The mean binary entropy of a soft label: the cross-entropy no model of it can go below."""
    y = np.clip(label.astype(np.float64), 1e-12, 1 - 1e-12)
    return float(-(y * np.log(y) + (1 - y) * np.log(1 - y)).mean())


def hidden_components(hidden: np.ndarray, count: int) -> np.ndarray:
    """``(N, count)`` the leading principal components of the layer-normalised ``hidden`` ``(N, H)`` (fitted on
    every node, no label read)."""
    h = hidden.astype(np.float64)
    h = (h - h.mean(axis=1, keepdims=True)) / (h.std(axis=1, keepdims=True) + 1e-5)
    h -= h.mean(axis=0)
    _, vectors = np.linalg.eigh(h.T @ h)
    return h @ vectors[:, ::-1][:, :count]


def feature_sets(draws: DenseDraws) -> dict[str, np.ndarray]:
    """Name → ``(N, F)`` the feature sets of the loss table."""
    law, draw = draws.law(), draws.draws()
    sets = {"constant": np.zeros((len(draws), 1)), "law (no draw)": law}
    sets |= {f"law + {group}": np.concatenate([law, draws.draws((group,))], axis=1) for group in DRAW_GROUPS}
    sets["draw only"] = draw
    sets["law + draw"] = np.concatenate([law, draw], axis=1)
    if draws.hidden is not None:
        sets[f"law + draw + hidden ({COMPONENTS} PCs)"] = np.concatenate(
            [law, draw, hidden_components(draws.hidden, COMPONENTS)], axis=1)
    return sets


def loss_rows(draws: DenseDraws, fractions=(0.5, 1.0)) -> list[dict]:
    """Per feature set (and per temperature for the law with and without the draw), the cross-fitted cross-entropy
    against the realized label on half and all the prompts; the label's own entropy; β̂ against the exact β."""
    known = draws.take(np.flatnonzero(draws.token_rank >= 0))

    def row(name: str, x: np.ndarray, label: np.ndarray, prompts: np.ndarray) -> dict:
        return {"inputs": name} | {f"ce_{f:g}": heldout_cross_entropy(x, label, prompts, FOLDS, f) for f in fractions}

    rows = [row(name, x, known.realized, known.prompts) for name, x in feature_sets(known).items()]
    for temperature in np.unique(known.temperature):
        at = known.take(np.flatnonzero(known.temperature == temperature))
        rows.append(row(f"T {temperature:g}: law (no draw)", at.law(), at.realized, at.prompts))
        rows.append(row(f"T {temperature:g}: law + draw", np.concatenate([at.law(), at.draws()], axis=1),
                        at.realized, at.prompts))
    floor = binary_entropy(known.realized)
    rows.append({"inputs": "label entropy (floor)"} | {f"ce_{f:g}": floor for f in fractions})
    return rows + [row("β̂ on the law, against the exact β", known.law(), known.beta, known.prompts)]


def trunk_labels(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """(``(N,)`` sampling index, ``(N, s, 2·L_max)`` realized acceptance of each trunk token) of a collection."""
    from data_gen.store import read_metadata, read_shards, require_shards
    from selector.root.root_data import list_column

    metadata = read_metadata(folder)
    table = read_shards(require_shards(folder), ["sampling_index", "trunk_accept"])
    accept = list_column(table, "trunk_accept").reshape(table.num_rows, int(metadata["trees_per_root"]), -1)
    return table.column("sampling_index").to_numpy(), accept.astype(np.float64)


def transfer_rows(draws: DenseDraws, folder: Path, episodes: dict, metadata: dict) -> list[dict]:
    """The law-only and law + draw models fitted on every dense node, scored on the collection's trunk tokens."""
    known = draws.take(np.flatnonzero(draws.token_rank >= 0))
    law_model = fit_logistic(known.law(), known.realized)
    draw_model = fit_logistic(np.concatenate([known.law(), known.draws()], axis=1), known.realized)
    sampling, accept = trunk_labels(folder)
    rows = []
    for c, data in episodes.items():
        temperature = float(metadata["sampling"][c]["temperature"])
        label = accept[sampling == c][:, :, :data.entropy.shape[-1] - 1]  # x_1..x_{D-1}, drawn at depths 0..D-2
        law = law_basis(data.entropy[..., :-1], data.top[..., :-1], temperature)
        draw = draw_basis(data.draw_q[..., 1:], data.draw_rank[..., 1:], data.draw_top[..., 1:])
        rows.append({"T": temperature, "tokens": int(label.size), "label entropy": binary_entropy(label),
                     "law (no draw)": soft_cross_entropy(law_model.predict(law), label),
                     "law + draw": soft_cross_entropy(draw_model.predict(np.concatenate([law, draw], axis=-1)), label)})
    return rows


def ladder_signals(model, data, temperature: float) -> dict[str, np.ndarray]:
    """``(N, s, D)`` the ladder's signals on one configuration's episodes."""
    from selector.expander.expander import chain_times

    chain = chain_times(data)[:, None, :]
    beta_hat = model.beta(data.entropy, data.top, temperature)
    return {"entropy": data.node_signals()["entropy"], "beta_hat": beta_hat,
            "beta_marginal": marginal_gain(beta_hat, chain),
            **survival_signals(model, data.trunk_arrays(), temperature, chain), "beta": data.beta}


def oracle_survival(accept: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """``(N, s, D)`` P_d β_d with P_d the product of the realized acceptances ``accept`` ``(N, s, ≥ D − 1)`` of
    x_1..x_d and β the exact ``beta`` ``(N, s, D)``: what a perfect ŝ would give (it reads the target)."""
    accept = accept[..., :beta.shape[-1] - 1]
    return np.concatenate([np.ones_like(accept[..., :1]), np.cumprod(accept, axis=-1)], axis=-1) * beta


def ladder_rows(models: dict, folder: Path, folds: int) -> tuple[list[dict], dict, dict]:
    """Per verifier, configuration and survival model (name → model): every ladder signal's cross-fitted ratio to
    the best static tree (the signals no model reads only on the first); also (metadata, the first verifier's
    episodes) for the transfer table."""
    from selector.expander.expansion import load_episodes, signal_ratios

    sampling, accept = trunk_labels(folder)
    rows, first = [], None
    for verifier in VERIFIERS:
        metadata, episodes, _ = load_episodes(folder, verifier)
        first = first or episodes
        for c, data in episodes.items():
            temperature = float(metadata["sampling"][c]["temperature"])
            for i, (name, model) in enumerate(models.items()):
                signals = ladder_signals(model, data, temperature)
                if i:
                    signals = {k: v for k, v in signals.items() if k.startswith("survival")}
                else:
                    signals["survival_oracle"] = oracle_survival(accept[sampling == c], data.beta)
                ratios = signal_ratios(data, signals, metadata["l_max"], metadata["k_max"], folds)
                rows.append({"verifier": verifier, "T": temperature, "model": name, **ratios})
    return rows, metadata, first


def half_of_prompts(draws: DenseDraws, seed: int = 0) -> DenseDraws:
    prompts = np.array(sorted(set(draws.prompts.tolist())), dtype=object)
    kept = prompts[np.random.default_rng(seed).permutation(len(prompts))[:len(prompts) // 2]]
    return draws.take(np.flatnonzero(np.isin(draws.prompts, kept)))


def markdown(losses: list[dict], transfer: list[dict], ladder: list[dict]) -> str:
    lines = ["| inputs | held-out CE, half the prompts | all the prompts |", "|---|---:|---:|"]
    lines += [f"| {r['inputs']} | {r['ce_0.5']:.4f} | {r['ce_1']:.4f} |" for r in losses]
    lines += ["", "| T | trunk tokens | label entropy | law (no draw) | law + draw |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['T']:g} | {r['tokens']} | {r['label entropy']:.4f} | {r['law (no draw)']:.4f} | "
              f"{r['law + draw']:.4f} |" for r in transfer]
    lines += ["", "| T | verifier | model | " + " | ".join(LADDER) + " |", "|---|---|---|" + "---:|" * len(LADDER)]
    for r in ladder:
        lines.append(f"| {r['T']:g} | {r['verifier']} | {r['model']} | "
                     + " | ".join(f"{r[k]:.3f}" if k in r else "" for k in LADDER) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dense", required=True, help="a dense data set of schema 2 drawn from the draft")
    parser.add_argument("--data", required=True, help="a tree collection of schema 3 (other prompts)")
    parser.add_argument("--folds", type=int, default=5, help="prompt folds of the ladder's cross-fitting")
    parser.add_argument("--hidden", action="store_true", help="also try the hidden state's principal components")
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    draws = load_dense_draws(args.dense, hidden=args.hidden)
    losses = loss_rows(draws)
    models = {"all": fit_survival(draws), "half": fit_survival(half_of_prompts(draws))}
    ladder, metadata, episodes = ladder_rows(models, Path(args.data), args.folds)
    transfer = transfer_rows(draws, Path(args.data), episodes, metadata)
    print(markdown(losses, transfer, ladder))
    if args.output:
        Path(args.output).write_text(json.dumps({"losses": losses, "transfer": transfer, "ladder": ladder}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
