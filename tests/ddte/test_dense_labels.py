"""`ddte dense-labels` on the shipped pair: a parquet data set with its card, resumed shard by shard, refusals."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ddte.cli import main
from tests.factories import COLLECT_PROMPTS

ARGS = ["dense-labels", "--num-prompts", "3", "--continuations", "2", "--length", "5", "--temperature", "1.0",
        "--prompts-per-shard", "2", "--no-progress", "--kernels", "default"]


@pytest.fixture(scope="module", autouse=True)
def _prompts_file(tmp_path_factory):
    """The prompts from a small file: the pair's own builtin:train source is built from the stdlib on every run
    (seconds), which these tests do not test."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in COLLECT_PROMPTS))
    ARGS.extend(["--prompts", str(path)])
    yield
    del ARGS[-2:]


def _rows(folder) -> list[dict]:
    return [row for shard in sorted(folder.glob("dense-*.parquet")) for row in pq.read_table(shard).to_pylist()]


def test_it_writes_a_data_set_with_its_card_and_resumes(tmp_path, capsys):
    out = tmp_path / "dense"
    assert main([*ARGS, "--output", str(out)]) == 0
    assert "labelled 30 nodes" in capsys.readouterr().out  # 3 prompts × 2 continuations × 5 positions
    rows = _rows(out)
    assert len(rows) == 30 and {r["prompt_id"] for r in rows} == {"0", "1", "2"}
    assert all(0.0 <= r["beta"] <= 1.0 and 0.0 <= r["accept_traversal_k3"] <= 1.0 for r in rows)
    metadata = json.loads((out / "dense.json").read_text())
    assert metadata["spec"]["continuations"] == 2 and metadata["verifiers"] == ["specinfer", "traversal"]
    assert "accept_specinfer_k1..3" in (out / "README.md").read_text()
    # schema 2: the drawn token's realized labels (both verifiers' is `realized`) and the draw signals
    assert metadata["schema_version"] == 2 and "`realized`: specinfer, traversal" in (out / "README.md").read_text()
    assert all(0.0 <= r["realized"] <= 1.0 and r["token_q"] > 0 and isinstance(r["draw_rank"], int) for r in rows)
    assert all((r["draw_q"], r["draw_rank"], r["draw_top"]) == (1.0, 0, 1.0) for r in rows if r["depth"] == 0)
    # a stopped run: one shard missing, resumed, the same rows again
    (out / "dense-00001.parquet").unlink()
    assert main([*ARGS, "--output", str(out), "--resume"]) == 0
    assert "1 shards written, 1 already there" in capsys.readouterr().out
    assert _rows(out) == rows


def test_an_existing_data_set_or_another_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "dense"
    assert main([*ARGS, "--output", str(out)]) == 0
    capsys.readouterr()
    assert main([*ARGS, "--output", str(out)]) == 2
    assert capsys.readouterr().err.strip().endswith("--resume continues it")
    assert main([*ARGS, "--output", str(out), "--resume", "--length", "6", "--seed", "3"]) == 2
    err = _error(capsys.readouterr().err)
    assert "holds another dense data set" in err and "\n" not in err
    assert "spec.length (5 there, 6 here)" in err and "seed (0 there, 3 here)" in err and "kernel" not in err
    # a schema-1 set is not continued with schema-2 rows
    old = json.loads((out / "dense.json").read_text())
    (out / "dense.json").write_text(json.dumps({**old, "schema_version": 1}))
    assert main([*ARGS, "--output", str(out), "--resume"]) == 2
    assert "schema_version (1 there, 2 here)" in _error(capsys.readouterr().err)
    assert main([*ARGS, "--output", str(tmp_path / "x"), "--verifiers", "rsd"]) == 2
    assert "not i.i.d. draws" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _error(err: str) -> str:
    """stderr without the kernels' line every run prints once its pair loads."""
    return "\n".join(line for line in err.strip().splitlines() if not line.startswith("kernels:"))


def _one_line_refusal(capsys, args: list[str], *words: str) -> None:
    assert main(args) == 2
    captured = capsys.readouterr()
    err = _error(captured.err)
    assert "\n" not in err and all(w in err for w in words), err
    assert not captured.out


