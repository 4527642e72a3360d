"""Collect the selector's training set: for every root of sampled target trajectories, the root features and,
for every (K, L1, L2) action and verifier, the exact expected block efficiency Ê[τ+1] (mean over s sampled union
trees) and the latency model's step time T̂. Rows go to parquet shards in the output folder (docs/dataset.md).

  ddte collect --config configs/collect/default.yaml
  ddte collect --config configs/collect/default.yaml prompts.limit=20 trees_per_root=2 --output data/small
  ddte collect --config configs/collect/default.yaml --resume            # continue an interrupted run
  ddte collect --config configs/collect/default.yaml --shard 3/8          # worker 3 of 8 (one per GPU/node)

Any config key can be overridden as key=value (dotted for sections: prompts.limit=50,
sampling.temperatures=[0.6,1.0]). Many machines: run one `--shard i/N` per worker on a shared output folder,
e.g. a SLURM array (`--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT`) or torchrun
(`--shard $RANK/$WORLD_SIZE`); the first worker's dataset.json (and its latency table) is shared by all.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue as queue_module
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from data_gen.config import CollectConfig, config_to_dict, load_collect_config
from data_gen.schema import SCALAR_NAMES, SCHEMA_VERSION, acceptance_column, action_grid, action_key, label_column
from data_gen.store import (
    check_same_collection,
    list_shards,
    read_metadata,
    remove_stale_temporaries,
    shard_path,
    write_metadata_once,
    write_shard,
)
from ddte.cli import UserError

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "collect" / "default.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. prompts.limit=20")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="collect YAML (default: configs/collect/default)")
    parser.add_argument("--output", default=None, help="output folder (overrides the config's output)")
    parser.add_argument("--resume", action="store_true", help="continue a run in --output: skip finished shards")
    parser.add_argument("--shard", default="0/1", help="i/N: collect only prompts with index %% N == i (default 0/1)")
    parser.add_argument("--device", default=None, help="cpu, cuda or auto (overrides the config)")
    parser.add_argument("--dtype", default=None, help="auto, float32, bfloat16, float16 (overrides the config)")
    parser.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
    parser.add_argument("--workers", type=int, default=None, help="local worker processes (overrides the config)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    for key in ("output", "device", "dtype", "seed", "workers"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    try:
        config = load_collect_config(args.config, overrides)
        shard, num_shards = parse_shard(args.shard)
    except ValueError as err:
        raise UserError(str(err)) from err
    summary = collect(config, shard, num_shards, resume=args.resume, progress=not args.no_progress)
    print(summary.line())
    return 0


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as err:
        raise ValueError(f"--shard must be i/N with integers, got {text!r}") from err
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--shard i/N needs N >= 1 and 0 <= i < N, got {text!r}")
    return i, n


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


# --- setting up ---------------------------------------------------------------------------------------------
def collect(
    config: CollectConfig, shard: int = 0, num_shards: int = 1, resume: bool = False, progress: bool = True
) -> CollectSummary:
    """Run (or resume) the collection of this shard; returns what was done. Raises UserError on bad input."""
    start = time.perf_counter()
    out = Path(config.output)
    _prepare_output(out, resume)
    verifier_names = _check_verifiers(config.verifiers)
    pair = load_collect_pair(config)
    texts = _load_prompt_texts(config)
    prompts = _tokenize(pair, texts, config)
    metadata = _metadata(config, pair, verifier_names)
    metadata = write_metadata_once(out, metadata)  # the one on disk wins: its latency table labels every shard
    try:
        # dataset.json may predate this call (resume, another --shard worker, an emptied folder): it must match
        check_same_collection(metadata, config_to_dict(config))
    except ValueError as err:
        raise UserError(str(err)) from err
    mine = [i for i in range(len(prompts)) if i % num_shards == shard]
    chunks = [mine[j : j + config.prompts_per_shard] for j in range(0, len(mine), config.prompts_per_shard)]
    todo = [c for c, _ in enumerate(chunks) if not shard_path(out, shard, num_shards, c).exists()]
    plan = WorkPlan(config, metadata, prompts, chunks, todo, shard, num_shards)
    roots = run_plan(plan, pair if config.workers == 1 else None, progress)
    return CollectSummary(out, roots, len(todo), len(chunks) - len(todo), time.perf_counter() - start)


def _prepare_output(out: Path, resume: bool) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".tmp-write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise UserError(f"cannot write to the output folder {out} ({err.strerror or err})") from err
    remove_stale_temporaries(out)
    if list_shards(out) and not resume:
        raise UserError(f"{out} already holds shards: pass --resume to continue that run, or choose another --output")


def _check_verifiers(names: list[str]) -> list[str]:
    from decode.verifiers import get_verifier

    out = []
    for name in names:
        try:
            verifier = get_verifier(name)
        except KeyError as err:
            raise UserError(str(err).strip("'\"")) from err
        if verifier.name == "rsd":
            raise UserError("verifier 'rsd' drafts without-replacement trees, which union trees do not sample")
        out.append(verifier.name)
    if len(set(out)) != len(out):
        raise UserError(f"verifiers are listed twice: {names}")
    return out


def load_collect_pair(config: CollectConfig):
    """Both models as CachedLMs in the config's device/dtype, the tokenizer and the pair's paths."""
    import torch

    from decode.models import CachedLM, check_same_vocab, load_causal_lm
    from decode.pair import find_tokenizer, read_pair_config, resolve_device

    try:
        paths = read_pair_config(config.pair)
        dev = resolve_device(config.device)
        dtype = _dtype(config.dtype, dev)
        target = CachedLM(load_causal_lm(paths["target"], dev, dtype), dev, dtype)
        draft = CachedLM(load_causal_lm(paths["draft"], dev, dtype), dev, dtype)
        check_same_vocab(target.config, draft.config)
        tokenizer = find_tokenizer(Path(paths["target"]), paths.get("tokenizer"))
    except ValueError as err:
        raise UserError(f"pair: {err}") from err
    if tokenizer is None:
        raise UserError("pair: no tokenizer found (set tokenizer: in the pair config)")
    if config.threads:
        torch.set_num_threads(config.threads)
    return _Pair(target, draft, tokenizer, paths)


@dataclass
class _Pair:
    target: object
    draft: object
    tokenizer: object
    paths: dict


def _dtype(name: str, device):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _load_prompt_texts(config: CollectConfig) -> list[str]:
    from ddte.pair.prompts import build_prompts, load_prompts

    spec = config.prompts
    if spec.limit is not None and spec.limit < 1:
        raise UserError(f"prompts.limit must be at least 1, got {spec.limit}")
    if spec.source.startswith("builtin:"):
        split = spec.source.split(":", 1)[1]
        try:
            texts = [r["prompt"] for r in build_prompts(count=spec.limit or 10**6, split=split)]
        except ValueError as err:
            raise UserError(f"prompts.source: {err}") from err
    elif spec.source.startswith("hf:"):
        texts = _hub_prompts(spec.source[3:], spec.split, spec.field, spec.limit)
    else:
        texts = load_prompts(spec.source, field=spec.field, limit=spec.limit)
    if not texts:
        raise UserError(f"no prompts from {spec.source}")
    return texts


def _hub_prompts(name: str, split: str, field: str, limit: int | None) -> list[str]:
    from datasets import load_dataset

    try:
        data = load_dataset(name, split=split)
    except Exception as err:  # datasets raises many types; offline misses are the usual cause
        where = f"data set {name!r} split {split!r}"
        raise UserError(f"cannot load {where} (offline, it must be in the HF cache): {err}") from err
    if field not in data.column_names:
        raise UserError(f"data set {name!r} has no field {field!r} (fields: {', '.join(data.column_names)})")
    texts = [str(x) for x in data[field][: limit or len(data)]]
    if not texts:
        raise UserError(f"data set {name!r} split {split!r} is empty")
    return texts


def _tokenize(pair: _Pair, texts: list[str], config: CollectConfig) -> list[list[int]]:
    ids = [list(pair.tokenizer(t)["input_ids"])[-config.prompts.max_tokens :] for t in texts]
    limit = min(pair.target.config.max_position_embeddings, pair.draft.config.max_position_embeddings)
    if config.prompts.max_tokens + 2 * config.l_max + 2 > limit:
        raise UserError(
            f"prompts.max_tokens ({config.prompts.max_tokens}) + a 2·l_max tree leaves no room in the models' "
            f"{limit}-token context"
        )
    if not any(len(x) >= 2 for x in ids):
        raise UserError("every prompt is shorter than 2 tokens")
    return ids


def _metadata(config: CollectConfig, pair: _Pair, verifiers: list[str]) -> dict:
    import datasets
    import torch
    import transformers

    from ddte import __version__

    latency = collect_latency(config, pair)
    from decode.pair import pair_fingerprint

    paths = {k: Path(v) for k, v in pair.paths.items()}
    device = pair.target.device
    return {
        "schema_version": SCHEMA_VERSION,
        "actions": [action_key(a) for a in action_grid(config.k_max, config.l_max)],
        "k_max": config.k_max,
        "l_max": config.l_max,
        "verifiers": verifiers,
        "label_columns": [label_column(v) for v in verifiers],
        "acceptance_columns": [acceptance_column(v) for v in verifiers if _is_top_down(v)],
        "scalar_names": list(SCALAR_NAMES),
        "hidden_sizes": {
            "target_hidden_prev": int(pair.target.config.hidden_size),
            "draft_hidden_prev": int(pair.draft.config.hidden_size),
            "draft_hidden_root": int(pair.draft.config.hidden_size),
        },
        "pair": {
            "fingerprint": pair_fingerprint(paths["target"], paths["draft"], paths.get("tokenizer")),
            "target": str(paths["target"]),
            "draft": str(paths["draft"]),
            "vocab_size": int(pair.target.vocab_size),
        },
        "sampling": [{"temperature": t, "top_p": p} for t, p in _sampling_grid(config)],
        "trees_per_root": config.trees_per_root,
        "stride": config.stride,
        "trajectories": config.trajectories,
        "new_tokens": config.new_tokens,
        "seed": config.seed,
        "context_limit": min(pair.target.config.max_position_embeddings, pair.draft.config.max_position_embeddings),
        "latency": latency.__dict__,
        "versions": {
            "ddte": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
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


def _is_top_down(name: str) -> bool:
    from decode.labels import is_top_down
    from decode.verifiers import get_verifier

    return is_top_down(get_verifier(name))


def collect_latency(config: CollectConfig, pair: _Pair | None):
    """The config's latency table: read from ``latency.file`` (no pair needed), else measured on ``pair``."""
    from decode.latency import LatencyTable, measure_latency

    grid = config.latency
    if grid.file:
        try:
            return LatencyTable.from_json(Path(grid.file).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError) as err:
            raise UserError(f"latency.file {grid.file}: not a readable latency table ({err})") from err
    largest_tree = 1 + config.l_max + config.k_max * config.l_max  # the root, a full trunk and K full branches
    return measure_latency(pair.target, pair.draft, lengths=grid.lengths, sizes=grid.sizes, repeats=grid.repeats,
                           max_size=largest_tree)


