"""Typed configuration of ``ddte collect`` (``configs/collect/*.yaml``, every key overridable as ``key=value``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from data_gen.schema import DEFAULT_VERIFIERS
from ddte_core.yamlconfig import load_yaml_config
from decode.cost.throughput import ROOT_PLACEMENTS


@dataclass
class PromptConfig:
    """Where prompts come from.

    ``source``: ``builtin:train`` / ``builtin:heldout`` (the stdlib prompt builder's splits), a ``.jsonl`` or
    ``.parquet`` file (or ``json:PATH`` / ``parquet:PATH``), or ``hf:NAME`` for a ``datasets`` data set
    (``split`` and ``field`` apply; it must be available offline in the HF cache), or ``chat:SET`` (chat prompts
    rendered with the pair's chat template). None: the pair's own training prompts (its YAML's ``train_prompts``:
    ``builtin:train`` for the shipped pair, ``chat:train`` for smollm2).
    """

    source: str | None = None
    field: str = "prompt"
    split: str = "train"
    limit: int | None = 200
    max_tokens: int = 192  # prompts are left-truncated to their last max_tokens tokens


@dataclass
class SamplingGrid:
    """Sampling configurations: every (temperature, top_p) pair of the two lists."""

    temperatures: list[float] = field(default_factory=lambda: [0.6, 1.0])
    top_ps: list[float] = field(default_factory=lambda: [1.0])


@dataclass
class LatencyGrid:
    """The warm-up micro-benchmark behind t_q(l, n), t_p(l, n) (decode.cost.measure.measure_latency)."""

    lengths: list[int] = field(default_factory=lambda: [32, 128, 256, 400])
    sizes: list[int] | None = None  # None: every block size up to the largest tree (decode.cost.measure.every_size)
    repeats: int = 5
    file: str | None = None  # a LatencyTable JSON (e.g. measured on the deployment machine) instead of measuring


@dataclass
class RayOptions:
    """The Ray engine (``engine: ray``): where the cluster is and how each actor (one loaded pair) is placed."""

    address: str | None = None  # an existing cluster (null: $RAY_ADDRESS, else a local Ray bound to 127.0.0.1)
    num_gpus: float | None = None  # per actor (null: 1 with device=cuda, else 0)
    max_restarts: int = 2  # times Ray restarts a lost actor (it reloads the pair)
    max_task_retries: int = 2  # times a chunk lost with its actor is run again


@dataclass
class CollectConfig:
    """The whole collection job."""

    pair: str = "configs/pair/shipped.yaml"
    output: str = "data/collect/default"
    prompts: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingGrid = field(default_factory=SamplingGrid)
    trajectories: int = 1  # target trajectories per (prompt, sampling configuration)
    new_tokens: int = 128  # length of each trajectory
    roots: str = "steps"  # steps: every stride-th step of a reference chain loop; positions: every stride tokens
    stride: int = 6  # steps (or tokens) between roots
    reference_trunk: int = 3  # the reference loop's chain length (roots: steps)
    k_max: int = 4
    l_max: int = 8
    verifiers: list[str] = field(default_factory=lambda: list(DEFAULT_VERIFIERS))
    trees_per_root: int = 4  # s: union trees per root
    prompts_per_shard: int = 8
    target_chunk: int = 1024  # most tree tokens per target pass (each union sample is its own pass, split if larger)
    device: str = "cpu"  # as every command's --device; auto: cuda when available
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    threads: int | None = 1  # torch threads per worker
    workers: int = 1  # worker processes (engine local) or Ray actors (engine ray), each with its own pair
    engine: str = "local"  # local: processes on this machine; ray: an actor pool on a Ray cluster
    latency: LatencyGrid = field(default_factory=LatencyGrid)
    ray: RayOptions = field(default_factory=RayOptions)


def load_collect_config(path: str | Path | None, overrides: list[str] | None = None) -> CollectConfig:
    """Read, override and validate a collect config; raises ValueError with a clear message."""
    return check_collect_config(load_yaml_config(CollectConfig, path, overrides))


def check_collect_config(config: CollectConfig) -> CollectConfig:
    """``config`` if every value is in range; raises ValueError naming the first bad one."""
    checks = [
        (config.k_max >= 1, "k_max must be >= 1"),
        (config.l_max >= 1, "l_max must be >= 1"),
        (config.trees_per_root >= 1, "trees_per_root must be >= 1"),
        (config.trajectories >= 1, "trajectories must be >= 1"),
        (config.new_tokens >= 1, "new_tokens must be >= 1"),
        (config.stride >= 1, "stride must be >= 1"),
        (config.roots in ROOT_PLACEMENTS, "roots must be positions or steps"),
        (config.reference_trunk >= 1, "reference_trunk must be >= 1"),
        (config.prompts_per_shard >= 1, "prompts_per_shard must be >= 1"),
        (config.workers >= 1, "workers must be >= 1"),
        (config.engine in ("local", "ray"), "engine must be local or ray"),
        (config.ray.max_restarts >= 0 and config.ray.max_task_retries >= 0,
         "ray.max_restarts and ray.max_task_retries must be >= 0"),
        (config.ray.num_gpus is None or config.ray.num_gpus >= 0, "ray.num_gpus must be null or >= 0"),
        (config.target_chunk >= 1, "target_chunk must be >= 1"),
        (bool(config.verifiers), "verifiers must name at least one verifier"),
        (bool(config.sampling.temperatures) and bool(config.sampling.top_ps), "sampling lists must not be empty"),
        (all(t > 0 for t in config.sampling.temperatures), "temperatures must be > 0 (greedy has no tree to label)"),
        (all(0 < p <= 1 for p in config.sampling.top_ps), "top_ps must be in (0, 1]"),
        (config.dtype in ("auto", "float32", "bfloat16", "float16"), "bad dtype (auto, float32, bfloat16, float16)"),
        (config.device in ("auto", "cpu", "cuda"), "device must be cpu, cuda or auto"),
        (config.prompts.max_tokens >= 2, "prompts.max_tokens must be >= 2"),
        (config.prompts.limit is None or config.prompts.limit >= 1, "prompts.limit must be null or >= 1"),
        (bool(config.latency.lengths) and all(n >= 1 for n in config.latency.lengths),
         "latency.lengths must list context lengths >= 1"),
        (config.latency.sizes is None or (bool(config.latency.sizes) and all(n >= 1 for n in config.latency.sizes)),
         "latency.sizes must be null (every block size) or list sizes >= 1"),
        (config.latency.repeats >= 1, "latency.repeats must be >= 1"),
        (config.threads is None or config.threads >= 1, "threads must be null (torch's choice) or >= 1"),
        # a Ray worker may run on a larger machine than this one
        (config.threads is None or config.engine == "ray" or config.threads <= (os.cpu_count() or 1),
         f"threads must be at most this machine's {os.cpu_count() or 1} cores"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return config


def config_to_dict(config: CollectConfig) -> dict:
    return dataclasses.asdict(config)
