"""One collection job: for every root of sampled target trajectories, the root features and, for every (K, L1, L2)
action and verifier, the exact Ê[τ+1] of each sampled union tree and the latency model's step time T̂. Rows go
to parquet shards in the output folder (docs/dataset.md).

:func:`collect` is the driver. It checks the output folder, loads only the tokenizer (the pairs load where the work
runs: data_gen/workers.py, data_gen/ray_pool.py), plans the chunks of this ``shard`` of ``num_shards``, creates the
folder, writes (or checks) ``dataset.json`` once and runs the chunks. Every problem with the input is a ValueError
with a one-line message, raised before any shard is written.

Chunks are global (chunk c: prompts c·prompts_per_shard onwards) and shard ``i`` of ``N`` takes the chunks with
c % N == i, so a chunk's shard has the same name and rows whoever collects it: ``--resume`` skips finished chunks with
any number of workers or shards. The latency table comes from ``latency.file``, or is measured once: by the first
worker of shard 0, while the other shards wait for its ``dataset.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from data_gen.config import CollectConfig, config_to_dict
from data_gen.prompts import load_prompt_texts
from data_gen.schema import (
    METADATA_FILE,
    SCHEMA_VERSION,
    TRUNK_COLUMNS,
    TRUNK_DRAW_COLUMNS,
    TRUNK_STATE_COLUMNS,
    acceptance_column,
    label_column,
    trees_column,
)
from data_gen.store import (
    LOCK_PREFIX,
    Shards,
    check_same_collection,
    check_writable,
    legacy_shards,
    list_shards,
    read_metadata,
    remove_stale_temporaries,
    shard_chunks,
    shard_lock,
    write_metadata_once,
)
from data_gen.workers import InProcess, Processes, WorkPlan, run_plan
from ddte_core.paths import refuse_file_in_the_way
from ddte_core.signals import sigterm_as_interrupt
from decode.cost.table import LatencyTable
from decode.drafting.actions import action_grid
from decode.policies.features import SCALAR_NAMES

METADATA_WAIT_S = 1800.0  # how long a shard waits for shard 0's dataset.json (and its latency table)


@dataclass
class CollectSummary:
    output: Path
    roots: int
    shards_written: int
    shards_skipped: int
    seconds: float

    def line(self) -> str:
        rate = self.roots / self.seconds if self.seconds > 0 else 0.0
        return (
            f"collected {self.roots} roots in {self.seconds:.1f} s ({rate:.2f} roots/s); "
            f"{self.shards_written} shards written, {self.shards_skipped} already there; output {self.output}"
        )


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> (i, N); ValueError unless N >= 1 and 0 <= i < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as err:
        raise ValueError(f"--shard must be i/N with integers, got {text!r}") from err
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--shard i/N needs N >= 1 and 0 <= i < N, got {text!r}")
    return i, n


def collect(
    config: CollectConfig, shard: int = 0, num_shards: int = 1, resume: bool = False, progress: bool = True
) -> CollectSummary:
    """Run (or resume) the collection of this shard; returns what was done.

    Raises:
        ValueError: bad verifiers, pair, prompts or output folder, a folder holding another collection, or
            ``engine: ray`` without Ray installed.
        RuntimeError: a worker failed.
    """
    start = time.perf_counter()
    out = Path(config.output)
    if config.engine == "ray":
        from data_gen.ray_pool import import_ray

        import_ray()  # how to install it, before any work
    verifiers = check_verifiers(config.verifiers)
    check_output(out, resume)
    existing = read_metadata(out) if (out / METADATA_FILE).is_file() else None
    if existing is not None:  # resume, another --shard worker, an emptied folder: it must be this collection
        check_same_collection(existing, config_to_dict(config))
    tokenizer, train_prompts = load_tokenizer(config)
    texts = load_prompt_texts(config.prompts.source or train_prompts, config.prompts.field, config.prompts.limit,
                              config.prompts.split, tokenizer)
    prompts = tokenize_prompts(tokenizer, texts, config)
    chunks = [list(range(j, min(j + config.prompts_per_shard, len(prompts))))
              for j in range(0, len(prompts), config.prompts_per_shard)]
    mine = shard_chunks(len(prompts), config.prompts_per_shard, (shard, num_shards))
    todo = Shards(out).todo(mine)
    if not resume and len(todo) < len(mine):
        raise ValueError(f"{out} already holds shards: pass --resume to continue that run, or choose another --output")
    if existing is not None and not todo:  # all done: no pair to load, no worker to start
        return CollectSummary(out, 0, 0, len(mine), time.perf_counter() - start)
    latency = read_latency_file(config)
    measure = latency is None and existing is None and shard == 0  # the table is measured once per collection
    # a worker per chunk at most: more would each load the pair and find nothing to do
    engine_config = dataclasses.replace(config, workers=min(config.workers, len(todo)))
    with contextlib.ExitStack() as stack, sigterm_as_interrupt(), open_engine(engine_config, measure) as engine:
        # a kill stops the workers too; the shard's lock is released last
        facts = engine.facts()
        check_context(config, facts["context_limit"])
        create_output(out)  # only now: a refused collection leaves no folder behind
        stack.enter_context(shard_lock(out, shard, num_shards))
        if not resume and Shards(out).written(todo):  # the holder before us finished them
            raise ValueError(f"{out} already holds shards: pass --resume to continue that run, or choose another "
                             "--output")
        if latency is None and existing is None and not measure:
            metadata = wait_for_metadata(out)
        else:
            table = latency or (LatencyTable(**facts["latency"]) if facts["latency"] else None)
            # the one on disk wins: its latency table labels every shard of every worker
            metadata = existing or write_metadata_once(out, dataset_metadata(config, facts, verifiers, table))
        check_same_collection(metadata, config_to_dict(config))
        plan = WorkPlan(config, metadata, prompts, chunks, todo, f"collect {shard}/{num_shards}")
        roots = run_plan(engine, plan, progress)
    check_some_rows(out, config, len(prompts))
    written = len(Shards(out).written(todo))  # a chunk whose trajectories reached no root writes no shard
    return CollectSummary(out, roots, written, len(mine) - len(todo), time.perf_counter() - start)


def check_some_rows(out: Path, config: CollectConfig, prompts: int) -> None:
    """ValueError where the collection in ``out`` holds no shard once this run is done: it found no root, and an
    empty data set must not pass for a collected one."""
    if not list_shards(out):
        raise ValueError(f"collected no roots from {prompts} prompts: no shard written, {out} holds only its "
                         f"metadata (every trajectory ended before its first root: prompts under 2 tokens, or "
                         f"new_tokens {config.new_tokens} against roots every {config.stride} "
                         f"{'steps' if config.roots == 'steps' else 'tokens'}); remove it or choose another --output, "
                         "then collect with more new_tokens or a shorter stride")


def open_engine(config: CollectConfig, measure: bool):
    """The engine of ``config`` (``engine``, ``workers``; data_gen/workers.py, data_gen/ray_pool.py), its pairs
    loading; ``measure``: its first worker measures the latency table for its ``facts()``."""
    if config.engine == "ray":
        from data_gen.ray_pool import RayPool

        return RayPool(config, measure)
    return InProcess(config, measure) if config.workers == 1 else Processes(config, measure)


def check_output(out: Path, resume: bool) -> None:
    """The output must be new, empty, or hold this data set (``resume``); never a folder with foreign files or an
    older ddte's shard names."""
    refuse_file_in_the_way(out)
    existing = [p for p in out.iterdir() if not p.name.startswith((".tmp-", LOCK_PREFIX))] if out.is_dir() else []
    if existing and not (out / METADATA_FILE).is_file():
        raise ValueError(f"{out} is not empty and holds no data set ({METADATA_FILE}): choose an empty or new "
                         "--output")
    if legacy_shards(out):
        raise ValueError(f"{out} holds shards named by an older ddte (shard-i-of-N-c): finish it with that version, "
                         "or collect into a new --output")