def _sampling_grid(config: CollectConfig) -> list[tuple[float, float]]:
    return [(t, p) for t in config.sampling.temperatures for p in config.sampling.top_ps]


# --- the work -------------------------------------------------------------------------------------------------
@dataclass
class WorkPlan:
    """What one invocation collects: chunks of prompt indices, which of them are still to do."""

    config: CollectConfig
    metadata: dict
    prompts: list[list[int]]
    chunks: list[list[int]]
    todo: list[int]
    shard: int
    num_shards: int

    def expected_roots(self, context_limit: int) -> int:
        from data_gen.collect import root_positions

        per = len(self.metadata["sampling"]) * self.config.trajectories
        n = 0
        for c in self.todo:
            for i in self.chunks[c]:
                if len(self.prompts[i]) >= 2:
                    n += per * len(root_positions(len(self.prompts[i]), self.config, context_limit))
        return n


def run_plan(plan: WorkPlan, pair: _Pair | None, progress: bool) -> int:
    """Collect the plan's chunks, in this process (pair given) or in ``config.workers`` processes."""
    from tqdm import tqdm

    limit = plan.metadata.get("context_limit")
    if pair is not None:
        limit = min(pair.target.config.max_position_embeddings, pair.draft.config.max_position_embeddings)
    bar = tqdm(total=plan.expected_roots(limit or 1 << 30), unit="root", disable=not progress, file=sys.stderr,
               desc=f"collect {plan.shard}/{plan.num_shards}", smoothing=0.05)
    done = 0
    if pair is not None:
        worker = _Worker(plan, pair)
        for c in plan.todo:
            done += worker.chunk(c, bar.update)
    else:
        done = _run_processes(plan, bar)
    bar.total = done
    bar.refresh()
    bar.close()
    return done


