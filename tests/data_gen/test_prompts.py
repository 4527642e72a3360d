"""The prompt builder: deterministic, held-out only by default, exact slices of their modules, with provenance."""

from __future__ import annotations

import pytest

from data_gen import corpus, prompts


@pytest.fixture(scope="module")
def files():
    return corpus.list_corpus()


@pytest.fixture(scope="module")
def heldout_records(files):
    return prompts.build_prompts(files=files)


def test_default_set_has_200_heldout_prompts_and_is_deterministic(files, heldout_records):
    assert len(heldout_records) == prompts.DEFAULT_COUNT
    assert prompts.build_prompts(files=files) == heldout_records
    assert len({r["id"] for r in heldout_records}) == len(heldout_records)
    assert len({r["module"] for r in heldout_records}) >= 20  # round-robin spreads over modules


def test_prompts_never_come_from_training_modules(files, heldout_records):
    by_path = {f.relpath: f for f in files}
    train_texts = {f.relpath: None for f in corpus.select_split(files, "train")}
    for record in heldout_records:
        module = by_path[record["module"]]
        assert record["split"] == "heldout" == module.split == corpus.split_of(record["module"])
        assert record["module"] not in train_texts
        assert record["python_version"] == corpus.python_version()
        # The prompt is exactly lines start..end of its held-out module and ends after the docstring.
        lines = module.read().splitlines(keepends=True)
        text = "".join(lines[record["start_line"] - 1 : record["end_line"]])
        assert record["prompt"] in (text, text + "\n")
        assert record["start_line"] <= record["header_line"] <= record["end_line"]
        assert len(record["prompt"]) <= prompts.DEFAULT_MAX_CHARS + 1
        assert record["anchor"].split()[0] in ("def", "class")


def test_train_split_only_when_asked(files):
    records = prompts.build_prompts(10, split="train", files=files)
    assert len(records) == 10 and all(corpus.split_of(r["module"]) == "train" for r in records)
    with pytest.raises(ValueError):
        prompts.build_prompts(5, split="test", files=files)
