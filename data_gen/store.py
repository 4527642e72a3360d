"""The on-disk data set: shard names, atomic parquet writes through ``datasets``, and ``dataset.json``.

A shard is the rows of one chunk of prompts (chunk c: prompts c·prompts_per_shard onwards), whichever worker
collected it. Its name holds only the chunk's number, so ``--resume`` skips the chunks whose shard exists with any
number of workers or ``--shard`` splits. It is written to a temporary file of its own (``.tmp-`` + a unique suffix)
in the output folder and renamed, so a shard on disk is always complete, and workers sharing the folder never touch
each other's temporaries.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

from data_gen.schema import METADATA_FILE, READABLE_VERSIONS, SHARD_GLOB
from decode.policies.features import HIDDEN_NAMES

# Keys of the resolved config that may change between the runs that build one data set (they change how the
# work is spread or where it runs, not what a row holds).
VOLATILE_KEYS = ("output", "workers", "threads", "device", "dtype", "prompts_per_shard", "target_chunk", "engine",
                 "ray")


# A temporary older than this is an interrupted run's: a live worker renames its file seconds after creating it.
STALE_TEMPORARY_S = 3600.0
# Shard names of ddte before chunk numbers were global: worker i of N, that worker's chunk c.
LEGACY_SHARD_NAME = re.compile(r"shard-\d+-of-\d+-\d+\.parquet")


def shard_path(out: Path, chunk: int) -> Path:
    """The shard of chunk ``chunk`` (a name that does not depend on how many workers share the collection)."""
    return out / f"shard-{chunk:05d}.parquet"


def legacy_shards(out: Path) -> list[Path]:
    """Shards named by an older ddte (``shard-i-of-N-c``): their chunks are not this version's chunks."""
    return [p for p in list_shards(out) if LEGACY_SHARD_NAME.fullmatch(p.name)]


def list_shards(out: Path) -> list[Path]:
    return sorted(out.glob(SHARD_GLOB))


def shard_columns(shard: Path) -> list[str]:
    """The column names of one shard; ValueError naming the file when it is not a readable parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(shard).names)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{shard}: not a readable parquet shard ({str(err).splitlines()[0]}); remove it and "
                         "collect that chunk again (ddte collect --resume)") from err


def read_shards(shards: list[Path], columns: list[str] | None = None):
    """The rows of ``shards`` in order, as one pyarrow table (``columns`` only, when given); ValueError naming the
    first file that is not a readable parquet shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for shard in shards:
        try:
            tables.append(pq.read_table(shard, columns=columns))
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{shard}: not a readable parquet shard ({str(err).splitlines()[0]}); remove it and "
                             "collect that chunk again (ddte collect --resume)") from err
    return pa.concat_tables(tables)


def write_shard(rows: list[dict], path: Path, label_columns: list[str]) -> None:
    """Write rows as one parquet file through ``datasets``, atomically (temporary name, then rename)."""
    from datasets import Dataset, Features, List, Value
    from datasets.utils import disable_progress_bars

    disable_progress_bars()  # one bar per shard write would interleave with (or defeat --no-progress of) ours

    features = {
        "prompt_id": Value("string"),
        "sampling_index": Value("int32"),
        "temperature": Value("float32"),
        "top_p": Value("float32"),
        "trajectory": Value("int32"),
        "root_position": Value("int32"),
        "seed": Value("int64"),
    }
    for name in (*HIDDEN_NAMES, "scalars", "step_ms", "l1_by_depth", *label_columns):
        features[name] = List(Value("float32"))
    write_parquet(Dataset.from_list(rows, features=Features(features)), path)


def write_parquet(table, path: Path) -> None:
    """Write a ``datasets.Dataset`` as one parquet file, atomically: a temporary name beside it, then a rename."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".parquet", dir=path.parent)
    os.close(fd)
    try:
        table.to_parquet(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_stale_temporaries(out: Path, older_than_s: float = STALE_TEMPORARY_S) -> None:
    """Temporary files of an interrupted run (never complete shards): those not modified for ``older_than_s``.

    Younger ones may be another worker's shard being written into the same folder right now.
    """
    now = time.time()
    for tmp in out.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()
        except OSError:  # renamed or removed by its writer meanwhile, or not ours to remove
            pass


def check_writable(out: Path) -> None:
    """OSError unless a file can be created in ``out`` (a probe of a unique name: workers never share it)."""
    fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=out)
    os.close(fd)
    os.unlink(probe)


def write_metadata_once(out: Path, metadata: dict) -> dict:
    """Create ``dataset.json`` unless it exists; return the metadata on disk (another worker's if it won)."""
    path = out / METADATA_FILE
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(metadata, handle, indent=1)
    try:
        os.chmod(tmp, 0o644)
        os.link(tmp, path)  # fails if the file exists: the first worker's metadata wins
    except FileExistsError:
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)
    return read_metadata(out)


def read_metadata(out: Path) -> dict:
    path = out / METADATA_FILE
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read the data set's metadata ({err})") from err
    if metadata.get("schema_version") not in READABLE_VERSIONS:
        raise ValueError(f"{path}: schema version {metadata.get('schema_version')}, this ddte reads "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    return metadata


def content_config(config: dict) -> dict:
    """The part of a resolved config that determines the rows."""
    return {k: v for k, v in config.items() if k not in VOLATILE_KEYS}


def check_same_collection(existing: dict, config: dict) -> None:
    """Refuse to add rows made under another config, or another schema version, to a data set."""
    from data_gen.schema import SCHEMA_VERSION

    if existing.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"the output folder holds a schema-{existing.get('schema_version')} collection; this ddte "
                         f"writes schema {SCHEMA_VERSION}: use another --output")
    old, new = content_config(existing.get("config", {})), content_config(config)
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
        raise ValueError(
            f"the output folder holds a collection made with a different config (differs in: {', '.join(diff)}); "
            "use another --output, or the same config to resume"
        )
