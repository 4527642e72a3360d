"""The Ray engine of ``ddte collect`` (``engine: ray``): an actor per worker, each loading the pair once, a chunk per
task.

An idle actor takes the next chunk (uneven chunks balance themselves). A lost actor is restarted
(``ray.max_restarts``; it reloads the pair) and its chunk runs again (``ray.max_task_retries``); the actor writes the
chunk's shard atomically, so a retried chunk leaves no half-written file. The output folder must be one every node
sees (a shared filesystem), and every node needs ddte installed.

``ray.address`` (else ``$RAY_ADDRESS``) names an existing cluster (``ray start`` on SLURM, KubeRay, a cloud
cluster); without one a local Ray starts for the run, bound to 127.0.0.1, and stops after it. Ray is an optional
dependency (``pip install 'ddte[ray]'``), imported only here.
"""

from __future__ import annotations

import logging
import os
import re

from data_gen.config import CollectConfig
from data_gen.workers import ChunkWorker, WorkPlan

RAY_INSTALL = "pip install 'ddte[ray]' (or pip install 'ray==2.*')"
# Test hook: when this names a file, the first actor to remove it dies in the middle of its chunk (once).
TEST_KILL_ENV = "DDTE_TEST_KILL_ACTOR"


def import_ray():
    """The ``ray`` module; ValueError saying how to install it when it is missing."""
    try:
        import ray
    except ImportError as err:
        raise ValueError(f"--engine ray needs Ray, which is not installed: {RAY_INSTALL}") from err
    return ray


def start_ray(ray, config: CollectConfig) -> bool:
    """Connect to ``ray.address`` / $RAY_ADDRESS, or start a local Ray on 127.0.0.1 with a CPU per actor thread (at
    least the machine's); True when this call started Ray (and must stop it). A Ray already initialised in this
    process is used as it is."""
    if ray.is_initialized():
        return False
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        cpus = max(os.cpu_count() or 1, config.workers * (config.threads or 1))
        ray.init(address="local", num_cpus=cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
    return True


class CollectActor:
    """One worker of the pool (wrapped by ``ray.remote`` in :class:`RayPool`): the pair, loaded once."""

    def __init__(self, config: CollectConfig) -> None:
        from data_gen.collector import load_collect_pair

        self.config = config
        self.pair = load_collect_pair(config)
        self.worker: ChunkWorker | None = None

    def facts(self, measure: bool) -> dict:
        from data_gen.collector import pair_facts

        return pair_facts(self.pair, self.config, measure)

    def chunk(self, plan: WorkPlan, c: int) -> int:
        """Collect chunk ``c`` of ``plan`` and write its shard; returns its rows."""
        if self.worker is None:  # first chunk, or first after a restart
            self.worker = ChunkWorker(plan, self.pair)
        return self.worker.chunk(c, _test_kill_hook)


def _test_kill_hook(rows: int) -> None:
    """Called after each trajectory of a chunk: dies (once, whichever actor gets there first) when the test hook
    file of $DDTE_TEST_KILL_ACTOR exists."""
    arm = os.environ.get(TEST_KILL_ENV)
    if not arm:
        return
    try:
        os.unlink(arm)  # one process removes it: only that one dies
    except FileNotFoundError:
        return
    os._exit(1)


class RayPool:
    """``config.workers`` actors (``threads`` CPUs and ``ray.num_gpus`` GPUs each) on a Ray cluster."""

    def __init__(self, config: CollectConfig, measure: bool) -> None:
        ray = import_ray()
        self.ray, self.measure, self.actors = ray, measure, []
        self.started = start_ray(ray, config)
        gpus = config.ray.num_gpus if config.ray.num_gpus is not None else float(config.device == "cuda")
        remote = ray.remote(max_restarts=config.ray.max_restarts, max_task_retries=config.ray.max_task_retries)
        actor = remote(CollectActor).options(num_cpus=config.threads or 1, num_gpus=gpus)
        self.actors = [actor.remote(config) for _ in range(config.workers)]

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc) -> None:
        for actor in self.actors:  # their CPUs and GPUs go back to a shared cluster at once
            self.ray.kill(actor)
        if self.started:
            self.ray.shutdown()

    def facts(self) -> dict:
        try:
            return self.ray.get(self.actors[0].facts.remote(self.measure))
        except self.ray.exceptions.RayError as err:
            raise ray_failure(err) from err

    def run(self, plan: WorkPlan, report) -> int:
        from ray.util import ActorPool

        shared = self.ray.put(plan)
        done = 0
        try:
            for rows in ActorPool(self.actors).map_unordered(lambda a, c: a.chunk.remote(shared, c), plan.todo):
                done += rows
                report(rows)
        except self.ray.exceptions.RayError as err:
            raise ray_failure(err) from err
        return done


def ray_failure(err: Exception) -> Exception:
    """A Ray error as this package's exceptions: the ValueError an actor raised (a bad pair: the user's to fix), else
    a RuntimeError with the first line of what went wrong."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(cause if cause is not None else err))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # an actor whose constructor raised: Ray puts the traceback in the message, the error on its last line
    raised = re.fullmatch(r"(\w+): (.+)", lines[-1]) if lines else None
    if raised and raised.group(1) == "ValueError":
        return ValueError(raised.group(2))
    first = raised.group(0) if raised else (lines[0] if lines else type(err).__name__)
    return RuntimeError(f"a Ray worker failed: {first}")