def create_output(out: Path) -> None:
    """Create the output folder (if new), check it is writable, drop an interrupted run's temporaries (never those of
    a worker writing beside this one)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        check_writable(out)
    except OSError as err:
        raise ValueError(f"cannot write to the output folder {out} ({err.strerror or err})") from err
    remove_stale_temporaries(out)


def wait_for_metadata(out: Path, timeout_s: float = METADATA_WAIT_S, poll_s: float = 1.0) -> dict:
    """``dataset.json`` once shard 0 has written it with the latency table it measured (one line on stderr says
    so); RuntimeError after ``timeout_s``."""
    path = out / METADATA_FILE
    print(f"waiting for shard 0 to write {path}: it measures the latency table once for every shard "
          "(latency.file=TABLE.json skips the wait)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    while not path.is_file():  # linked into place whole (data_gen/store.py): never read half-written
        if time.monotonic() > deadline:
            raise RuntimeError(f"shard 0 has not written {path} in {timeout_s / 60:.0f} min: start shard 0, or give "
                               "every shard latency.file=TABLE.json")
        time.sleep(poll_s)
    return read_metadata(out)


def check_verifiers(names: list[str]) -> list[str]:
    """The verifiers' canonical names; ValueError for an unknown one, a repeat, or one union trees cannot label."""
    from decode.verifiers import LabelRule, get_verifier

    out = []
    for name in names:
        try:
            verifier = get_verifier(name)
        except KeyError as err:
            raise ValueError(err.args[0]) from err
        if verifier.label_rule == LabelRule.NONE:
            raise ValueError(f"verifier '{verifier.name}' drafts {verifier.draft_regime.value} trees, which union "
                             "trees do not sample")
        out.append(verifier.name)
    if len(set(out)) != len(out):
        raise ValueError(f"verifiers are listed twice: {names}")
    return out


