"""The selector's data read from a collected data set (docs/dataset.md): one row per root.

:func:`inspect_dataset` checks the folder without reading its rows (metadata, schema version, feature names,
verifier, columns), so a bad config fails before any training starts, with a ``ValueError`` that says what is wrong;
:func:`load_rows` reads the rows as :class:`RootArrays`; :func:`data_fingerprint` names the data set. The splits,
the scalar standardisation and the batches are selector/root/data.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_gen.schema import METADATA_FILE, READABLE_VERSIONS, SHARD_GLOB, label_column, roots_per_step, trees_column
from decode.policies.features import HIDDEN_NAMES, SCALAR_NAMES


@dataclass(frozen=True)
class DatasetInfo:
    """What the metadata and the shard schema say about a data folder (checked, cheap to build)."""

    folder: Path
    metadata: dict[str, Any]
    shards: tuple[Path, ...]
    verifier: str

    @property
    def actions(self) -> list[str]:
        return list(self.metadata["actions"])

    @property
    def hidden_sizes(self) -> dict[str, int]:
        return {name: int(self.metadata["hidden_sizes"][name]) for name in HIDDEN_NAMES}

    @property
    def pair_fingerprint(self) -> str:
        return str(self.metadata.get("pair", {}).get("fingerprint", ""))

    @property
    def per_step(self) -> bool:
        """The roots sample a reference loop's step starts (``"roots": "steps"``), else trajectory positions."""
        return roots_per_step(self.metadata)


@dataclass
class RootArrays:
    """Rows of the data set as numpy arrays (N roots, A actions, S scalars).

    ``per_step``: the collection put its roots at a reference loop's step starts (``"roots": "steps"``), else at
    trajectory positions: how the rows stand for a decoding stream, which every throughput over them reads
    (decode/cost/throughput.py).
    """

    prompt_id: np.ndarray  # (N,) str
    sampling_index: np.ndarray  # (N,) int64
    hidden: dict[str, np.ndarray]  # name -> (N, H) float32
    scalars: np.ndarray  # (N, S) float32, raw
    step_ms: np.ndarray  # (N, A) float32
    be: np.ndarray  # (N, A) float32, NaN where the verifier has no label
    be_trees: np.ndarray | None = None  # (N, s, A) per-tree labels (schema 2), None for a schema-1 data set
    base_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # (N,) a_base per row
    per_step: bool = False

    def __len__(self) -> int:
        return int(self.prompt_id.shape[0])

    @property
    def valid(self) -> np.ndarray:
        """(N, A) bool: actions with a usable label (finite Ê, positive finite step time)."""
        return np.isfinite(self.be) & np.isfinite(self.step_ms) & (self.step_ms > 0)

    def take(self, rows: np.ndarray) -> RootArrays:
        """The subset at integer ``rows``."""
        return RootArrays(
            prompt_id=self.prompt_id[rows],
            sampling_index=self.sampling_index[rows],
            hidden={k: v[rows] for k, v in self.hidden.items()},
            scalars=self.scalars[rows],
            step_ms=self.step_ms[rows],
            be=self.be[rows],
            be_trees=None if self.be_trees is None else self.be_trees[rows],
            base_index=self.base_index[rows] if self.base_index.size else self.base_index,
            per_step=self.per_step,
        )


