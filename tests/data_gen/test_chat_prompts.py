"""Chat prompt sets from ../shared/data: the split rule, and chat rows in files rendered with a chat template."""

from __future__ import annotations

import json

import pytest

from data_gen.chat_prompts import CHAT_SETS, UNTRAINED_CATEGORIES, build_chat_prompts, shared_data_dir
from data_gen.prompts import load_prompt_texts, load_prompts
from tests import factories

pytestmark = pytest.mark.skipif(not shared_data_dir().is_dir(), reason="../shared/data is not beside the checkout")


@pytest.fixture(scope="module")
def chat_tokenizer():
    return factories.chat_tokenizer()


def test_training_and_heldout_sets_never_share_a_prompt():
    train = {r["id"] for r in build_chat_prompts("train")}
    heldout = {r["id"] for r in build_chat_prompts("heldout")}
    assert train and heldout and not train & heldout
    contents_train = {r["messages"][0]["content"] for r in build_chat_prompts("train")}
    assert not contents_train & {r["messages"][0]["content"] for r in build_chat_prompts("heldout-unlike")}


def test_the_unlike_group_holds_only_categories_never_trained_on():
    unlike = build_chat_prompts("heldout-unlike")
    assert unlike and {r["category"] for r in unlike} <= set(UNTRAINED_CATEGORIES)
    assert not {r["category"] for r in build_chat_prompts("train")} & set(UNTRAINED_CATEGORIES)
    like = {r["id"] for r in build_chat_prompts("heldout-like")}
    assert like | {r["id"] for r in unlike} == {r["id"] for r in build_chat_prompts("heldout")}


def test_sets_are_deterministic_and_their_first_prompts_mix_the_sources():
    first = build_chat_prompts("heldout", count=9)
    assert first == build_chat_prompts("heldout", count=9)
    assert {r["source"] for r in first} == {"gsm8k", "humaneval", "spec_bench"}


def test_an_unknown_set_is_refused():
    with pytest.raises(ValueError, match="one of " + ", ".join(CHAT_SETS)):
        build_chat_prompts("validation")


def test_prompt_files_may_hold_chat_rows(tmp_path, chat_tokenizer):
    """Rendered with the tokenizer's template; a file mixing them with plain rows is refused
    (tests/data_gen/test_load_prompts.py)."""
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Add 2 and 3."}]},
            {"messages": [{"role": "user", "content": "Hi"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_prompts(path, tokenizer=chat_tokenizer) == ["<user>Add 2 and 3.</user><assistant>",
                                                            "<user>Hi</user><assistant>"]
    with pytest.raises(ValueError, match="row 1: chat prompts"):
        load_prompts(path)  # no tokenizer to render the chat row with


def test_chat_sources_read_like_any_other(chat_tokenizer):
    texts = load_prompt_texts("chat:heldout-unlike", limit=3, tokenizer=chat_tokenizer)
    assert len(texts) == 3 and all(t.startswith("<user>") and t.endswith("<assistant>") for t in texts)


def test_the_mixed_workload_covers_every_category_in_its_first_prompts():
    """mixed:SET holds out ceil(20 %) of every trained category, adds RAG's long turns and interleaves by category:
    the first 13 held-out prompts are one per category, the three never trained on included."""
    from data_gen.chat_prompts import MIXED_MAX_CONTENT_CHARS

    heldout = build_chat_prompts("heldout", workload="mixed")
    first = heldout[:13]
    assert len({r["category"] for r in first}) == 13 and set(UNTRAINED_CATEGORIES) <= {r["category"] for r in first}
    train = build_chat_prompts("train", workload="mixed")
    assert "rag" in {r["category"] for r in train} and not {r["id"] for r in train} & {r["id"] for r in heldout}
    assert not {r["category"] for r in train} & set(UNTRAINED_CATEGORIES)
    assert max(len(r["messages"][0]["content"]) for r in train) <= MIXED_MAX_CONTENT_CHARS
    per_category = {}
    for record in heldout + train:
        per_category.setdefault((record["source"], record["category"]), []).append(record["split"])
    writing = per_category["spec_bench", "writing"]
    assert writing.count("heldout") == 2 and len(writing) == 10  # ceil(20 %) of each trained category is held out


def test_mixed_sources_read_like_any_other(chat_tokenizer):
    texts = load_prompt_texts("mixed:heldout", limit=2, tokenizer=chat_tokenizer)
    assert len(texts) == 2 and all(t.startswith("<user>") for t in texts)
    with pytest.raises(ValueError, match="workload"):
        build_chat_prompts("heldout", workload="code")