def _run_processes(plan: WorkPlan, bar) -> int:
    ctx = mp.get_context("spawn")
    queue, tasks = ctx.Queue(), ctx.Queue()
    n = plan.config.workers
    # Workers pull chunks as they free up, so uneven chunks (prompts of different lengths, early EOS) and a
    # chunk count that is not a multiple of the worker count leave no core idle until the last chunk.
    for c in plan.todo:
        tasks.put(c)
    for _ in range(n):
        tasks.put(None)
    procs = [ctx.Process(target=_worker_main, args=(plan, w, tasks, queue), daemon=True) for w in range(n)]
    for proc in procs:
        proc.start()
    done, finished, errors = 0, set(), []
    clean = False
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed parent must take its workers down
    try:
        while len(finished) < n:
            try:
                kind, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                # A worker that died without a word (killed, out of memory) must not leave us waiting forever.
                dead = [w for w, p in enumerate(procs) if w not in finished and p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"worker {dead[0]} exited with code {procs[dead[0]].exitcode}")
                    break
                continue
            if kind == "roots":
                done += value
                bar.update(value)
            elif kind == "error":
                errors.append(value[1])
                finished.add(value[0])
            else:
                finished.add(value)
        clean = not errors
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if not clean and proc.is_alive():
                proc.terminate()
            proc.join(timeout=30)
    if errors:
        raise UserError(f"a worker failed: {errors[0]}")
    return done


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _worker_main(plan: WorkPlan, index: int, tasks, queue) -> None:
    try:
        pair = load_collect_pair(plan.config)
        worker = _Worker(plan, pair)
        for c in iter(tasks.get, None):
            worker.chunk(c, lambda n: queue.put(("roots", n)))
        queue.put(("done", index))
    except Exception as err:  # reported to the parent, which exits cleanly with the message
        queue.put(("error", (index, f"{type(err).__name__}: {err}")))


