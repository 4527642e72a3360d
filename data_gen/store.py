"""The on-disk data sets: shard names, atomic parquet writes through ``datasets``, and the metadata file.

The one shard and resume writer of both collectors: ``ddte collect`` (data_gen/collection.py, ``dataset.json``,
``shard-NNNNN.parquet``) and ``ddte dense-labels`` (data_gen/dense_collection.py, ``dense.json``,
``dense-NNNNN.parquet``). A shard is the rows of one chunk of prompts (chunk c: prompts c·prompts_per_shard onwards),
whichever worker collected it, and ``shard=(i, N)`` takes the chunks with c % N == i (:func:`shard_chunks`). Its
name holds only the chunk's number (:class:`Shards`), so a resumed run skips the chunks whose shard exists with any
number of workers or ``--shard`` splits. It is written to a temporary file of its own (``.tmp-`` + a unique suffix)
in the output folder and renamed, so a shard on disk is always complete, and workers sharing the folder never touch
each other's temporaries. The metadata file is linked into place whole by the first worker (:func:`link_json_once`):
every other one reads that one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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


def shard_chunks(num_prompts: int, prompts_per_shard: int, shard: tuple[int, int] = (0, 1)) -> list[int]:
    """The chunks shard ``(i, N)`` writes: those c of the ⌈num_prompts / prompts_per_shard⌉ with c % N == i."""
    index, count = shard
    return [c for c in range(-(-num_prompts // prompts_per_shard)) if c % count == index]


@dataclass(frozen=True)
class Shards:
    """A data set's shard files in ``out``: chunk c's file (``pattern``), which are written, which remain."""

    out: Path
    pattern: str = "shard-{:05d}.parquet"

    def path(self, chunk: int) -> Path:
        """The shard of chunk ``chunk`` (a name that does not depend on how many workers share the collection)."""
        return self.out / self.pattern.format(chunk)

    def written(self, chunks: Sequence[int]) -> list[int]:
        return [c for c in chunks if self.path(c).exists()]

    def todo(self, chunks: Sequence[int]) -> list[int]:
        """The chunks whose shard is not written yet (a resumed run's work)."""
        return [c for c in chunks if not self.path(c).exists()]


def shard_path(out: Path, chunk: int) -> Path:
    """The collector's shard of chunk ``chunk``."""
    return Shards(out).path(chunk)


def legacy_shards(out: Path) -> list[Path]:
    """Shards named by an older ddte (``shard-i-of-N-c``): their chunks are not this version's chunks."""
    return [p for p in list_shards(out) if LEGACY_SHARD_NAME.fullmatch(p.name)]


LOCK_PREFIX = ".lock-"


@contextlib.contextmanager
def shard_lock(out: Path, shard: int, num_shards: int, command: str = "ddte collect") -> Iterator[None]:
    """Hold ``out/.lock-shard-i-of-N`` while this shard writes: ValueError when another run of ``command`` on the
    same shard (two runs on one --output, say) holds it. An flock: the system releases it when its process ends,
    killed or not, so a stale lock file never blocks a later run. Other shards of a split take other locks. Both
    collectors take it (``ddte collect``, ``ddte dense-labels``)."""
    import fcntl

    path = out / f"{LOCK_PREFIX}shard-{shard}-of-{num_shards}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise ValueError(f"another {command} is writing shard {shard}/{num_shards} of {out}: wait for it to "
                             "finish, or choose another --output") from err
        except OSError:  # a file system without locks: write as before, unguarded
            pass
        yield
        path.unlink(missing_ok=True)  # a finished shard leaves no lock file behind (still held: no one else has it)
    finally:
        os.close(fd)


def require_shards(folder: Path, what: str = "the data set") -> list[Path]:
    """The shards of a collected ``folder``; ValueError saying the data set is empty where it holds none (a collection
    that found no roots writes its metadata and no shard), rather than naming every column it lacks."""
    shards = list_shards(Path(folder))
    if not shards:
        raise ValueError(f"{folder}: {what} is empty (no {SHARD_GLOB}): its collection wrote no rows")
    return shards


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


ROOT_COLUMNS = {"prompt_id": "string", "sampling_index": "int32", "temperature": "float32", "top_p": "float32",
                "trajectory": "int32", "root_position": "int32", "seed": "int64"}


def write_shard(rows: list[dict], path: Path, label_columns: list[str]) -> None:
    """Write the collector's rows as one shard (:func:`write_rows`)."""
    lists = (*HIDDEN_NAMES, "scalars", "step_ms", "l1_by_depth", *label_columns)
    write_rows(rows, {**ROOT_COLUMNS, **{name: ["float32"] for name in lists}}, path)


def write_rows(rows: list[dict], columns: dict[str, str | list[str]], path: Path) -> None:
    """Write rows as one parquet file through ``datasets``, atomically (temporary name, then rename). ``columns``:
    each column's type, ``"float32"`` or ``["float32"]`` for a list of them."""
    from datasets import Dataset, Features, List, Value
    from datasets.utils import disable_progress_bars

    disable_progress_bars()  # one bar per shard write would interleave with (or defeat --no-progress of) ours
    features = {name: List(Value(kind[0])) if isinstance(kind, list) else Value(kind) for name, kind in columns.items()}
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


def link_json_once(path: Path, payload: dict) -> None:
    """Create the JSON file ``path`` whole unless it exists: the first worker's wins, whole (a hard link of a
    complete temporary, never a half-written file)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1)
        os.chmod(tmp, 0o644)
        os.link(tmp, path)  # fails if the file exists: the first worker's metadata wins
    except FileExistsError:
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write a text file whole (a temporary beside it, then a rename)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_metadata_once(out: Path, metadata: dict) -> dict:
    """Create ``dataset.json`` unless it exists; return the metadata on disk (another worker's if it won)."""
    link_json_once(out / METADATA_FILE, metadata)
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
