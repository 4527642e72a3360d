"""Relabel a collected data set's costs for another machine: the step time T̂ of every action, and the pass-time
features, from a latency table measured here (or read from a file). Everything else is copied as it is.

Ê[τ+1] depends only on the two models' distributions, while T̂ depends on the hardware that runs them. Labels that
took hours to collect on one machine can train a selector for another one: measure the latency model there and
relabel. The same holds when the grid changes: collections made before every block size was measured hold a
sparse table (sizes 1, 4, 16, 33) that makes 2- and 3-token blocks look cheaper than they are on CPU.

The measurement uses the data set's own collect config (its pair, latency grid, device and threads), with any
key=value overrides. The pair must be the one the data set was collected with (its fingerprint is checked). The
output folder is written under a temporary name and renamed when complete; an existing folder is never touched.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from data_gen.config import CollectConfig, check_collect_config, config_to_dict
from data_gen.schema import METADATA_FILE
from data_gen.store import list_shards, read_metadata, read_shards, shard_columns
from ddte_core.yamlconfig import apply_override, build_dataclass
from decode.cost.table import DraftPasses, LatencyTable, draft_passes
from decode.drafting.actions import Action
from decode.policies.features import SCALAR_NAMES


def relabel(
    source: Path, output: Path, metadata: dict, latency: LatencyTable, config: CollectConfig, progress: bool = True
) -> int:
    """Copy ``source`` to ``output`` with new step times and pass-time features; returns the number of rows."""
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    passes = draft_passes([Action.parse(a) for a in metadata["actions"]])
    shards = list_shards(source)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{output.name}-", dir=output.parent))
    try:
        rows = 0
        for shard in tqdm(shards, desc="relabel", unit="shard", disable=not progress):
            table = relabel_table(read_shards([shard]), latency, passes)
            pq.write_table(table, staging / shard.name)
            rows += table.num_rows
        new_metadata = relabelled_metadata(metadata, latency, config, source)
        (staging / METADATA_FILE).write_text(json.dumps(new_metadata, indent=1), encoding="utf-8")
        os.chmod(staging, 0o755)  # mkdtemp makes 0700; a data set is an ordinary shared folder
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return rows


def relabel_table(table, latency: LatencyTable, passes: DraftPasses):
    """One shard's pyarrow table with ``step_ms`` (N, A) and the ``draft_ms``/``target_ms`` scalars recomputed at each
    row's context length; every other column is the same object."""
    import pyarrow as pa

    n = table.num_rows
    scalars = np.array(table.column("scalars").to_pylist(), dtype=np.float64).reshape(n, len(SCALAR_NAMES))
    context = scalars[:, SCALAR_NAMES.index("context_length")].astype(np.int64)
    step_ms = np.array([latency.step_ms_many(int(c), passes) for c in context]).reshape(n, len(passes.tree_sizes))
    timed = [SCALAR_NAMES.index("draft_ms"), SCALAR_NAMES.index("target_ms")]
    scalars[:, timed] = np.array([latency.pass_times(int(c)) for c in context]).reshape(n, 2)
    for name, values in (("step_ms", step_ms), ("scalars", scalars)):
        index = table.schema.get_field_index(name)
        field = table.schema.field(index)
        column = pa.array(values.astype(np.float32).tolist(), type=field.type)
        table = table.set_column(index, field, column)
    return table


def relabelled_metadata(metadata: dict, latency: LatencyTable, config: CollectConfig, source: Path) -> dict:
    """The source's metadata with the new latency table and a record of where it came from."""
    from ddte_core.machine import environment

    out = copy.deepcopy(metadata)
    out["latency"] = latency.__dict__
    out["relabelled"] = {"from": str(source), "latency_config": config_to_dict(config)["latency"],
                         "previous_latency": metadata.get("latency")}
    if not config.latency.file:  # measured here: say on what
        out["relabelled"]["hardware"] = {"device": latency.device} | environment()
    return out


# --------------------------------------------------------------------------------------------------------- pieces


def read_source(source: Path) -> dict:
    """The metadata of a data set folder that holds shards, each one's parquet footer read (no rows), so a corrupt
    shard is named before any measurement; ValueError if it is not one."""
    if not (source / METADATA_FILE).is_file():
        raise ValueError(f"{source} is not a collected data set (no {METADATA_FILE})")
    metadata = read_metadata(source)
    shards = list_shards(source)
    if not shards:
        raise ValueError(f"{source} holds no shards")
    for shard in shards:
        missing = {"scalars", "step_ms"} - set(shard_columns(shard))
        if missing:
            raise ValueError(f"{shard}: no {', '.join(sorted(missing))} column; not a shard of a collected data set")
    return metadata


def relabel_config(metadata: dict, overrides: list[str]) -> CollectConfig:
    """The data set's own collect config with the user's overrides (validated like `ddte collect`'s)."""
    data = copy.deepcopy(metadata.get("config") or {})
    for assignment in overrides:
        apply_override(data, assignment)
    return check_collect_config(build_dataclass(CollectConfig, data))


def check_same_pair(metadata: dict, config: CollectConfig) -> None:
    """A latency table is only meaningful for the pair whose Ê labels these are; ValueError for another pair."""
    if config.latency.file:
        return  # no models are loaded; the file's provenance is the user's word
    from decode.pair import pair_fingerprint, read_pair_config

    try:
        paths = read_pair_config(config.pair).paths()
        fingerprint = pair_fingerprint(paths["target"], paths["draft"], paths.get("tokenizer"))
    except (OSError, ValueError) as err:
        raise ValueError(f"pair: {err}") from err
    want = metadata.get("pair", {}).get("fingerprint")
    if want and fingerprint != want:
        raise ValueError(f"pair {config.pair} is not the pair this data set was collected with "
                         f"(fingerprint {fingerprint[:12]}…, data set {want[:12]}…)")


def relabel_latency(config: CollectConfig) -> LatencyTable:
    """The new latency table: read from ``latency.file``, else measured here on the config's pair."""
    from data_gen.collection import collect_latency
    from data_gen.collector import load_collect_pair

    return collect_latency(config, None if config.latency.file else load_collect_pair(config))
