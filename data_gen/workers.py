"""Running a collection's chunks: the engines.

An engine loads the pair where the work runs (the driver loads only the tokenizer), reports what ``dataset.json``
records of it from one worker (which measures the latency table when asked: once per collection), then runs the
plan's chunks, one shard each (data_gen/store.py), so an interrupted run keeps every finished chunk and
``--resume`` skips it:

* :class:`InProcess`: this process (``workers: 1``);
* :class:`Processes`: ``workers`` local processes that pull chunks from a queue;
* the actor pool of data_gen/ray_pool.py on a Ray cluster (``engine: ray``), built on :class:`ChunkWorker`.

The driver (data_gen/collection.py, ``open_engine``) picks one.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue as queue_module
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from data_gen.config import CollectConfig
from data_gen.store import shard_path, write_shard
from decode.drafting.actions import parse_actions
from decode.pair import LoadedPair


@dataclass
class WorkPlan:
    """What one invocation collects: chunks of prompt indices (global: the same for any worker count), which of
    them are still to do."""

    config: CollectConfig
    metadata: dict
    prompts: list[list[int]]
    chunks: list[list[int]]
    todo: list[int]
    label: str = "collect"

    def expected_roots(self, context_limit: int) -> int:
        """The progress bar's total: exact for position roots; for step roots an estimate, each reference step
        taken as halfway between one token and a full trunk and its bonus."""
        from data_gen.collector import root_positions

        spec = self.config
        if spec.roots == "steps":
            spec = dataclasses.replace(spec, stride=max(1, round(spec.stride * (spec.reference_trunk + 2) / 2)))
        per = len(self.metadata["sampling"]) * self.config.trajectories
        n = 0
        for c in self.todo:
            for i in self.chunks[c]:
                if len(self.prompts[i]) >= 2:
                    n += per * len(root_positions(len(self.prompts[i]), spec, context_limit))
        return n


def run_plan(engine, plan: WorkPlan, progress: bool) -> int:
    """Collect the plan's chunks on ``engine`` behind one progress bar; returns the roots collected."""
    from tqdm import tqdm

    bar = tqdm(total=plan.expected_roots(plan.metadata["context_limit"]), unit="root", disable=not progress,
               file=sys.stderr, desc=plan.label, smoothing=0.05)
    bar.refresh()  # shown at once, before the first (slow) root
    done = engine.run(plan, bar.update) if plan.todo else 0
    bar.total = done
    bar.refresh()
    bar.close()
    return done


class InProcess:
    """One worker: this process."""

    def __init__(self, config: CollectConfig, measure: bool) -> None:
        from data_gen.collector import load_collect_pair

        self.config, self.measure = config, measure
        self.pair = load_collect_pair(config)

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def facts(self) -> dict:
        from data_gen.collector import pair_facts

        return pair_facts(self.pair, self.config, self.measure)

    def run(self, plan: WorkPlan, report) -> int:
        worker = ChunkWorker(plan, self.pair)
        return sum(worker.chunk(c, report) for c in plan.todo)


