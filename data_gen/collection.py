"""One collection job: for every root of sampled target trajectories, the root features and, for every (K, L1, L2)
action and verifier, the exact Ê[τ+1] of each sampled union tree and the latency model's step time T̂. Rows go
to parquet shards in the output folder (docs/dataset.md).

:func:`collect` prepares the output folder, writes (or checks) ``dataset.json``, plans the chunks of this
``shard`` of ``num_shards`` and runs them (data_gen/workers.py). Every problem with the input is a ValueError with a
one-line message, raised before any shard is written.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from data_gen.collect import load_collect_pair
from data_gen.config import CollectConfig, config_to_dict
from data_gen.prompts import load_prompt_texts
from data_gen.schema import (
    METADATA_FILE,
    SCHEMA_VERSION,
    TRUNK_COLUMNS,
    TRUNK_STATE_COLUMNS,
    acceptance_column,
    label_column,
    trees_column,
)
from data_gen.store import (
    check_same_collection,
    list_shards,
    remove_stale_temporaries,
    shard_path,
    write_metadata_once,
)
from data_gen.workers import WorkPlan, run_plan
from ddte_core.paths import refuse_file_in_the_way
from decode.actions import action_grid
from decode.features import SCALAR_NAMES
from decode.latency import LatencyTable
from decode.pair import LoadedPair


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
        ValueError: bad verifiers, pair, prompts or output folder, or a folder holding another collection.
        RuntimeError: a worker process failed.
    """
    start = time.perf_counter()
    out = Path(config.output)
    verifiers = check_verifiers(config.verifiers)
    check_output(out, resume)
    pair = load_collect_pair(config)
    source = config.prompts.source or pair.train_prompts
    texts = load_prompt_texts(source, config.prompts.field, config.prompts.limit, config.prompts.split, pair.tokenizer)
    prompts = tokenize_prompts(pair, texts, config)
    create_output(out)  # only now: a refused collection leaves no folder behind
    # the one on disk wins: its latency table labels every shard of every worker
    metadata = write_metadata_once(out, dataset_metadata(config, pair, verifiers))
    # dataset.json may predate this call (resume, another --shard worker, an emptied folder): it must match
    check_same_collection(metadata, config_to_dict(config))
    mine = [i for i in range(len(prompts)) if i % num_shards == shard]
    chunks = [mine[j : j + config.prompts_per_shard] for j in range(0, len(mine), config.prompts_per_shard)]
    todo = [c for c, _ in enumerate(chunks) if not shard_path(out, shard, num_shards, c).exists()]
    plan = WorkPlan(config, metadata, prompts, chunks, todo, shard, num_shards)
    roots = run_plan(plan, pair if config.workers == 1 else None, progress)
    return CollectSummary(out, roots, len(todo), len(chunks) - len(todo), time.perf_counter() - start)


def check_output(out: Path, resume: bool) -> None:
    """The output must be new, empty, or hold this data set (``resume``); never a folder with foreign files."""
    refuse_file_in_the_way(out)
    existing = [p for p in out.iterdir() if not p.name.startswith(".tmp-")] if out.is_dir() else []
    if existing and not (out / METADATA_FILE).is_file():
        raise ValueError(f"{out} is not empty and holds no data set ({METADATA_FILE}): choose an empty or new "
                         "--output")
    if list_shards(out) and not resume:
        raise ValueError(f"{out} already holds shards: pass --resume to continue that run, or choose another --output")


def create_output(out: Path) -> None:
    """Create the output folder (if new), check it is writable, drop an interrupted run's temporaries."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".tmp-write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write to the output folder {out} ({err.strerror or err})") from err
    remove_stale_temporaries(out)


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


def tokenize_prompts(pair: LoadedPair, texts: list[str], config: CollectConfig) -> list[list[int]]:
    """Token ids of each prompt, left-truncated to ``prompts.max_tokens``."""
    ids = [list(pair.tokenizer(t)["input_ids"])[-config.prompts.max_tokens :] for t in texts]
    if config.prompts.max_tokens + 2 * config.l_max + 2 > pair.context_limit:
        raise ValueError(
            f"prompts.max_tokens ({config.prompts.max_tokens}) + a 2·l_max tree leaves no room in the models' "
            f"{pair.context_limit}-token context"
        )
    if not any(len(x) >= 2 for x in ids):
        raise ValueError("every prompt is shorter than 2 tokens")
    return ids


def dataset_metadata(config: CollectConfig, pair: LoadedPair, verifiers: list[str]) -> dict:
    """``dataset.json``: the contract of docs/dataset.md, with the latency table and provenance."""
    import datasets
    import torch
    import transformers

    from decode.verifiers import LabelRule, get_verifier

    latency = collect_latency(config, pair)
    device = pair.target.device
    return {
        "schema_version": SCHEMA_VERSION,
        "actions": [a.key for a in action_grid(config.k_max, config.l_max)],
        "k_max": config.k_max,
        "l_max": config.l_max,
        "verifiers": verifiers,
        "label_columns": [label_column(v) for v in verifiers],
        "tree_columns": [trees_column(v) for v in verifiers],
        "trunk_columns": [*TRUNK_COLUMNS, *TRUNK_STATE_COLUMNS],
        "acceptance_columns": [acceptance_column(v) for v in verifiers
                               if get_verifier(v).label_rule == LabelRule.REACH],
        "scalar_names": list(SCALAR_NAMES),
        "hidden_sizes": pair.hidden_sizes,
        "pair": {
            "fingerprint": pair.fingerprint(),
            "target": str(pair.paths["target"]),
            "draft": str(pair.paths["draft"]),
            "vocab_size": int(pair.target.vocab_size),
        },
        "sampling": [{"temperature": t, "top_p": p} for t in config.sampling.temperatures
                     for p in config.sampling.top_ps],
        "trees_per_root": config.trees_per_root,
        "stride": config.stride,
        "trajectories": config.trajectories,
        "new_tokens": config.new_tokens,
        "seed": config.seed,
        "context_limit": pair.context_limit,
        "latency": latency.__dict__,
        "versions": {
            "ddte": package_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "datasets": datasets.__version__, "python": platform.python_version(),
        },
        "hardware": {
            "device": str(device), "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": str(pair.target.dtype).replace("torch.", ""),
        },
        "config": config_to_dict(config),
    }


def package_version() -> str:
    """The installed ddte distribution's version ("unknown" when run from an uninstalled tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddte")
    except PackageNotFoundError:
        return "unknown"


def collect_latency(config: CollectConfig, pair: LoadedPair | None) -> LatencyTable:
    """The config's latency table: read from ``latency.file`` (no pair needed), else measured on ``pair``."""
    from decode.latency import measure_latency

    grid = config.latency
    if grid.file:
        try:
            return LatencyTable.from_json(Path(grid.file).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"latency.file {grid.file}: not a readable latency table ({err})") from err
    largest_tree = 1 + config.l_max + config.k_max * config.l_max  # the root, a full trunk and K full branches
    return measure_latency(pair.target, pair.draft, lengths=grid.lengths, sizes=grid.sizes, repeats=grid.repeats,
                           max_size=largest_tree)
