"""The one tiny-model factory of the test suite: random HF models and pairs built from configs, never downloaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

REPO = Path(__file__).resolve().parents[1]
SHIPPED_TOKENIZER = REPO / "models" / "tokenizer"  # vocab 4096
TINY_TRAIN_CONFIG = REPO / "configs" / "train" / "tiny.yaml"
TRAINED_EPOCHS = 20  # the shared `trained` fixture's epochs (tests/conftest.py says why)


def tiny_llama(
    seed: int, vocab: int = 8, hidden: int = 32, layers: int = 1, logit_scale: float = 1.0, context: int = 64
) -> PreTrainedModel:
    """A random Llama; ``logit_scale`` multiplies the output head so distributions are peaked, not near-uniform."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def save_tiny_pair(root: Path, vocab: int = 4096, target_hidden: int = 32, draft_hidden: int = 16,
                   target_layers: int = 1, logit_scale: float = 1.0, context: int = 64, seeds: tuple = (1, 2)) -> Path:
    """``root/target``, ``root/draft`` (saved tiny Llamas) and ``root/pair.yaml``; with vocab 4096 the pair uses the
    shipped tokenizer, so text prompts work. Returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    tiny_llama(seeds[0], vocab, target_hidden, target_layers, logit_scale, context).save_pretrained(root / "target")
    tiny_llama(seeds[1], vocab, draft_hidden, 1, logit_scale, context).save_pretrained(root / "draft")
    pair = {"target": str(root / "target"), "draft": str(root / "draft")}
    if vocab == 4096:
        pair["tokenizer"] = str(SHIPPED_TOKENIZER)
    (root / "pair.yaml").write_text(json.dumps(pair))  # JSON is YAML
    return root


def run_subcommand(module, argv: list[str]) -> int:
    """Parse ``argv`` with a command shell's own arguments and run it, as ``ddte <name>`` does."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


COLLECT_PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x):\n        self.x = x\n",
    "import os\nprint(os.getcwd())\n",
    "for i in range(3):\n    print(i)\n",
    "x = [1, 2, 3]\n",
]


def save_collect_pair(root: Path) -> Path:
    """A tiny pair for data collection: the pair YAML, a latency table and five prompts (``collect_overrides``)."""
    from decode.cost.table import LatencyTable

    save_tiny_pair(root, logit_scale=20.0)
    # the collection runs the default kernels: tests recompute its laws with F.linear, and a path auto chose on one
    # CPU (oneDNN's other summation order) moved a recomputed entropy by 0.008 nats
    pair = json.loads((root / "pair.yaml").read_text())
    (root / "pair.yaml").write_text(json.dumps({**pair, "kernels": "default"}))
    table = LatencyTable([8, 32], [1, 4], [[1.0, 2.0], [1.5, 2.5]], [[5.0, 6.0], [7.0, 9.0]])
    (root / "latency.json").write_text(table.to_json())
    with (root / "prompts.jsonl").open("w") as handle:
        for text in COLLECT_PROMPTS:
            handle.write(json.dumps({"prompt": text}) + "\n")
    return root


def collect_overrides(folder: Path, out: Path, **extra) -> list[str]:
    """KEY=VALUE overrides of a fast collection on :func:`save_collect_pair`'s pair into ``out``."""
    base = {
        "pair": str(folder / "pair.yaml"), "output": str(out), "prompts.source": str(folder / "prompts.jsonl"),
        "prompts.max_tokens": 20, "new_tokens": 12, "roots": "positions", "stride": 6, "k_max": 2, "l_max": 2,
        "trees_per_root": 2,
        "prompts_per_shard": 2, "workers": 1, "device": "cpu", "threads": 1,
        "latency.file": str(folder / "latency.json"),
        "sampling.temperatures": "[0.7, 1.0]", "verifiers": "[specinfer, traversal, gbv]",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_tokenizer():
    """The shipped tokenizer with a tiny chat template: ``<user>text</user><assistant>`` for one user turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def shard_rows(folder: Path) -> dict[str, list[dict]]:
    """Every shard of a collected folder by file name, its rows in file order, NaN as None (so rows compare equal):
    two collections are the same row for row when these are equal."""
    import math

    import pyarrow.parquet as pq

    def clean(value):
        if isinstance(value, list):
            return [None if isinstance(v, float) and math.isnan(v) else v for v in value]
        return value

    return {shard.name: [{k: clean(v) for k, v in row.items()} for row in pq.read_table(shard).to_pylist()]
            for shard in sorted(Path(folder).glob("shard-*.parquet"))}
