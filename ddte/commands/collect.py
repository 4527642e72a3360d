"""Collect the selector's training set: for every root of sampled target trajectories, the root features and, for
every (K, L1, L2) action and verifier, the exact expected block efficiency Ê[τ+1] of each sampled union tree and
the latency model's step time T̂. Rows go to parquet shards in the output folder (docs/dataset.md).

Examples:
  ddte collect --config configs/collect/default.yaml
  ddte collect --config configs/collect/default.yaml prompts.limit=20 trees_per_root=2 --output data/small
  ddte collect --config configs/collect/default.yaml --resume            # continue an interrupted run
  ddte collect --config configs/collect/default.yaml --shard 3/8          # worker 3 of 8 (one per GPU/node)
  ddte collect --config configs/collect/default.yaml --engine ray --workers 8   # a Ray actor pool

Any config key can be overridden as KEY=VALUE (dotted for sections: prompts.limit=50,
sampling.temperatures=[0.6,1.0]). Many machines, on a shared output folder:
  * --engine ray --workers N: an actor per worker on the Ray cluster at $RAY_ADDRESS (or ray.address=...; without
    one a local Ray on 127.0.0.1), one chunk per task, lost actors restarted and their chunks retried
    (ray.max_restarts, ray.max_task_retries, ray.num_gpus per actor). Needs pip install 'ddte[ray]'.
  * --shard i/N, no dependency: one process per worker, e.g. a SLURM array
    (--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT) or torchrun (--shard $RANK/$WORLD_SIZE).
Chunk names do not depend on N: --resume skips finished chunks with any worker or shard count. The latency table
comes from latency.file, or shard 0 measures it once and the other shards wait for its dataset.json. A second run of
the same shard on one folder while the first is still running is refused (each shard holds a lock there).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddte.commands.common import (
    DEFAULT_DEVICE,
    DEVICE_HELP,
    UserError,
    add_overrides_argument,
    seed_argument,
    user_errors,
)

DEFAULT_CONFIG = "configs/collect/default.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_overrides_argument(parser, "prompts.limit=20")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="collect YAML")
    parser.add_argument("--output", default=None, help="output folder (overrides the config's output)")
    parser.add_argument("--resume", action="store_true", help="continue a run in --output: skip finished shards")
    parser.add_argument("--shard", default="0/1", help="i/N: collect only the chunks c with c %% N == i")
    parser.add_argument("--device", default=None, choices=("cpu", "cuda", "auto"),
                        help=f"{DEVICE_HELP}; overrides the config's device ({DEFAULT_DEVICE} in the shipped config)")
    parser.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                        help="model dtype (overrides the config)")
    parser.add_argument("--seed", type=seed_argument, default=None, help="overrides the config's seed")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts to collect on (prompts.limit)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens sampled per trajectory (new_tokens)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (threads; 1 in the shipped configs; 0: torch's choice)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes, or Ray actors with --engine ray (overrides the config)")
    parser.add_argument("--engine", default=None, choices=("local", "ray"),
                        help="local processes or a Ray actor pool (overrides the config's engine, default local)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# flag -> the config key it sets (a flag given wins over a KEY=VALUE of the same key)
FLAG_KEYS = {"output": "output", "device": "device", "dtype": "dtype", "seed": "seed", "workers": "workers",
             "threads": "threads", "engine": "engine", "num_prompts": "prompts.limit", "max_new_tokens": "new_tokens"}


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """The KEY=VALUE overrides, then one per flag given."""
    overrides = list(args.overrides)
    given = {item.split("=", 1)[0].strip() for item in overrides}
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None and key in given:  # which one wins would be a guess the user never sees
            raise UserError(f"--{flag.replace('_', '-')} and {key}= are the same setting: give one of them")
        if value is not None:
            # --threads 0 is torch's own choice, as in every command; the config says that with null
            overrides.append(f"{key}={'null' if flag == 'threads' and value == 0 else value}")
    return overrides


def run(args: argparse.Namespace) -> int:
    from data_gen.collection import collect, parse_shard
    from data_gen.config import load_collect_config

    with user_errors():
        config = load_collect_config(args.config, overrides_from_args(args))
        shard, num_shards = parse_shard(args.shard)
    if args.resume and not (Path(config.output) / "dataset.json").is_file():
        raise UserError(f"--resume: {config.output} holds no collection to continue; drop --resume to start one")
    with user_errors(ValueError, OSError, KeyError, RuntimeError):
        summary = collect(config, shard, num_shards, resume=args.resume, progress=not args.no_progress)
    print(summary.line())
    return 0
