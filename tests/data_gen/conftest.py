"""Shared fixtures of the data collection tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from decode.latency import LatencyTable
from decode.pair import DEFAULT_TOKENIZER
from tests.engine.tiny import tiny_llama

PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x):\n        self.x = x\n",
    "import os\nprint(os.getcwd())\n",
    "for i in range(3):\n    print(i)\n",
    "x = [1, 2, 3]\n",
]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    """A pair YAML pointing at two tiny random models with the shipped tokenizer's vocabulary."""
    root = tmp_path_factory.mktemp("pair")
    tiny_llama(1, vocab=4096, hidden=32, logit_scale=20.0).save_pretrained(root / "target")
    tiny_llama(2, vocab=4096, hidden=16, logit_scale=20.0).save_pretrained(root / "draft")
    config = {"target": str(root / "target"), "draft": str(root / "draft"), "tokenizer": str(DEFAULT_TOKENIZER)}
    (root / "pair.yaml").write_text(yaml.safe_dump(config))
    table = LatencyTable([8, 32], [1, 4], [[1.0, 2.0], [1.5, 2.5]], [[5.0, 6.0], [7.0, 9.0]])
    (root / "latency.json").write_text(table.to_json())
    with (root / "prompts.jsonl").open("w") as handle:
        for text in PROMPTS:
            handle.write(json.dumps({"prompt": text}) + "\n")
    return root
