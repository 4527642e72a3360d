"""`ddte build-prompts`: JSONL that load_prompts reads, written atomically; old flag spellings still work."""

from __future__ import annotations

import json

import pytest

from data_gen import prompts
from ddte.cli import main


def test_build_prompts_subcommand_writes_jsonl_that_load_prompts_reads(tmp_path, capsys):
    heldout_records = prompts.build_prompts(12)
    out = tmp_path / "sets" / "heldout.jsonl"
    assert main(["build-prompts", "--output", str(out), "--num-prompts", "12"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == heldout_records[:12]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp file left behind
    assert prompts.load_prompts(out) == [r["prompt"] for r in rows]
    assert prompts.load_prompts(out, field="module", limit=3) == [r["module"] for r in rows[:3]]


def test_retired_flag_spellings_are_refused(tmp_path, capsys):
    out = tmp_path / "old.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["build-prompts", "--out", str(out), "--count", "3"])
    assert exit_info.value.code == 2 and not out.exists()
    assert "unrecognized arguments: --count" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--split", "train"], ["--max-chars", "100"], ["--recipe", "models"]])
def test_code_prompt_options_beside_a_chat_set_are_refused(tmp_path, capsys, option):
    """A chat set has its own split: an option that only shapes code prompts would be silently ignored."""
    out = tmp_path / "chat.jsonl"
    assert main(["build-prompts", "--chat", "heldout", "--output", str(out), *option]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{option[0]} applies to code prompts" in err[0] and not out.exists()


def test_held_out_code_prompts_follow_the_recipes_split(tmp_path, capsys):
    """The corpus split comes from the pair's recipe.json, never a free number that could disagree with it."""
    recipe = tmp_path / "pair"
    recipe.mkdir()
    (recipe / "recipe.json").write_text(json.dumps({"config": {"corpus": {"heldout_fraction": 0.3}}}))
    out = tmp_path / "wide.jsonl"
    assert main(["build-prompts", "--output", str(out), "--num-prompts", "40", "--recipe", str(recipe)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == prompts.build_prompts(40, heldout_fraction=0.3)
    assert rows != prompts.build_prompts(40)  # the shipped pair's split (models/recipe.json: 0.1) differs


@pytest.mark.parametrize("content", [None, "[1, 2]"], ids=["no-recipe", "not-an-object"])
def test_a_folder_without_a_readable_recipe_is_refused(tmp_path, capsys, content):
    folder = tmp_path / "pair"
    folder.mkdir()
    if content is not None:
        (folder / "recipe.json").write_text(content)
    out = tmp_path / "x.jsonl"
    assert main(["build-prompts", "--output", str(out), "--recipe", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddte build-prompts: error: --recipe: ") and not out.exists()
