"""`ddte relabel`: new step times and pass-time features from another latency table, everything else unchanged,
a whole folder or none, and clean refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from ddte.cli import main
from decode.cost.table import LatencyTable
from decode.drafting.actions import action_grid
from decode.policies.features import SCALAR_NAMES
from selector.root.root_data import inspect_dataset, load_rows
from tests.data_gen.test_collect import _rows
from tests.factories import tiny_llama

# Another machine: every pass twice as slow as the collection's table, and non-linear in the block size.
OTHER = LatencyTable([8, 16, 32], [1, 2, 3, 5], [[2.0, 3.5, 3.0, 4.0], [2.5, 4.0, 3.5, 4.5], [3.0, 4.5, 4.0, 5.0]],
                     [[10.0, 14.0, 12.0, 16.0], [11.0, 15.0, 13.0, 17.0], [14.0, 18.0, 16.0, 20.0]])


@pytest.fixture(scope="module")
def collected(tiny_collected) -> Path:
    return tiny_collected


def _relabel(args: list[str], capsys) -> tuple[int, str]:
    code = main(["relabel", "--no-progress", *args])
    return code, capsys.readouterr().err


def test_step_times_and_pass_time_features_follow_the_new_table(collected, tmp_path, capsys):
    table_file = tmp_path / "other.json"
    table_file.write_text(OTHER.to_json())
    before = {p.name: p.read_bytes() for p in collected.iterdir()}
    out = tmp_path / "relabelled"
    code, err = _relabel(["--data", str(collected), "--output", str(out), f"latency.file={table_file}"], capsys)
    assert code == 0, err
    assert {p.name: p.read_bytes() for p in collected.iterdir()} == before  # the source is never touched
    old_rows, new_rows = _rows(collected), _rows(out)
    actions = action_grid(2, 2)
    assert len(new_rows) == len(old_rows) > 0
    context = SCALAR_NAMES.index("context_length")
    timed = [SCALAR_NAMES.index("draft_ms"), SCALAR_NAMES.index("target_ms")]
    for old, new in zip(old_rows, new_rows, strict=True):
        length = int(new["scalars"][context])
        want = [OTHER.step_ms(length, a) for a in actions]  # Eq. 11 action by action
        np.testing.assert_allclose(new["step_ms"], want, rtol=1e-6)
        np.testing.assert_allclose([new["scalars"][i] for i in timed], OTHER.pass_times(length), rtol=1e-6)
        assert [v for i, v in enumerate(new["scalars"]) if i not in timed] == \
               [v for i, v in enumerate(old["scalars"]) if i not in timed]
        assert {k: v for k, v in new.items() if k not in ("step_ms", "scalars")} == \
               {k: v for k, v in old.items() if k not in ("step_ms", "scalars")}
        assert new["step_ms"] != old["step_ms"]
    meta = json.loads((out / "dataset.json").read_text())
    old_meta = json.loads((collected / "dataset.json").read_text())
    assert LatencyTable(**meta["latency"]) == OTHER
    assert meta["relabelled"]["previous_latency"] == old_meta["latency"] and "hardware" not in meta["relabelled"]
    assert {k: v for k, v in meta.items() if k not in ("latency", "relabelled")} == \
           {k: v for k, v in old_meta.items() if k != "latency"}
    arrays = load_rows(inspect_dataset(out, "specinfer"))  # the selector reads it like any collection
    assert arrays.step_ms.shape == (len(new_rows), len(actions))


def test_measures_on_this_machine_with_the_collection_pair(collected, tmp_path, capsys):
    out, saved = tmp_path / "here", tmp_path / "here.json"
    args = ["--save-latency", str(saved), "--data", str(collected), "--output", str(out),
            "latency.file=null", "latency.lengths=[8,24]", "latency.sizes=null", "latency.repeats=1"]
    code, err = _relabel(args, capsys)
    assert code == 0, err
    meta = json.loads((out / "dataset.json").read_text())
    table = LatencyTable(**meta["latency"])
    assert table == LatencyTable.from_json(saved.read_text())
    assert table.lengths == [8, 24] and table.sizes == list(range(1, 1 + 2 + 2 * 2 + 1))  # every size to (2,2,2)
    assert all(ms > 0 for row in table.draft_ms + table.target_ms for ms in row)
    assert meta["relabelled"]["hardware"]["device"] == "cpu"


def test_bad_input_is_refused_without_writing(collected, tiny_pair, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    code, err = _relabel(["--data", str(collected), "--output", str(taken)], capsys)
    assert code == 2 and "exists" in err and not list(taken.iterdir())
    code, err = _relabel([str(collected), str(tmp_path / "w")], capsys)  # folders go with --data and --output
    assert code == 2 and "unexpected argument" in err and "--data DIR" in err

    code, err = _relabel(["--data", str(tmp_path), "--output", str(tmp_path / "x")], capsys)
    assert code == 2 and "not a collected data set" in err

    code, err = _relabel(["--data", str(collected), "--output", str(tmp_path / "y"), "latency.repeats=0"], capsys)
    assert code == 2 and "latency.repeats" in err

    other = tmp_path / "other-pair"
    tiny_llama(7, vocab=4096, hidden=48).save_pretrained(other / "target")  # another pair, another fingerprint
    tiny_llama(8, vocab=4096, hidden=16).save_pretrained(other / "draft")
    pair = yaml.safe_load((tiny_pair / "pair.yaml").read_text())
    (other / "pair.yaml").write_text(yaml.safe_dump({**pair, "target": str(other / "target"),
                                                     "draft": str(other / "draft")}))
    code, err = _relabel(["--data", str(collected), "--output", str(tmp_path / "z"), f"pair={other / 'pair.yaml'}",
                          "latency.file=null"], capsys)
    assert code == 2 and "not the pair this data set was collected with" in err
    assert "Traceback" not in err
    assert not [p for p in tmp_path.iterdir() if p.name in ("x", "y", "z") or p.name.startswith(".tmp-")]


def test_a_latency_table_of_another_pair_is_refused_before_anything_is_written(collected, tmp_path, capsys):
    from dataclasses import replace

    table_file = tmp_path / "foreign.json"
    table_file.write_text(replace(OTHER, pair="f" * 64, machine="another box").to_json())
    out = tmp_path / "relabelled"
    code, err = _relabel(["--data", str(collected), "--output", str(out), f"latency.file={table_file}"], capsys)
    assert code == 2 and "another pair" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
