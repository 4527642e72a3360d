"""The recipe: typed config with overrides, and an end-to-end tiny run that yields loadable, reproducible models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ddte.commands import train_pair as recipe
from ddte.commands.common import UserError
from ddte.train_pair.config import PairConfig, load_config
from tests.factories import run_subcommand

from .conftest import REPO, TINY_CONFIG


def test_yaml_files_mirror_the_dataclass_and_overrides_apply():
    default = load_config(REPO / "configs" / "train-pair" / "default.yaml")
    assert isinstance(default, PairConfig)
    assert default.target.shape.num_hidden_layers == 6 and default.draft.shape.num_hidden_layers == 1
    tiny = load_config(TINY_CONFIG, ["target.train.steps=3", "draft.train.lr=1e-2", "corpus.max_files=null"])
    assert tiny.target.train.steps == 3
    assert tiny.draft.train.lr == pytest.approx(1e-2)
    assert tiny.corpus.max_files is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("target.train.stepz=3", "unknown config key"),
        ("target.train.steps=many", "expected int"),
        ("storage_dtype=int8", "storage_dtype"),
        ("target.train.seq_len=4096", "exceeds context_length"),
        ("no_equals_sign", "KEY=VALUE"),
        ("target.train.steps=-5", "target.train: steps must be >= 1"),
        ("draft.train.lr=0", "lr > 0"),
        ("tokenizer.vocab_size=5", "tokenizer.vocab_size must be >= 259"),
        ("target.shape.num_attention_heads=5", "not a multiple of num_attention_heads 5"),
        ("draft.shape.num_key_value_heads=3", "not a multiple of num_key_value_heads 3"),
    ],
)
def test_bad_config_is_a_user_error(tmp_path, override, message):
    argv = ["--config", str(TINY_CONFIG), "--output", str(tmp_path), override]
    with pytest.raises(UserError, match=message):
        run_subcommand(recipe, argv)
    assert not list(tmp_path.iterdir())  # refused before anything is written
    with pytest.raises(UserError, match="not found"):
        run_subcommand(recipe, ["--config", str(tmp_path / "absent.yaml")])


def test_tiny_recipe_produces_loadable_models(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = json.loads((tiny_pair / "recipe.json").read_text())
    assert meta["python_version"] == meta["corpus"]["python_version"]
    assert meta["environment"]["threads"] >= 1 and meta["environment"]["torch"]
    assert meta["seeds"] == {"target": 1, "draft": 2}
    assert meta["corpus"]["tokens"]["train"] > 0 and meta["corpus"]["files"]["heldout"] > 0
    for name in ("target", "draft"):
        assert meta["models"][name]["final_heldout_loss"] > 0
        assert len(meta["models"][name]["curve"]) == meta["config"][name]["train"]["steps"]
    assert (tiny_pair / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tiny_pair.iterdir() if p.name.startswith(".")]  # staging dir removed

    tok = AutoTokenizer.from_pretrained(tiny_pair / "tokenizer")
    for name in ("target", "draft"):
        files = {p.name for p in (tiny_pair / name).iterdir()}
        assert "model.safetensors" in files and not {f for f in files if f.endswith((".bin", ".pt", ".pkl"))}
        with safe_open(tiny_pair / name / "model.safetensors", "pt") as handle:
            assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.float16}
        model = AutoModelForCausalLM.from_pretrained(tiny_pair / name)
        assert model.dtype == torch.float32  # stored in fp16, loaded as fp32 by default
        ids = torch.tensor([tok("def f(x):\n").input_ids])
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert out.shape == (1, ids.shape[1] + 4)
        # The tokenizer is copied next to each model so either directory is self-contained.
        assert AutoTokenizer.from_pretrained(tiny_pair / name).get_vocab() == tok.get_vocab()


def test_recipe_is_reproducible(tiny_pair, tmp_path):
    assert run_subcommand(recipe, ["--config", str(TINY_CONFIG), "--output", str(tmp_path)]) == 0
    for name in ("target", "draft"):
        assert (tmp_path / name / "model.safetensors").read_bytes() == (
            tiny_pair / name / "model.safetensors"
        ).read_bytes()
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_text() == (
        tiny_pair / "tokenizer" / "tokenizer.json"
    ).read_text()


def test_only_draft_rebuilds_the_draft_and_keeps_the_target(tiny_pair, tmp_path):
    import shutil

    out = tmp_path / "pair"
    shutil.copytree(tiny_pair, out)
    base = ["--config", str(TINY_CONFIG), "--output", str(out)]
    assert run_subcommand(recipe, [*base, "--only", "draft", "draft.seed=99"]) == 0
    meta = json.loads((out / "recipe.json").read_text())
    assert meta["rebuilt_only"] == "draft" and meta["seeds"]["draft"] == 99
    weights = "model.safetensors"
    assert (out / "target" / weights).read_bytes() == (tiny_pair / "target" / weights).read_bytes()
    assert (out / "draft" / weights).read_bytes() != (tiny_pair / "draft" / weights).read_bytes()
    with pytest.raises(UserError, match="outside the 'draft' section"):
        run_subcommand(recipe, [*base, "--only", "draft", "target.seed=5"])
    with pytest.raises(UserError, match="previous full run"):
        run_subcommand(recipe, [*base[:-1], str(tmp_path / "empty"), "--only", "draft"])
