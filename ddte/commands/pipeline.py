"""The main job: collect -> train -> export -> bench -> decide, on the shipped pair, ending with the results table.

Collects roots on training prompts, trains one selector per verifier with its never-lose guard, exports them to
ONNX, benches each against its static candidates (the best distinct trees of the training data, bench.candidates of
them) on held-out prompts in one interleaved run, and writes what to deploy per verifier and temperature to
policy.json: the training split's static choice unless a runner-up beat it beyond the bench's noise, or the
selector (or expander) where it beat that static beyond the same noise. Every stage's settings are checked before
the first one starts; nothing is created on a refusal. The bench uses the first bench.num_prompts held-out
prompts: an independent check of the choice skips them (ddte bench --skip-prompts N).

Examples:
  ddte pipeline --config configs/pipeline/default.yaml
  ddte pipeline --output runs/small 'collect.overrides=[prompts.limit=8]' bench.num_prompts=4
  ddte pipeline --output runs/small --resume                          # continue an interrupted run
  ddte generate "def f(x):" --policy-file runs/pipeline/policy.json      # deploy what it chose
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddte.commands.common import add_overrides_argument, user_errors

DEFAULT_CONFIG = "configs/pipeline/default.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_overrides_argument(parser, "bench.num_prompts=4")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="pipeline YAML")
    parser.add_argument("--output", default=None, help="output folder (overrides the config's output)")
    parser.add_argument("--resume", action="store_true",
                        help="continue or redo a run in --output: keep its collected shards, rewrite its selectors, "
                        "policy.json and results (without it --output must be new or empty)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI, e.g. http://host:5000 "
                        "(overrides the config's tracking_uri; default: <output>/mlflow.db)")


def run(args: argparse.Namespace) -> int:
    from ddte.pipeline import load_pipeline, run_pipeline

    overrides = list(args.overrides) + ([f"output={args.output}"] if args.output else [])
    if args.tracking_uri:
        overrides.append(f"tracking_uri={args.tracking_uri}")
    with user_errors():
        plan = load_pipeline(args.config, overrides, resume=args.resume)
    with user_errors(ValueError, OSError, RuntimeError):
        result = run_pipeline(plan)
    print(result.results_markdown)
    print(f"\ndeploy with: ddte generate ... --policy-file {Path(result.deployment_path)}")
    return 0