class Processes:
    """``config.workers`` spawned processes, each loading the pair once. Worker 0 reports the facts; then every
    worker gets the plan and pulls chunks as it frees up, so uneven chunks (prompts of different lengths, early EOS)
    and a chunk count that is not a multiple of the worker count leave no core idle until the last chunk."""

    def __init__(self, config: CollectConfig, measure: bool) -> None:
        ctx = mp.get_context("spawn")
        self.results, self.tasks = ctx.Queue(), ctx.Queue()
        self.plans = [ctx.Queue() for _ in range(config.workers)]
        self.procs = [ctx.Process(target=_process_main,
                                  args=(config, w, measure and w == 0, self.plans[w], self.tasks, self.results),
                                  daemon=True)
                      for w in range(config.workers)]
        # Ctrl-C reaches the whole process group: the parent alone handles it (it stops the workers on the way out);
        # started with SIGINT ignored, a worker never prints its own KeyboardInterrupt traceback (even mid-import)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for proc in self.procs:
                proc.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        self.finished: set[int] = set()
        self.clean = False

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:  # after a failure, or a refusal before any chunk: stopped, not waited for
            if not self.clean and proc.is_alive():
                proc.terminate()
            proc.join(timeout=30)

    def _next(self) -> tuple[str, object]:
        """The next message of any worker; RuntimeError for a worker that failed or died without a word (killed,
        out of memory): the parent must not wait forever."""
        while True:
            try:
                kind, value = self.results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [w for w, p in enumerate(self.procs) if w not in self.finished and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a worker failed: worker {dead[0]} exited with code "
                                       f"{self.procs[dead[0]].exitcode}") from None
                continue
            if kind == "error":
                raise RuntimeError(f"a worker failed: {value[1]}")
            return kind, value

    def facts(self) -> dict:
        kind, value = self._next()
        if kind != "facts":  # worker 0 reports them before any worker gets a plan
            raise RuntimeError(f"a worker sent {kind!r} before the pair's facts")
        return value

    def run(self, plan: WorkPlan, report) -> int:
        for plans in self.plans:
            plans.put(plan)
        for c in plan.todo:
            self.tasks.put(c)
        for _ in self.procs:
            self.tasks.put(None)
        done = 0
        while len(self.finished) < len(self.procs):
            kind, value = self._next()
            if kind == "roots":
                done += value
                report(value)
            else:
                self.finished.add(value)
        self.clean = True
        return done


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _process_main(config: CollectConfig, index: int, measure: bool, plans, tasks, results) -> None:
    # the parent's terminate() (after Ctrl-C or a failure) unwinds the worker: a shard being written is removed and
    # multiprocessing's exit handlers release the semaphores its libraries made (else: a "leaked semaphore" warning)
    signal.signal(signal.SIGTERM, _stop)
    try:
        from data_gen.collector import load_collect_pair, pair_facts

        pair = load_collect_pair(config)
        if index == 0:
            results.put(("facts", pair_facts(pair, config, measure)))
        worker = ChunkWorker(plans.get(), pair)
        for c in iter(tasks.get, None):
            worker.chunk(c, lambda n: results.put(("roots", n)))
        results.put(("done", index))
    except Exception as err:  # reported to the parent, which exits cleanly with the message
        results.put(("error", (index, f"{type(err).__name__}: {err}")))


class ChunkWorker:
    """Holds a Collector and writes one shard per chunk."""

    def __init__(self, plan: WorkPlan, pair: LoadedPair) -> None:
        from data_gen.collector import Collector
        from decode.cost.table import LatencyTable
        from decode.verifiers import get_verifier

        config, meta = plan.config, plan.metadata
        self.plan = plan
        eos = pair.eos_token_id
        self.collector = Collector(
            pair.target, pair.draft, [get_verifier(v) for v in meta["verifiers"]],
            parse_actions(meta["actions"]), LatencyTable(**meta["latency"]),
            k_max=config.k_max, l_max=config.l_max, trees_per_root=config.trees_per_root,
            new_tokens=config.new_tokens, stride=config.stride, seed=config.seed,
            target_chunk=config.target_chunk, eos_token_id=eos, roots=config.roots,
            reference_trunk=config.reference_trunk,
        )
        self.labels = [*meta["label_columns"], *meta["acceptance_columns"], *meta["tree_columns"],
                       *meta["trunk_columns"]]

    def chunk(self, c: int, report) -> int:
        """Collect chunk ``c`` and write its shard (none when it has no rows); ``report(n)`` after each trajectory's
        ``n`` rows. Returns the chunk's rows."""
        from data_gen.collector import TrajectoryJob
        from decode.drafting.sampling import SamplingConfig

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
            write_shard(rows, shard_path(Path(plan.config.output), c), self.labels)
        return len(rows)
