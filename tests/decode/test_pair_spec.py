"""Pair YAMLs: names under configs/pair/, per-model dtypes, prompt defaults and fetched targets; the chat rendering
of a pair's tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch

from decode.models.registry import fetched_model_dir
from decode.pair import load_pair_config, load_pair_spec, render_chat
from decode.pair_spec import read_pair_config, resolve_pair_path
from tests.factories import REPO, SHIPPED_TOKENIZER, chat_tokenizer, save_tiny_pair


def test_pair_names_resolve_under_configs_pair():
    assert resolve_pair_path("shipped") == REPO / "configs" / "pair" / "shipped.yaml"
    spec = read_pair_config("shipped")
    assert spec.target == REPO / "models" / "target" and spec.heldout_prompts == "builtin:heldout"


def test_the_smollm2_pair_names_a_fetched_bf16_target_and_chat_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTE_CACHE", str(tmp_path))
    spec = read_pair_config("smollm2")
    assert spec.fetch == ("smollm2",) and spec.target == fetched_model_dir("smollm2")
    assert spec.target_dtype == spec.draft_dtype == "bfloat16-native"
    assert spec.train_prompts == "chat:train" and spec.heldout_prompts == "chat:heldout"
    with pytest.raises(ValueError, match="ddte fetch smollm2"):
        load_pair_spec(spec)


@pytest.mark.parametrize(("extra", "message"), [({"colour": "red"}, "unknown: colour"),
                                                ({"target_dtype": "int8"}, "target_dtype must be"),
                                                ({"kernels": "int8-dynamic"}, "target takes only exact paths"),
                                                ({"kernels": "target=turbo"}, "unknown kernel path"),
                                                ({"draft_int8": "all"}, "replaced by kernels"),
                                                ({"target_quant": "onednn"}, "target_quant must be one of"),
                                                ({"target_dtype": 16}, "target_dtype: expected str, got 16"),
                                                ({"kernels": ["auto"]}, "kernels: expected str")])
def test_bad_pair_yamls_are_refused(tmp_path, extra, message):
    path = tmp_path / "pair.yaml"
    path.write_text(json.dumps({"target": "t", "draft": "d", **extra}))
    with pytest.raises(ValueError, match=re.escape(message)) as refusal:
        read_pair_config(path)
    assert str(refusal.value).startswith(f"pair config {str(path)!r}") and "\n" not in str(refusal.value)


@pytest.mark.parametrize(("text", "message"), [("target: [unclosed\n", "is not valid YAML"),
                                               ("- target\n- draft\n", "is not a YAML config"),
                                               ("draft: d\n", "needs keys target and draft")])
def test_a_pair_yaml_that_is_no_pair_is_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "pair.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)) as refusal:
        read_pair_config(path)
    assert str(path) in str(refusal.value)


def test_a_pair_yaml_keeps_its_prompt_defaults_where_it_names_none(tmp_path):
    path = tmp_path / "pair.yaml"
    path.write_text("target: t\ndraft: d\ntrain_prompts: null\nheldout_prompts: chat:heldout\n")
    spec = read_pair_config(path)
    assert (spec.train_prompts, spec.heldout_prompts, spec.kernels) == ("builtin:train", "chat:heldout", "auto")
    assert spec.target == tmp_path / "t" and spec.tokenizer is None and spec.fetch == ()


def _tiny_pair_yaml(tmp_path, **keys):
    root = save_tiny_pair(tmp_path / "pair", vocab=64)
    path = root / "pair.yaml"
    path.write_text(json.dumps({"target": str(root / "target"), "draft": str(root / "draft"), **keys}))
    return path


def test_a_pairs_kernel_request_is_what_use_kernels_takes(tmp_path):
    pair = load_pair_config(_tiny_pair_yaml(tmp_path, kernels="target=onednn,draft=int8-weight"))
    assert (pair.target.kernel, pair.draft.kernel) == ("default", "default")  # loading measures nothing
    choice = pair.use_kernels()
    assert (choice.target, choice.draft) == (pair.target.kernel, pair.draft.kernel) == ("onednn", "int8-weight")
    assert pair.use_kernels("default").target == pair.target.kernel == "default"  # a command's --kernels wins


def test_a_quantized_target_is_an_opt_in_that_says_so(tmp_path):
    pair = load_pair_config(_tiny_pair_yaml(tmp_path, kernels="draft=default", target_quant="int8-weight"))
    choice = pair.use_kernels()
    assert (pair.target.kernel, pair.draft.kernel) == ("int8-weight", "default")
    assert "a quantized target: another model" in choice.line()


@pytest.mark.parametrize("own, flag", [("default", None), ("auto", "default"), ("auto", "target=onednn")])
def test_target_quant_never_silently_overrides_a_target_path(tmp_path, own, flag):
    pair = load_pair_config(_tiny_pair_yaml(tmp_path, kernels=own, target_quant="int8-weight"))
    with pytest.raises(ValueError, match="target_quant runs its target on int8-weight"):
        pair.use_kernels(flag)
    assert pair.target.kernel == "default"  # refused before anything moved


def test_each_model_loads_in_its_own_dtype_unless_dtype_overrides_both(tmp_path):
    root = save_tiny_pair(tmp_path / "pair", vocab=64)
    path = root / "pair.yaml"
    path.write_text(json.dumps({"target": str(root / "target"), "draft": str(root / "draft"),
                                "target_dtype": "bfloat16", "draft_dtype": "float32"}))
    pair = load_pair_config(path)
    assert pair.target.dtype == torch.bfloat16 and pair.draft.dtype == torch.float32
    both = load_pair_config(path, dtype="float32")
    assert both.target.dtype == torch.float32 and both.draft.dtype == torch.float32


def test_rendering_uses_the_chat_template_with_the_generation_prompt():
    from transformers import AutoTokenizer

    text = render_chat(chat_tokenizer(), [{"role": "user", "content": "Hi"}])
    assert text == "<user>Hi</user><assistant>"
    with pytest.raises(ValueError, match="chat template"):
        render_chat(AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER)), [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="must have a role"):
        render_chat(chat_tokenizer(), [{"role": "user"}])


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "wizard", "content": "hi"}], "messages[0] must have a role (system, user, assistant)"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], "messages[0] is an assistant turn"),
    ([{"role": "system", "content": "s"}], "only system turns"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], "messages[1] is a system turn after"),
    ([], "non-empty list"),
])
def test_a_conversation_a_template_would_render_wrongly_is_refused(messages, message):
    from decode.pair import check_messages

    with pytest.raises(ValueError, match=re.escape(message)):
        check_messages(messages)
    check_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
