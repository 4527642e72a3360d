"""`ddte collect --engine ray` on a local Ray: the cases tests/data_gen/test_ray_engine.py runs in a network
namespace with only loopback up (pytest does not collect this file by itself: its name has no ``test_`` prefix).

Run them alone with
  unshare --user --map-root-user --net sh -c \
    'ip link set lo up && exec .venv/bin/python -m pytest tests/data_gen/ray_cases.py'
"""

from __future__ import annotations

import json
import logging
import os
import socket

import pytest

from data_gen.collection import collect
from data_gen.config import load_collect_config
from data_gen.ray_pool import TEST_KILL_ENV
from ddte.cli import main
from tests.factories import collect_overrides, shard_rows, tiny_llama
from tests.isolation import ANY_NETWORK

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def kill_hook(tmp_path_factory):
    """One local Ray for the module, on loopback; yields the file that arms the test hook killing one actor."""
    interfaces = [name for _, name in socket.if_nameindex()]
    assert interfaces == ["lo"] or os.environ.get(ANY_NETWORK) == "1", (
        f"the Ray tests run where loopback is the only interface (found {interfaces}): see tests/isolation.py")
    arm = tmp_path_factory.mktemp("hook") / "kill-one-actor"
    os.environ[TEST_KILL_ENV] = str(arm)  # before Ray starts: its workers inherit it
    ray.init(address="local", num_cpus=3, _node_ip_address="127.0.0.1", include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)
    yield arm
    ray.shutdown()
    os.environ.pop(TEST_KILL_ENV)


def _ray_overrides(folder, out, workers: int, **extra) -> list[str]:
    return collect_overrides(folder, out, engine="ray", workers=workers, **extra)


def _metadata(folder) -> dict:
    """dataset.json without its config (output, engine and workers differ between equal collections)."""
    meta = json.loads((folder / "dataset.json").read_text())
    meta.pop("config")
    return meta


def test_a_ray_collection_equals_a_one_worker_collection_row_for_row(tiny_pair, tiny_collected, tmp_path,
                                                                     monkeypatch):
    def no_models(*args, **kwargs):
        raise AssertionError("the driver loads only the tokenizer")

    monkeypatch.setattr("decode.pair.load_pair", no_models)  # the actors' own processes are untouched
    out = tmp_path / "data"
    summary = collect(load_collect_config(None, _ray_overrides(tiny_pair, out, 2)), progress=False)
    assert (summary.shards_written, summary.shards_skipped) == (3, 0)
    assert shard_rows(out) == shard_rows(tiny_collected)
    assert _metadata(out) == _metadata(tiny_collected)


def test_a_killed_actor_is_restarted_and_its_chunk_run_again(kill_hook, tiny_pair, tiny_collected, tmp_path):
    out = tmp_path / "data"
    kill_hook.write_text("armed")
    summary = collect(load_collect_config(None, _ray_overrides(tiny_pair, out, 2)), progress=False)
    assert not kill_hook.exists()  # an actor removed it, then died in the middle of its chunk
    assert summary.shards_written == 3
    assert shard_rows(out) == shard_rows(tiny_collected)


def test_resume_with_another_worker_count_skips_finished_chunks(tiny_pair, tiny_collected, tmp_path):
    out = tmp_path / "data"
    first = collect(load_collect_config(None, collect_overrides(tiny_pair, out)), 0, 2, progress=False)
    assert first.shards_written == 2  # one local worker stopped with chunks 0 and 2 of 3 done
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    resumed = collect(load_collect_config(None, _ray_overrides(tiny_pair, out, 2)), resume=True, progress=False)
    assert (resumed.shards_written, resumed.shards_skipped) == (1, 2)
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert shard_rows(out) == shard_rows(tiny_collected)


def test_a_pair_an_actor_cannot_load_fails_with_one_line(tiny_pair, tmp_path, capsys):
    tiny_llama(3, vocab=4000, hidden=16).save_pretrained(tmp_path / "odd")
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({**json.loads((tiny_pair / "pair.yaml").read_text()), "draft": str(tmp_path / "odd")}))
    capsys.readouterr()
    code = main(["collect", "--no-progress", *_ray_overrides(tiny_pair, tmp_path / "out", 1, pair=str(bad))])
    err = capsys.readouterr().err
    assert code == 2 and "vocab" in err.lower() and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
