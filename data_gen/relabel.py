"""Relabel a collected data set's costs for another machine: the step time T̂ of every action, and the pass-time
features, from a latency table measured here (or read from a file). Everything else is copied as it is.

Ê[τ+1] depends only on the two models' distributions, while T̂ depends on the hardware that runs them. Labels that
took hours to collect on one machine can train a selector for another one: measure the latency model there and
relabel. The same holds when the grid changes: collections made before every block size was measured hold a
sparse table (sizes 1, 4, 16, 33) that makes 2- and 3-token blocks look cheaper than they are on CPU.

  ddte relabel data/collect/default data/collect/here                      # measure on this machine
  ddte relabel data/collect/default data/collect/dense latency.sizes=null  # every block size this time
  ddte relabel data/collect/default data/gpu latency.file=gpu.json         # a table measured elsewhere
  ddte relabel --save-latency gpu.json data/collect/default data/gpu device=cuda latency.repeats=10

The measurement uses the data set's own collect config (its pair, latency grid, device and threads), with any
key=value overrides. The pair must be the one the data set was collected with (its fingerprint is checked). The
output folder is written under a temporary name and renamed when complete; an existing folder is never touched.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from data_gen.config import CollectConfig, check_collect_config, config_to_dict
from data_gen.schema import METADATA_FILE, SCALAR_NAMES
from data_gen.store import list_shards, read_metadata
from ddte.cli import UserError
from ddte.yamlconfig import apply_override, build_dataclass
from decode.drafting import Action
from decode.latency import DraftPasses, LatencyTable, draft_passes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", help="a folder written by `ddte collect`")
    parser.add_argument("output", help="new folder for the relabelled data set (must not exist)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="overrides of the data set's collect config, e.g. device=cuda latency.file=t.json")
    parser.add_argument("--save-latency", default=None, metavar="FILE", help="also write the latency table as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    source, output = Path(args.data), Path(args.output)
    metadata = _read_source(source)
    if output.exists():
        raise UserError(f"{output} exists; relabelling writes a new folder")
    config = _config(metadata, args.overrides)
    _check_same_pair(metadata, config)
    start = time.perf_counter()
    latency = _latency(config)
    if args.save_latency:
        Path(args.save_latency).write_text(latency.to_json(), encoding="utf-8")
    rows = relabel(source, output, metadata, latency, config, progress=not args.no_progress)
    print(f"relabelled {rows} roots into {output} in {time.perf_counter() - start:.1f} s "
          f"(step times from a {len(latency.lengths)}×{len(latency.sizes)} latency table on {latency.device})")
    return 0


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
            table = relabel_table(pq.read_table(shard), latency, passes)
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
    import platform

    import torch

    out = copy.deepcopy(metadata)
    out["latency"] = latency.__dict__
    out["relabelled"] = {"from": str(source), "latency_config": config_to_dict(config)["latency"],
                         "previous_latency": metadata.get("latency")}
    if not config.latency.file:  # measured here: say on what
        out["relabelled"]["hardware"] = {
            "device": latency.device, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        }
    return out


# --------------------------------------------------------------------------------------------------------- pieces


def _read_source(source: Path) -> dict:
    if not (source / METADATA_FILE).is_file():
        raise UserError(f"{source} is not a collected data set (no {METADATA_FILE})")
    try:
        metadata = read_metadata(source)
    except ValueError as err:
        raise UserError(str(err)) from err
    if not list_shards(source):
        raise UserError(f"{source} holds no shards")
    return metadata


def _config(metadata: dict, overrides: list[str]) -> CollectConfig:
    """The data set's own collect config with the user's overrides (validated like `ddte collect`'s)."""
    data = copy.deepcopy(metadata.get("config") or {})
    try:
        for assignment in overrides:
            apply_override(data, assignment)
        return check_collect_config(build_dataclass(CollectConfig, data))
    except ValueError as err:
        raise UserError(str(err)) from err


def _check_same_pair(metadata: dict, config: CollectConfig) -> None:
    """A latency table is only meaningful for the pair whose Ê labels these are."""
    if config.latency.file:
        return  # no models are loaded; the file's provenance is the user's word
    from decode.pair import pair_fingerprint, read_pair_config

    try:
        paths = {k: Path(v) for k, v in read_pair_config(config.pair).items()}
        fingerprint = pair_fingerprint(paths["target"], paths["draft"], paths.get("tokenizer"))
    except (OSError, ValueError) as err:
        raise UserError(f"pair: {err}") from err
    want = metadata.get("pair", {}).get("fingerprint")
    if want and fingerprint != want:
        raise UserError(f"pair {config.pair} is not the pair this data set was collected with "
                        f"(fingerprint {fingerprint[:12]}…, data set {want[:12]}…)")


def _latency(config: CollectConfig) -> LatencyTable:
    from data_gen.cli import collect_latency, load_collect_pair

    return collect_latency(config, None if config.latency.file else load_collect_pair(config))
