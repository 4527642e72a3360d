"""Running a collection's chunks: in this process, or in local worker processes that pull chunks from a queue.

Each chunk (the roots of some prompts) becomes one parquet shard (data_gen/store.py), so an interrupted run keeps
every finished chunk and ``--resume`` skips it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import sys
from dataclasses import dataclass
from pathlib import Path

from data_gen.config import CollectConfig
from data_gen.store import shard_path, write_shard
from ddte_core.signals import sigterm_as_interrupt
from decode.actions import parse_actions
from decode.pair import LoadedPair


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


def run_plan(plan: WorkPlan, pair: LoadedPair | None, progress: bool) -> int:
    """Collect the plan's chunks, in this process (pair given) or in ``config.workers`` processes."""
    from tqdm import tqdm

    limit = plan.metadata["context_limit"]
    bar = tqdm(total=plan.expected_roots(limit), unit="root", disable=not progress, file=sys.stderr,
               desc=f"collect {plan.shard}/{plan.num_shards}", smoothing=0.05)
    bar.refresh()  # shown at once, before the first (slow) root
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
    try:
        with sigterm_as_interrupt():  # a killed parent must take its workers down
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
        for proc in procs:
            if not clean and proc.is_alive():
                proc.terminate()
            proc.join(timeout=30)
    if errors:
        raise RuntimeError(f"a worker failed: {errors[0]}")
    return done


def _worker_main(plan: WorkPlan, index: int, tasks, queue) -> None:
    try:
        from data_gen.collect import load_collect_pair

        pair = load_collect_pair(plan.config)
        worker = _Worker(plan, pair)
        for c in iter(tasks.get, None):
            worker.chunk(c, lambda n: queue.put(("roots", n)))
        queue.put(("done", index))
    except Exception as err:  # reported to the parent, which exits cleanly with the message
        queue.put(("error", (index, f"{type(err).__name__}: {err}")))


class _Worker:
    """Holds a Collector and writes one shard per chunk."""

    def __init__(self, plan: WorkPlan, pair: LoadedPair) -> None:
        from data_gen.collect import Collector
        from decode.latency import LatencyTable
        from decode.verifiers import get_verifier

        config, meta = plan.config, plan.metadata
        self.plan = plan
        eos = pair.eos_token_id
        self.collector = Collector(
            pair.target, pair.draft, [get_verifier(v) for v in meta["verifiers"]],
            parse_actions(meta["actions"]), LatencyTable(**meta["latency"]),
            k_max=config.k_max, l_max=config.l_max, trees_per_root=config.trees_per_root,
            new_tokens=config.new_tokens, stride=config.stride, seed=config.seed,
            target_chunk=config.target_chunk, eos_token_id=eos,
        )
        self.labels = [*meta["label_columns"], *meta["acceptance_columns"], *meta["tree_columns"],
                       *meta["trunk_columns"]]

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
