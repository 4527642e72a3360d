"""`ddte train` and `ddte distill` as one job on two CPU processes (``trainer.devices=2 trainer.strategy=ddp``:
Lightning's DDP over gloo) against one device: one MLflow run per job, logged by rank 0, and the same result files.

The two-process runs are subprocesses (Lightning's launcher re-executes ``sys.argv`` for rank 1, which pytest's own
process cannot be), in a loopback-only network namespace (tests/isolation.py); the one-device runs are in-process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddte.cli import main
from tests.distill.test_distill import _overrides as distill_overrides
from tests.factories import TINY_TRAIN_CONFIG, save_tiny_pair
from tests.isolation import run_loopback_only

REPO = Path(__file__).resolve().parents[2]
TWO_PROCESSES = ["trainer.devices=2", "trainer.strategy=ddp"]


def _run(args: list[str], processes: int) -> str:
    """``ddte ARGS`` on one device (in-process) or two (a subprocess); its stdout (and the subprocess's stderr)."""
    if processes == 1:
        assert main(args) == 0
        return ""
    code, output = run_loopback_only([sys.executable, "-m", "ddte", *args, *TWO_PROCESSES], cwd=REPO, timeout=400)
    assert code == 0, output[-5000:]
    return output


def _one_finished_run(uri: str):
    """The one MLflow run of the store at ``uri`` (any experiment)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.status for r in runs] == ["FINISHED"]
    return runs[0]


def test_train_on_two_processes_is_one_run_with_the_files_of_one_device(synthetic_dir, tmp_path, capsys):
    files = {}
    for processes in (1, 2):
        out = tmp_path / f"p{processes}"
        uri = f"sqlite:///{out / 'mlflow.db'}"
        output = _run(["train", "--config", str(TINY_TRAIN_CONFIG), "--data", str(synthetic_dir), "--tracking-uri",
                       uri, f"run.output_dir={out / 'runs'}", "trainer.max_epochs=2"], processes)
        run = _one_finished_run(uri)
        (folder,) = (out / "runs").iterdir()  # rank 0's alone
        assert folder.name.endswith(run.info.run_id)
        assert json.loads((folder / "summary.json").read_text())["run_id"] == run.info.run_id
        files[processes] = sorted(p.name for p in folder.iterdir())
        if processes == 2:
            assert output.count("MLflow run:") == 1  # rank 1 reports nothing
            assert "epoch 2/2" in output and output.count("epoch 2/2") == 1
    assert files[2] == files[1] == ["best.ckpt", "config.yaml", "summary.json"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("ddp-pair"), target_hidden=32, draft_hidden=16, logit_scale=4.0,
                          context=128)


def test_distill_on_two_processes_is_one_run_with_the_files_of_one_device(tiny, tmp_path):
    files = {}
    for processes in (1, 2):
        out = tmp_path / f"p{processes}"
        out.mkdir()
        output = _run(["distill", "--no-progress",
                       *distill_overrides(tiny, out, **{"train.steps": 8, "train.val_every": 4})], processes)
        run = _one_finished_run(f"sqlite:///{out / 'mlflow.db'}")
        summary = json.loads((out / "out" / "distill.json").read_text())
        assert summary["run_id"] == run.info.run_id and summary["steps"] == 8
        files[processes] = sorted(p.name for p in (out / "out").iterdir())
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no staging folder of any rank
        if processes == 2:
            assert output.count("wrote ") == 1  # rank 1 reports nothing
    assert files[2] == files[1]
