"""`ddte dense-labels` on the shipped pair: a parquet data set with its card, resumed shard by shard, refusals."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from ddte.cli import main

ARGS = ["dense-labels", "--num-prompts", "3", "--continuations", "2", "--length", "5", "--temperature", "1.0",
        "--prompts-per-shard", "2", "--no-progress", "--kernels", "default"]


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
    assert main([*ARGS, "--output", str(out), "--resume", "--length", "6"]) == 2
    assert "holds another dense data set" in capsys.readouterr().err
    assert main([*ARGS, "--output", str(tmp_path / "new"), "--resume"]) == 2
    assert "holds no dense data set" in capsys.readouterr().err
    assert main([*ARGS, "--output", str(tmp_path / "x"), "--verifiers", "rsd"]) == 2
    assert "not i.i.d. draws" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "new").exists()
