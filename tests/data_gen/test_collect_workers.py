"""`ddte collect` with several workers on one folder, no Ray: chunk names that do not depend on the split (resume
with any shard count), two `--shard` processes started a moment apart, other workers' temporaries left alone, the
latency table measured once, and `--engine ray` without Ray installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from data_gen.collection import collect
from data_gen.config import load_collect_config
from ddte.cli import main
from tests.factories import collect_overrides, shard_rows

REPO = Path(__file__).resolve().parents[2]


def _config(pair: Path, out: Path, **extra):
    return load_collect_config(None, collect_overrides(pair, out, **extra))


def _start(pair: Path, out: Path, shard: str, **extra) -> subprocess.Popen:
    """``ddte collect --shard`` as its own process, as a SLURM array task runs it."""
    argv = [sys.executable, "-m", "ddte", "collect", "--no-progress", "--shard", shard,
            *collect_overrides(pair, out, **extra)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(*procs: subprocess.Popen) -> list[str]:
    """Each process's stderr, once all have exited 0."""
    errs = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        errs.append(err)
    return errs


def test_resume_with_another_shard_count_skips_finished_chunks(tiny_pair, tiny_collected, tmp_path):
    out = tmp_path / "data"
    first = collect(_config(tiny_pair, out), 0, 2, progress=False)  # a 2-way run whose shard 1 never ran
    assert (first.shards_written, first.shards_skipped) == (2, 0)  # chunks 0 and 2 of 3
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    resumed = collect(_config(tiny_pair, out), resume=True, progress=False)  # now one worker, no split
    assert (resumed.shards_written, resumed.shards_skipped) == (1, 2)
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # not rewritten
    assert shard_rows(out) == shard_rows(tiny_collected)


def test_two_shard_processes_started_a_moment_apart_both_complete(tiny_pair, tmp_path):
    """Shard 1 starts first and waits for shard 0's dataset.json; shard 0 measures the latency table (once, for both)
    and collects beside it. Neither touches the other's files, nor a third worker's shard in flight."""
    out = tmp_path / "data"
    out.mkdir()
    writing = out / ".tmp-another-worker.parquet"  # a shard a third worker is writing right now
    writing.write_text("in flight")
    stale = out / ".tmp-killed-run.parquet"  # left by a run killed two hours ago
    stale.write_text("half a shard")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    grid = {"latency.file": "null", "latency.lengths": "[8]", "latency.sizes": "[1,2]", "latency.repeats": 1}
    second = _start(tiny_pair, out, "1/2", **grid)
    time.sleep(0.5)
    first = _start(tiny_pair, out, "0/2", **grid)  # no --resume: the other worker's shards are not this one's
    err_first, err_second = _finish(first, second)
    assert "waiting for shard 0" in err_second and "waiting" not in err_first
    assert writing.read_text() == "in flight" and not stale.exists()
    assert [p.name for p in out.glob(".tmp-*")] == [writing.name]  # no write probe or shard temporary left
    # the rows of one worker given the table shard 0 measured
    table = tmp_path / "latency.json"
    table.write_text(json.dumps(json.loads((out / "dataset.json").read_text())["latency"]))
    one = tmp_path / "one"
    collect(_config(tiny_pair, one, **{"latency.file": str(table)}), progress=False)
    assert shard_rows(out) == shard_rows(one) and len(shard_rows(one)) == 3


def test_engine_ray_without_ray_says_how_to_install_it(tiny_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code = main(["collect", "--no-progress", "--engine", "ray", *collect_overrides(tiny_pair, tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'ddte[ray]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_more_workers_than_chunks_start_one_worker_per_chunk_and_leave_no_lock(tiny_pair, tmp_path, monkeypatch):
    """`workers=8` on one chunk of work starts one worker (each would load the pair for nothing), and the finished
    shard's lock file is gone."""
    import data_gen.collection as collection

    started = []
    real = collection.open_engine

    def spy(config, measure):
        started.append(config.workers)
        return real(config, measure)

    monkeypatch.setattr(collection, "open_engine", spy)
    out = tmp_path / "data"
    summary = collect(_config(tiny_pair, out, workers=8, **{"prompts.limit": 2}), progress=False)
    assert started == [1] and summary.shards_written == 1
    assert not list(out.glob(".lock-*"))
