"""A synthetic selector data set that follows docs/dataset.md exactly, for tests and smoke runs.

The labels come from a toy acceptance model, not from language models: each root has a hidden "agreement"
``a`` in (0, 1) between draft and target that falls with the draft's root entropy (scalar ``entropy_q_root``) and
with the temperature. A delayed tree (K, L1, L2) then has

    Ê[τ+1] = 1 + Σ_{i=1..L1} a^i + a^L1 · b_K · Σ_{j=0..L2-1} a^j,   b_K = 1 − (1 − a)^K_eff

(bonus token, trunk, then the best of K branches), and a step time that grows with the tree size. Long trees win
when ``a`` is high and short ones when it is low, so the best action depends learnably on the features and a
selector can beat every static shape. ``gbv`` labels are NaN on delayed trees (K > 1, L1 > 0, L2 > 0), as in
the real collector.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_gen.schema import METADATA_FILE, SCHEMA_VERSION, acceptance_column, label_column, trees_column
from decode.drafting.actions import action_grid, action_key
from decode.policies.features import HIDDEN_NAMES, SCALAR_NAMES
from decode.verifiers import get_verifier
from selector.root.root_data import quiet_datasets

SAMPLING = ({"temperature": 0.6, "top_p": 1.0}, {"temperature": 1.0, "top_p": 0.9})
# How much of a second, third... branch counts: traversal-like verifiers use every branch fully.
_BRANCH_EFFICIENCY = {"traversal": 1.0, "specinfer": 0.7, "spectr": 0.6, "nss": 0.0, "naive": 0.0, "gbv": 1.0}


def _agreement(entropy_q_root: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """Per-root acceptance probability of one draft token, shape (N,)."""
    logit = 2.9 - 1.3 * entropy_q_root - 1.0 * (temperature - 0.6)
    return np.clip(1.0 / (1.0 + np.exp(-logit)), 0.02, 0.98)


def _block_efficiency(a: np.ndarray, actions: Sequence, verifier: str) -> np.ndarray:
    """Ê[τ+1] per root and action under the toy acceptance model, shape (N, A); NaN where the verifier is
    not lossless."""
    eff = _BRANCH_EFFICIENCY.get(verifier, 0.5)
    out = np.empty((a.shape[0], len(actions)), dtype=np.float64)
    lossless = get_verifier(verifier).supports_action
    for j, act in enumerate(actions):
        trunk = sum((a**i for i in range(1, act.l1 + 1)), np.zeros_like(a))
        branch_accept = 1.0 - (1.0 - a) ** (1.0 + eff * (act.k - 1))
        branch = a**act.l1 * branch_accept * sum((a**i for i in range(act.l2)), np.zeros_like(a))
        out[:, j] = 1.0 + trunk + branch
        if not lossless(act.k, act.l1, act.l2):  # unlabelled, as a collection leaves it
            out[:, j] = np.nan
    return out


def _step_ms(draft_ms: np.ndarray, target_ms: np.ndarray, actions: Sequence) -> np.ndarray:
    """Latency-model step time per root and action, shape (N, A): drafting depth plus a target pass over the tree."""
    size = np.array([a.l1 + a.k * a.l2 for a in actions], dtype=np.float64)
    depth = np.array([a.l1 + a.l2 for a in actions], dtype=np.float64)
    return target_ms[:, None] * (1.0 + 0.04 * size[None, :]) + draft_ms[:, None] * depth[None, :]


def _rows(n_prompts: int, roots_per_prompt: int, rng: np.random.Generator, hidden: tuple[int, int]) -> dict:
    """Root-level columns shared by every verifier (features, step times, ids)."""
    n = n_prompts * roots_per_prompt
    prompt = np.repeat(np.arange(n_prompts), roots_per_prompt)
    within = np.tile(np.arange(roots_per_prompt), n_prompts)
    sampling_index = (within % len(SAMPLING)).astype(np.int32)
    temperature = np.array([SAMPLING[i]["temperature"] for i in sampling_index], dtype=np.float32)
    top_p = np.array([SAMPLING[i]["top_p"] for i in sampling_index], dtype=np.float32)
    root_position = (20 + 16 * (within // len(SAMPLING))).astype(np.int32)

    h_root = rng.uniform(0.0, 4.0, n)
    a = _agreement(h_root, temperature.astype(np.float64))
    h_prev_q = np.clip(h_root + rng.normal(0, 0.5, n), 0, None)
    h_prev_p = np.clip(h_prev_q + rng.normal(0, 0.3, n), 0, None)
    kl_pq = (1.0 - a) * rng.lognormal(0.0, 1.0, n)  # heavy-tailed, like the real KL scalars
    kl_qp = (1.0 - a) * rng.lognormal(0.0, 1.2, n)
    l1 = np.clip(2.0 * (1.0 - a) + rng.normal(0, 0.1, n), 0, 2)
    draft_ms = 0.8 + 0.001 * root_position
    target_ms = 8.0 + 0.01 * root_position
    scalars = np.stack([h_prev_p, h_prev_q, h_root, kl_pq, kl_qp, l1, root_position, temperature, top_p,
                        draft_ms, target_ms], axis=1).astype(np.float32)
    assert scalars.shape[1] == len(SCALAR_NAMES)

    h_t, h_d = hidden
    blocks = {name: rng.normal(0, 1, (n, size)).astype(np.float32)
              for name, size in zip(HIDDEN_NAMES, (h_t, h_d, h_d), strict=True)}
    blocks["target_hidden_prev"][:, 0] = 4.0 * (a - 0.5) + rng.normal(0, 0.2, n)  # the target "knows" a too
    return {
        "prompt_id": [str(p) for p in prompt],
        "sampling_index": sampling_index,
        "temperature": temperature,
        "top_p": top_p,
        "trajectory": np.zeros(n, dtype=np.int32),
        "root_position": root_position,
        "seed": rng.integers(0, 2**31, n).astype(np.int64),
        **blocks,
        "scalars": scalars,
        "_agreement": a,
        "_draft_ms": draft_ms.astype(np.float64),
        "_target_ms": target_ms.astype(np.float64),
    }


def _features(verifiers: Sequence[str], per_tree: bool):
    import datasets

    floats = datasets.List(datasets.Value("float32"))
    spec = {
        "prompt_id": datasets.Value("string"),
        "sampling_index": datasets.Value("int32"),
        "temperature": datasets.Value("float32"),
        "top_p": datasets.Value("float32"),
        "trajectory": datasets.Value("int32"),
        "root_position": datasets.Value("int32"),
        "seed": datasets.Value("int64"),
        **{name: floats for name in HIDDEN_NAMES},
        "scalars": floats,
        "step_ms": floats,
    }
    for v in verifiers:
        spec[label_column(v)] = floats
        spec[acceptance_column(v)] = floats
        if per_tree:
            spec[trees_column(v)] = floats
    spec["l1_by_depth"] = floats
    return datasets.Features(spec)


def _metadata(verifiers, actions, k_max, l_max, hidden, n_prompts, roots_per_prompt, seed, trees,
              version) -> dict:
    return {
        "schema_version": version,
        "actions": [action_key(a) for a in actions],
        "k_max": k_max,
        "l_max": l_max,
        "verifiers": list(verifiers),
        "scalar_names": list(SCALAR_NAMES),
        "hidden_sizes": dict(zip(HIDDEN_NAMES, (hidden[0], hidden[1], hidden[1]), strict=True)),
        "pair": {"fingerprint": "synthetic-pair", "target": "synthetic", "draft": "synthetic", "vocab_size": 0},
        "sampling": [dict(s) for s in SAMPLING],
        "trees_per_root": trees,
        "stride": 16,
        "trajectories": 1,
        "new_tokens": 16 * roots_per_prompt,
        "seed": seed,
        "latency": {"lengths": [], "sizes": [], "draft_ms": [[]], "target_ms": [[]], "device": "cpu"},
        "versions": {"ddte": "synthetic"},
        "hardware": {"device": "cpu", "cpu": "synthetic", "threads": 1, "gpu": None},
        "config": {"synthetic": True, "n_prompts": n_prompts, "roots_per_prompt": roots_per_prompt},
    }


def write_synthetic_dataset(
    folder: str | Path,
    n_prompts: int,
    roots_per_prompt: int,
    seed: int = 0,
    verifiers: Sequence[str] = ("specinfer", "traversal"),
    k_max: int = 2,
    l_max: int = 2,
    hidden: tuple[int, int] = (16, 8),
    n_shards: int = 2,
    trees_per_root: int = 2,
    schema_version: int = SCHEMA_VERSION,
) -> Path:
    """Write ``dataset.json`` and ``n_shards`` parquet shards (prompts split across them) into ``folder``.

    Every prompt gets ``roots_per_prompt`` roots, alternating between the two sampling configurations.
    ``hidden`` is (H_target, H_draft). Schema 2 stores ``trees_per_root`` noisy per-tree labels whose mean is the
    label; schema 1 only the label. Returns the folder.
    """
    import datasets

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    actions = action_grid(k_max, l_max)
    rows = _rows(n_prompts, roots_per_prompt, rng, hidden)
    a = rows.pop("_agreement")
    step = _step_ms(rows.pop("_draft_ms"), rows.pop("_target_ms"), actions)
    rows["step_ms"] = step.astype(np.float32)
    for v in verifiers:
        be = _block_efficiency(a, actions, v)
        be = np.where(np.isnan(be), np.nan, np.maximum(1.0, be * (1.0 + rng.normal(0, 0.03, be.shape))))
        trees = np.maximum(1.0, be[:, None, :] * (1.0 + rng.normal(0, 0.05, (len(be), trees_per_root, be.shape[1]))))
        trees = trees.astype(np.float32)
        rows[label_column(v)] = trees.mean(axis=1) if schema_version >= 2 else be.astype(np.float32)
        if schema_version >= 2:
            rows[trees_column(v)] = trees.reshape(len(be), -1)
        k_eff = 1.0 + _BRANCH_EFFICIENCY.get(v, 0.5) * (k_max - 1)
        per_depth = 1.0 - (1.0 - a[:, None] * 0.97 ** np.arange(l_max + 1)[None, :]) ** k_eff
        rows[acceptance_column(v)] = per_depth.astype(np.float32)
    rows["l1_by_depth"] = np.repeat(2.0 * (1.0 - a)[:, None], 2 * l_max + 1, axis=1).astype(np.float32)

    meta = _metadata(verifiers, actions, k_max, l_max, hidden, n_prompts, roots_per_prompt, seed, trees_per_root,
                     schema_version)
    (folder / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    features = _features(verifiers, schema_version >= 2)
    prompt_chunks = np.array_split(np.arange(n_prompts), max(1, min(n_shards, n_prompts)))
    for chunk_index, prompts in enumerate(prompt_chunks):
        take = np.flatnonzero(np.isin(np.repeat(np.arange(n_prompts), roots_per_prompt), prompts))
        columns = {name: [values[i] for i in take] if isinstance(values, list) else values[take]
                   for name, values in rows.items()}
        shard = datasets.Dataset.from_dict(columns, features=features)
        final = folder / f"shard-00000-of-00001-{chunk_index:05d}.parquet"
        tmp = final.with_name(final.name + ".tmp")
        with quiet_datasets():
            shard.to_parquet(str(tmp))
        os.replace(tmp, final)  # a shard on disk is always whole, as the collector guarantees
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selector.root.synthetic OUT``: write a synthetic data set for smoke runs of ``ddte train``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m selector.root.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="folder to write (dataset.json + shard-*.parquet)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--roots", type=int, default=12, help="roots per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verifiers", default="specinfer,traversal,gbv", help="comma-separated")
    parser.add_argument("--k-max", type=int, default=2)
    parser.add_argument("--l-max", type=int, default=2)
    parser.add_argument("--hidden", default="16,8", help="H_target,H_draft")
    args = parser.parse_args(argv)
    h_t, h_d = (int(v) for v in args.hidden.split(","))
    verifiers = tuple(v for v in args.verifiers.split(",") if v)
    folder = write_synthetic_dataset(args.output, args.prompts, args.roots, args.seed, verifiers, args.k_max,
                                     args.l_max, (h_t, h_d))
    print(f"wrote {args.prompts * args.roots} roots to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
