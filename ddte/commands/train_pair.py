"""Train the shipped draft/target pair from scratch: tokenizer, target and draft, on the Python stdlib.

Reads a YAML recipe (default configs/train-pair/default.yaml), trains a byte-level BPE tokenizer on the training
split of the running interpreter's standard library, then a Llama target and a Llama draft from random init, and writes
tokenizer/, target/, draft/, recipe.json and loss_curve.png into the output folder. Nothing lands there until
every product is finished; an interrupted run leaves nothing behind.

Examples:
  ddte train-pair --config configs/train-pair/default.yaml
  ddte train-pair --config configs/train-pair/tiny.yaml --output /tmp/pair target.train.steps=20 draft.seed=7
  ddte train-pair --only draft                     # retrain the draft, keep the target of the previous run
"""

from __future__ import annotations

import argparse

from ddte.commands.common import UserError, add_overrides_argument, user_errors

DEFAULT_CONFIG = "configs/train-pair/default.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_overrides_argument(parser, "target.train.steps=100")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML recipe")
    parser.add_argument("--output", default=None, help="output folder (overrides the config's out_dir)")
    parser.add_argument("--only", choices=("target", "draft"),
                        help="retrain only this model, keeping the other from a previous run of the same config")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run in the output folder (one with recipe.json)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ddte.train_pair.config import load_config
    from ddte.train_pair.recipe import PRODUCTS, run_recipe
    from ddte_core.paths import bundled, check_output_folder

    if not bundled(args.config).is_file():
        raise UserError(f"config file not found: {args.config}")
    overrides = list(args.overrides) + ([f"out_dir={args.output}"] if args.output else [])
    with user_errors(prefix="bad config: "):
        config = load_config(args.config, overrides)
    with user_errors():
        out = Path(config.out_dir)
        if args.only:  # it reads the earlier run it keeps the other model of
            if not (out / "recipe.json").is_file():
                raise UserError(f"--only {args.only} needs a previous full run in {out} (recipe.json and its models)")
        else:
            check_output_folder(out, "output", own="recipe.json", overwrite=args.overwrite)
    with user_errors():
        meta = run_recipe(config, only=args.only)
    for name in ("target", "draft"):
        m = meta["models"][name]
        print(
            f"{name}: {m['parameters'] / 1e6:.2f} M params, {m['tokens']} tokens in {m['wall_s']} s, "
            f"held-out loss {m['final_heldout_loss']:.3f} (ppl {m['final_heldout_perplexity']:.1f})"
        )
    print(f"wrote {', '.join(PRODUCTS)} to {config.out_dir}")
    return 0