def load_tokenizer(config: CollectConfig):
    """(tokenizer, the pair's training prompt source): all the driver loads of the pair.

    Raises:
        ValueError: a bad pair config, a fetched target not there, or no tokenizer (prompts are text).
    """
    from decode.pair import find_tokenizer, read_pair_config

    try:
        spec = read_pair_config(config.pair)
        spec.check_available()
        tokenizer = find_tokenizer(spec.target, spec.tokenizer)
    except ValueError as err:
        raise ValueError(f"pair: {err}") from err
    if tokenizer is None:
        raise ValueError("pair: no tokenizer found (set tokenizer: in the pair config)")
    return tokenizer, spec.train_prompts


def tokenize_prompts(tokenizer, texts: list[str], config: CollectConfig) -> list[list[int]]:
    """Token ids of each prompt, left-truncated to ``prompts.max_tokens``."""
    ids = [list(tokenizer(t)["input_ids"])[-config.prompts.max_tokens :] for t in texts]
    if not any(len(x) >= 2 for x in ids):
        raise ValueError("every prompt is shorter than 2 tokens")
    return ids


def check_context(config: CollectConfig, context_limit: int) -> None:
    """ValueError unless the longest prompt and a 2·l_max tree fit the models' context, and new_tokens could be
    reached in it (else it would be cut to the context without a word)."""
    if config.prompts.max_tokens + 2 * config.l_max + 2 > context_limit:
        raise ValueError(
            f"prompts.max_tokens ({config.prompts.max_tokens}) + a 2·l_max tree leaves no room in the models' "
            f"{context_limit}-token context"
        )
    longest = context_limit - 2 * config.l_max - 2  # roots stop where a 2·l_max tree would overrun the context
    if config.new_tokens > longest:
        raise ValueError(f"new_tokens ({config.new_tokens}) cannot be reached in the models' {context_limit}-token "
                         f"context, where a trajectory's roots end {2 * config.l_max + 2} tokens before its end: "
                         f"at most {longest}")


def dataset_metadata(config: CollectConfig, facts: dict, verifiers: list[str], latency: LatencyTable) -> dict:
    """``dataset.json``: the contract of docs/dataset.md, with the latency table and provenance (``facts``: what a
    worker reported of the pair and its machine, data_gen.collector.pair_facts)."""
    from decode.verifiers import LabelRule, get_verifier

    return {
        "schema_version": SCHEMA_VERSION,
        "actions": [a.key for a in action_grid(config.k_max, config.l_max)],
        "k_max": config.k_max,
        "l_max": config.l_max,
        "verifiers": verifiers,
        "label_columns": [label_column(v) for v in verifiers],
        "tree_columns": [trees_column(v) for v in verifiers],
        "trunk_columns": [*TRUNK_COLUMNS, *TRUNK_STATE_COLUMNS, *TRUNK_DRAW_COLUMNS],
        "acceptance_columns": [acceptance_column(v) for v in verifiers
                               if get_verifier(v).label_rule == LabelRule.REACH],
        "scalar_names": list(SCALAR_NAMES),
        "hidden_sizes": facts["hidden_sizes"],
        "pair": facts["pair"],
        "sampling": [{"temperature": t, "top_p": p} for t in config.sampling.temperatures
                     for p in config.sampling.top_ps],
        "trees_per_root": config.trees_per_root,
        "stride": config.stride,
        "roots": config.roots,
        "reference_trunk": config.reference_trunk,
        "trajectories": config.trajectories,
        "new_tokens": config.new_tokens,
        "seed": config.seed,
        "context_limit": facts["context_limit"],
        "latency": latency.__dict__,
        "versions": facts["versions"],
        "hardware": facts["hardware"],
        "config": config_to_dict(config),
    }


def read_latency_file(config: CollectConfig) -> LatencyTable | None:
    """The table of ``latency.file`` (None when the config has none)."""
    path = config.latency.file
    if not path:
        return None
    try:
        return LatencyTable.from_json(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"latency.file {path}: not a readable latency table ({err})") from err


def collect_latency(config: CollectConfig, pair) -> LatencyTable:
    """The config's latency table: read from ``latency.file`` (no pair needed), else measured on ``pair``."""
    from data_gen.collector import measure_collect_latency

    return read_latency_file(config) or measure_collect_latency(config, pair)
