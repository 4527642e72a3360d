"""The dense per-node data set as arrays, split by prompt: what the acceptance model trains and is scored on.

A dense data set (data_gen/dense_collection.py) holds one row per node: the draft's final hidden state there, its
entropy and top probability, the node's depth, the sampling temperature, the prompt and its category, and two labels:
the exact β = 1 − TV(p, q), and (schema 2 on) the realized min(1, p(x)/q(x)) of the token x the continuation drew
there, whose mean over the draw is β. :func:`load_dense` reads the columns the model needs (a schema-1 set has no
realized label: None); :func:`split_by_prompt` keeps every node of a prompt in one split, since nodes of one
continuation are far from independent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCALAR_INPUTS = ("entropy", "top1", "depth", "temperature")  # the order of the model's scalar input
LABELS = ("exact", "realized")  # what the model may train on: β, or the drawn token's min(1, p(x)/q(x))


@dataclass
class DenseArrays:
    """Every node of a dense data set (or a subset).

    Attributes:
        hidden: ``(N, H)`` float32 the draft's final hidden state at each node.
        scalars: ``(N, 4)`` float32 entropy (nats), top probability, depth, temperature (:data:`SCALAR_INPUTS`).
        beta: ``(N,)`` float32 1 − TV(p, q), the exact label.
        prompts: ``(N,)`` prompt ids; categories: ``(N,)`` their categories.
        realized: ``(N,)`` float32 min(1, p(x)/q(x)) of the token the continuation drew at each node (NaN where the
            target drew it); None for a schema-1 set, which stores none.
    """

    hidden: np.ndarray
    scalars: np.ndarray
    beta: np.ndarray
    prompts: np.ndarray
    categories: np.ndarray
    realized: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.beta)

    def take(self, rows: np.ndarray) -> DenseArrays:
        return DenseArrays(self.hidden[rows], self.scalars[rows], self.beta[rows], self.prompts[rows],
                           self.categories[rows], None if self.realized is None else self.realized[rows])

    def label(self, kind: str) -> np.ndarray:
        """``(N,)`` float32 the training label ``kind`` (:data:`LABELS`): ``exact`` β, or ``realized``.

        Raises:
            ValueError: an unknown kind, or ``realized`` on a set that has none (schema 1) or whose continuations
                the target drew (no draft drew the token: NaN).
        """
        if kind == "exact":
            return self.beta
        if kind != "realized":
            raise ValueError(f"label must be one of {', '.join(LABELS)}, got {kind!r}")
        if self.realized is None:
            raise ValueError("label realized: this dense data set stores no realized labels (schema 1; "
                             "ddte dense-labels writes them from schema 2 on): train on label exact or relabel")
        if np.isnan(self.realized).any():
            raise ValueError("label realized: the data set holds nodes whose token the target drew (--source "
                             "target), where no draft was accepted or rejected: train on label exact")
        return self.realized


def read_dense_metadata(folder: str | Path) -> dict:
    """``dense.json`` of a dense data set; ValueError when ``folder`` holds none."""
    path = Path(folder) / "dense.json"
    if not path.is_file():
        raise ValueError(f"{folder}: not a dense data set (no dense.json; ddte dense-labels writes one)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_dense(folder: str | Path) -> tuple[dict, DenseArrays]:
    """(metadata, every node) of a dense data set, of any readable schema (its realized labels None before
    schema 2); ValueError for a folder without one, without shards, or of a schema this code cannot read."""
    from data_gen.dense_collection import READABLE_VERSIONS

    metadata = read_dense_metadata(folder)
    version = metadata.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{folder}: dense schema version {version!r}, this code reads "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    names = ["prompt_id", "category", "temperature", "depth", "draft_hidden", "entropy", "top1", "beta"]
    column = read_dense_columns(folder, names + (["realized"] if version >= 2 else []))
    scalars = np.stack([column[name].astype(np.float32) for name in ("entropy", "top1", "depth", "temperature")],
                       axis=1)
    realized = column["realized"].astype(np.float32) if version >= 2 else None
    return metadata, DenseArrays(column["draft_hidden"].astype(np.float32), scalars,
                                 column["beta"].astype(np.float32), column["prompt_id"], column["category"], realized)


def read_dense_columns(folder: str | Path, names: list[str]) -> dict[str, np.ndarray]:
    """``names`` of every row of a dense data set's shards, in shard order: ``(N,)`` each, ``draft_hidden``
    ``(N, H)``, the string columns (``prompt_id``, ``category``) as object arrays. ValueError without shards."""
    import pyarrow.parquet as pq

    shards = sorted(Path(folder).glob("dense-*.parquet"))
    if not shards:
        raise ValueError(f"{folder}: no dense-*.parquet shards yet")
    tables = [pq.read_table(path, columns=names) for path in shards]
    column = {}
    for name in names:
        if name == "draft_hidden":
            column[name] = np.concatenate([np.stack(t.column(name).to_numpy(zero_copy_only=False)) for t in tables])
        elif name in ("prompt_id", "category"):
            column[name] = np.asarray([v for t in tables for v in t.column(name).to_pylist()], dtype=object)
        else:
            column[name] = np.concatenate([t.column(name).to_numpy() for t in tables])
    return column


def split_by_prompt(prompts: np.ndarray, val_fraction: float, test_fraction: float, seed: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, test) row indices, whole prompts to each split (at least one prompt each where there are three).

    Raises:
        ValueError: fewer than three prompts, or fractions that leave no training prompt.
    """
    if not (0 < val_fraction < 1 and 0 < test_fraction < 1) or val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction {val_fraction} and test_fraction {test_fraction}: each in (0, 1), sum < 1")
    unique = np.array(sorted(set(prompts.tolist())), dtype=object)
    if len(unique) < 3:
        raise ValueError(f"{len(unique)} prompts: a split by prompt needs at least 3")
    order = unique[np.random.default_rng(seed).permutation(len(unique))]
    n_val = max(1, round(val_fraction * len(unique)))
    n_test = max(1, round(test_fraction * len(unique)))
    if n_val + n_test >= len(unique):
        raise ValueError(f"{len(unique)} prompts leave none to train on after the validation and test splits")
    val, test, train = order[:n_val], order[n_val:n_val + n_test], order[n_val + n_test:]
    return tuple(np.flatnonzero(np.isin(prompts, part)) for part in (train, val, test))