def test_output_must_be_new_empty_or_this_data_set(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_refusal(capsys, [*ARGS, "--output", ""], "--output is empty")
    _one_line_refusal(capsys, [*ARGS, "--output", " "], "--output is empty")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes\n")
    for extra in ([], ["--resume"]):
        _one_line_refusal(capsys, [*ARGS, "--output", str(mine), *extra], "not empty", "holds no dense data set")
    assert [p.name for p in mine.iterdir()] == ["README.md"] and (mine / "README.md").read_text() == "my notes\n"
    (tmp_path / "a-file").write_text("x")
    _one_line_refusal(capsys, [*ARGS, "--output", str(tmp_path / "a-file" / "d")], "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "mine"]  # nothing written in the working folder
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*ARGS, "--output", str(empty), "--num-prompts", "1"]) == 0  # an empty folder is a new one
    assert {p.name for p in empty.iterdir()} == {"dense.json", "README.md", "dense-00000.parquet"}


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "-0.5"],
                                   ["--temperature", "1.0", "1.0"], ["--top-p", "nan"], ["--top-p", "inf"],
                                   ["--top-p", "0"]])
def test_a_sampling_setting_that_is_none_is_refused_before_anything_is_written(tmp_path, capsys, flags):
    out = tmp_path / "dense"
    _one_line_refusal(capsys, [*ARGS, "--output", str(out), *flags], flags[0])
    assert not out.exists()


def test_resume_compares_the_row_settings_not_the_kernels_timings(tmp_path, capsys):
    out = tmp_path / "dense"
    assert main([*ARGS, "--output", str(out), "--num-prompts", "2"]) == 0
    metadata = json.loads((out / "dense.json").read_text())
    assert metadata["kernel_paths"] == {"target": "default", "draft": "default"} and metadata["prompts_per_shard"] == 2
    # measured again since: the line's times differ, the paths do not; an older dense.json had no kernel_paths
    metadata["kernels"] = "kernels: target default (1 token 3.1 ms, 16 tokens 9.0 ms; default 3.1 / 9.0), draft default"
    for key in ("kernel_paths", "prompts_per_shard"):
        metadata.pop(key)
    (out / "dense.json").write_text(json.dumps(metadata))
    (out / "dense-00000.parquet").unlink()
    capsys.readouterr()
    assert main([*ARGS, "--output", str(out), "--num-prompts", "2", "--resume"]) == 0
    assert "1 shards written, 0 already there" in capsys.readouterr().out
    metadata["kernels"] = "kernels: target default, draft int8-dynamic (1 token 1.0 ms, 16 tokens 2.0 ms)"
    (out / "dense.json").write_text(json.dumps(metadata))
    _one_line_refusal(capsys, [*ARGS, "--output", str(out), "--num-prompts", "2", "--resume"],
                      "kernel_paths.draft ('int8-dynamic' there, 'default' here)")


def test_shards_start_in_any_order_and_a_shard_without_work_says_so(tmp_path, capsys):
    out = tmp_path / "dense"
    assert main([*ARGS, "--output", str(out), "--shard", "1/2", "--resume"]) == 0  # --resume starts a new folder
    assert "1 shards written" in capsys.readouterr().out
    assert main([*ARGS, "--output", str(out), "--shard", "0/2"]) == 0  # enters the folder shard 1 made
    assert "1 shards written" in capsys.readouterr().out
    assert {r["prompt_id"] for r in _rows(out)} == {"0", "1", "2"}
    _one_line_refusal(capsys, [*ARGS, "--output", str(out), "--shard", "0/2", "--prompts-per-shard", "1"],
                      "prompts_per_shard (2 there, 1 here)")
    spare = tmp_path / "spare"
    assert main([*ARGS, "--output", str(spare), "--shard", "1/2", "--prompts-per-shard", "4"]) == 0
    captured = capsys.readouterr()
    assert _error(captured.err).splitlines() == [
        "shard 1/2 has no work: 3 prompts make 1 chunk of --prompts-per-shard 4, and shard i takes chunks c with "
        "c % 2 == i; nothing written"]
    assert not captured.out and not spare.exists()
