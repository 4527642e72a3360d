"""Give a draft a reduced output vocabulary (FR-Spec): the tokens its target writes most, chosen from the target's
own responses, with their laws, that `ddte distill` cached (data.text=laws).

The draft's head keeps only those rows, so a draft pass costs less, and decoding stays exactly lossless: the
draft never proposes another token, and the verifier's residual still emits every token the target writes. The set
is written beside the draft's weights as draft_vocab.safetensors; every command that loads the draft uses it.
Delete that file to go back to the full vocabulary.

--laws defaults to the cache the draft's own distill.json names.

Examples:
  ddte draft-vocab --draft models/smollm2-draft --size 8192
  ddte draft-vocab --draft runs/distill/smollm2-draft-p3 --size 4096 --laws ~/.cache/ddte/distill/laws-XXXX.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddte.commands.common import UserError, user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", required=True, help="the draft's folder (config.json + safetensors weights)")
    parser.add_argument("--size", type=int, default=8192, help="tokens the draft may propose (default: 8192)")
    parser.add_argument("--laws", default=None, help="cached target laws (default: the one the draft's "
                        "distill.json names)")


def run(args: argparse.Namespace) -> int:
    from distill.teacher_cache import TeacherLaws, choose_draft_vocab

    draft = Path(args.draft)
    if not (draft / "config.json").is_file():
        raise UserError(f"--draft {draft} is not a model folder (no config.json)")
    config = json.loads((draft / "config.json").read_text())
    eos = config.get("eos_token_id")
    laws_path = Path(args.laws).expanduser() if args.laws else _laws_of(draft)
    if not laws_path.is_file():
        raise UserError(f"no cached laws at {laws_path}: run `ddte distill` with data.text=laws first")
    with user_errors():
        laws = TeacherLaws.load(laws_path)
    if not laws.vocab_size:
        print(f"note: {laws_path} records no vocabulary size (an older ddte wrote it): only its token ids are "
              "checked against this draft's vocabulary (delete it and run `ddte distill` with data.text=laws for one "
              "that does)", file=sys.stderr)
    with user_errors():
        vocab = choose_draft_vocab(laws, int(config["vocab_size"]), args.size,
                                   [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None])
        path = vocab.save(draft)
    share = vocab.info["target_mass_covered"]
    print(f"wrote {path}: {vocab.size} of {vocab.vocab_size} tokens, holding {share:.1%} of the target's mass "
          f"on {vocab.info['response_tokens']} response tokens")
    return 0


def _laws_of(draft: Path) -> Path:
    summary = draft / "distill.json"
    text = json.loads(summary.read_text()).get("text", {}) if summary.is_file() else {}
    if "cache" not in text:
        raise UserError(f"{draft} names no cached laws (distill.json from data.text=laws): give --laws FILE")
    return Path(text["cache"])