def inspect_dataset(folder: str | Path, verifier: str) -> DatasetInfo:
    """Check a data folder without reading its rows: metadata, schema version, feature names, verifier, columns.

    Raises ValueError with a one-line message for every problem found.
    """
    from data_gen.store import shard_columns

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"'{folder}' is a file, not a data folder: give the folder `ddte collect` wrote")
    if not folder.is_dir():
        raise ValueError(f"data folder '{folder}' does not exist")
    meta_path = folder / METADATA_FILE
    if not meta_path.is_file():
        raise ValueError(f"'{folder}' has no {METADATA_FILE}: not a data set written by `ddte collect`")
    try:
        metadata = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path} is not valid JSON: {err}") from err
    version = metadata.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{meta_path}: schema_version {version!r}, this selector reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    if list(metadata.get("scalar_names", [])) != list(SCALAR_NAMES):
        raise ValueError(f"{meta_path}: scalar_names differ from decode.policies.features.SCALAR_NAMES "
                         f"{list(SCALAR_NAMES)}")
    for key in ("actions", "hidden_sizes", "verifiers", "sampling"):
        if key not in metadata:
            raise ValueError(f"{meta_path}: missing key '{key}'")
    roots_per_step(metadata)  # a placement no estimator reads fails here, before any training
    verifiers = list(metadata["verifiers"])
    if verifier not in verifiers:
        from decode.verifiers import VERIFIERS

        if verifier in VERIFIERS:
            raise ValueError(f"this data set has no labels for verifier '{verifier}' (it has labels for "
                             f"{', '.join(verifiers)}): collect with it among the verifiers, or choose one of those")
        raise ValueError(f"unknown verifier '{verifier}': this data set has labels for {', '.join(verifiers)}")
    shards = tuple(sorted(folder.glob(SHARD_GLOB)))
    if not shards:
        raise ValueError(f"'{folder}' has no shards ({SHARD_GLOB})")
    required = ["prompt_id", "sampling_index", *HIDDEN_NAMES, "scalars", "step_ms", label_column(verifier)]
    for shard in shards:
        names = set(shard_columns(shard))
        missing = [c for c in required if c not in names]
        if missing:
            raise ValueError(f"shard {shard.name} lacks column(s) {', '.join(missing)}")
    return DatasetInfo(folder=folder, metadata=metadata, shards=shards, verifier=verifier)


def data_fingerprint(info: DatasetInfo) -> str:
    """sha256 over dataset.json's bytes and every shard's name and size: changes when the data set does."""
    return folder_fingerprint(info.folder / METADATA_FILE, info.shards)


def folder_fingerprint(metadata: Path, shards: Sequence[Path]) -> str:
    """sha256 over a data set's metadata file's bytes and each shard's name and size (a collection's or a dense
    set's)."""
    digest = hashlib.sha256(metadata.read_bytes())
    for shard in shards:
        digest.update(f"{shard.name}:{shard.stat().st_size}\n".encode())
    return digest.hexdigest()


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Silence `datasets`' progress bars while loading (they are noise for a few thousand rows)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def list_column(table, name: str, width: int | None = None) -> np.ndarray:
    """A fixed-length list<float> column of a pyarrow table as a (N, width) float32 array."""
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    n = len(column)
    if n and (lengths.min() != lengths.max() or (width is not None and lengths[0] != width)):
        expected = width if width is not None else int(lengths[0])
        raise ValueError(f"column '{name}' has lists of length {lengths.min()}..{lengths.max()}, expected {expected}")
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    return values.reshape(n, -1) if n else values.reshape(0, width or 0)


def load_rows(info: DatasetInfo) -> RootArrays:
    """Read every shard through ``datasets.load_dataset("parquet")`` into numpy arrays (no base_index yet)."""
    import datasets

    columns = ["prompt_id", "sampling_index", *HIDDEN_NAMES, "scalars", "step_ms", label_column(info.verifier)]
    per_tree = trees_column(info.verifier)
    with quiet_datasets():
        ds = datasets.load_dataset("parquet", data_files=[str(s) for s in info.shards], split="train")
    has_trees = per_tree in ds.column_names
    table = ds.select_columns(columns + ([per_tree] if has_trees else [])).data.table
    n_actions = len(info.actions)
    be_trees = None
    if has_trees:  # schema 2: (N, s·A) tree-major -> (N, s, A)
        trees = int(info.metadata["trees_per_root"])
        be_trees = list_column(table, per_tree, trees * n_actions).reshape(-1, trees, n_actions)
    return RootArrays(
        be_trees=be_trees,
        prompt_id=np.asarray(table.column("prompt_id").to_pylist(), dtype=object),
        sampling_index=table.column("sampling_index").to_numpy().astype(np.int64),
        hidden={name: list_column(table, name, info.hidden_sizes[name]) for name in HIDDEN_NAMES},
        scalars=list_column(table, "scalars", len(SCALAR_NAMES)),
        step_ms=list_column(table, "step_ms", n_actions),
        be=list_column(table, label_column(info.verifier), n_actions),
        per_step=info.per_step,
    )
