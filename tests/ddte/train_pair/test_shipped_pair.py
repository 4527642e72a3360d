"""The shipped pair in models/: loads offline, round-trips stdlib text, generates, fits the size budget."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen import corpus

from .conftest import SHIPPED

pytestmark = pytest.mark.skipif(
    not (SHIPPED / "target").is_dir(), reason="models/target absent: run `ddte train-pair` to build the shipped pair"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED / "tokenizer")


def test_files_are_safetensors_and_within_budget():
    total = 0
    for name in ("tokenizer", "target", "draft"):
        for path in (SHIPPED / name).iterdir():
            assert not path.name.endswith((".bin", ".pt", ".pkl", ".py")), path  # no pickle, no remote code
            total += path.stat().st_size
    assert total <= 50 * 2**20
    meta = json.loads((SHIPPED / "recipe.json").read_text())
    assert meta["python_version"] and meta["corpus"]["files"]["heldout"] > 0


def test_tokenizer_round_trips_stdlib_source(tokenizer):
    for module in corpus.subset(corpus.list_corpus(), 5):
        text = module.read()
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_pair_loads_offline_and_generates(tokenizer):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tokenizer("import os\n\n\ndef main():\n").input_ids])
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(SHIPPED / name)
        assert model.dtype == torch.float32 and model.config.vocab_size == len(tokenizer)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        assert out.shape == (1, ids.shape[1] + 5)
        assert isinstance(tokenizer.decode(out[0, ids.shape[1] :]), str)


def test_the_real_pairs_draft_is_safetensors_and_within_budget():
    """models/smollm2-draft at most 30 MB, all of models/ at most 80 MB, no pickle and no code anywhere."""
    folder = SHIPPED / "smollm2-draft"
    files = list(folder.iterdir())
    assert any(p.name == "model.safetensors" for p in files)
    assert sum(p.stat().st_size for p in files) <= 30 * 2**20
    everything = [p for p in SHIPPED.rglob("*") if p.is_file()]
    assert not [p for p in everything if p.name.endswith((".bin", ".pt", ".pkl", ".py"))]
    assert sum(p.stat().st_size for p in everything) <= 80 * 2**20
    summary = json.loads((folder / "distill.json").read_text())
    assert summary["config"]["target"] == "fetch:smollm2" and summary["steps"] >= 1