class _Worker:
    """Holds a Collector and writes one shard per chunk."""

    def __init__(self, plan: WorkPlan, pair: _Pair) -> None:
        from data_gen.collect import Collector
        from decode.latency import LatencyTable
        from decode.verifiers import get_verifier

        config, meta = plan.config, plan.metadata
        self.plan = plan
        eos = getattr(pair.tokenizer, "eos_token_id", None)
        self.collector = Collector(
            pair.target, pair.draft, [get_verifier(v) for v in meta["verifiers"]],
            action_grid(config.k_max, config.l_max), LatencyTable(**meta["latency"]),
            k_max=config.k_max, l_max=config.l_max, trees_per_root=config.trees_per_root,
            new_tokens=config.new_tokens, stride=config.stride, seed=config.seed,
            target_chunk=config.target_chunk, eos_token_id=eos,
        )
        self.labels = list(meta["label_columns"]) + list(meta["acceptance_columns"])

    def chunk(self, c: int, report) -> int:
        from data_gen.collect import TrajectoryJob
        from decode.sampling import SamplingConfig

        plan = self.plan
        rows = []
        for i in plan.chunks[c]:
            if len(plan.prompts[i]) < 2:
                continue
            for s, conf in enumerate(plan.metadata["sampling"]):
                sampling = SamplingConfig(conf["temperature"], conf["top_p"])
                for t in range(plan.config.trajectories):
                    got = self.collector.trajectory_rows(TrajectoryJob(i, plan.prompts[i], s, sampling, t))
                    rows.extend(got)
                    report(len(got))
        if rows:
            write_shard(rows, shard_path(Path(plan.config.output), plan.shard, plan.num_shards, c), self.labels)
        return len(rows)


__all__ = ["collect", "read_metadata", "add_arguments", "run"]
