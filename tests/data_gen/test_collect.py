"""`ddte collect` on a tiny random pair: rows and metadata, resume and sharding, features shared with the decoder,
and clean failures on bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from data_gen.collection import collect
from data_gen.config import load_collect_config
from ddte.cli import main
from decode.cost.table import LatencyTable
from decode.drafting.actions import Action, action_grid
from decode.pair import DEFAULT_TOKENIZER
from tests.factories import collect_overrides, tiny_llama


def _overrides(folder: Path, out: Path, **extra) -> list[str]:
    return collect_overrides(folder, out, **extra)


def _rows(out: Path) -> list[dict]:
    """Every row, in a fixed order, with NaN written as None so that rows compare equal."""

    def clean(value):
        if isinstance(value, list):
            return [None if isinstance(v, float) and math.isnan(v) else v for v in value]
        return value

    rows = [
        {k: clean(v) for k, v in r.items()}
        for shard in sorted(out.glob("shard-*.parquet"))
        for r in pq.read_table(shard).to_pylist()
    ]
    return sorted(rows, key=lambda r: (int(r["prompt_id"]), r["sampling_index"], r["root_position"]))


def test_collect_writes_rows_and_metadata(tiny_pair, tmp_path):
    from ddte_core.machine import cpu_model

    out = tmp_path / "data"
    summary = collect(load_collect_config(None, _overrides(tiny_pair, out)), progress=False)
    rows = _rows(out)
    meta = json.loads((out / "dataset.json").read_text())
    assert summary.roots == len(rows) > 0
    assert meta["actions"] == [f"{a.k},{a.l1},{a.l2}" for a in action_grid(2, 2)]
    assert meta["label_columns"] == ["be_specinfer", "be_traversal", "be_gbv"]
    assert meta["hidden_sizes"] == {"target_hidden_prev": 32, "draft_hidden_prev": 16, "draft_hidden_root": 16}
    assert len(meta["pair"]["fingerprint"]) == 64 and meta["latency"]["lengths"] == [8, 32]
    assert {r["sampling_index"] for r in rows} == {0, 1}
    for row in rows:
        assert len(row["target_hidden_prev"]) == 32 and len(row["draft_hidden_root"]) == 16
        assert len(row["scalars"]) == 11 and len(row["step_ms"]) == 18 and len(row["l1_by_depth"]) == 4
        assert len(row["accept_specinfer"]) == 3 and "accept_traversal" not in row
        for name in ("be_specinfer", "be_traversal"):
            assert all(1.0 - 1e-6 <= v <= 5.0 + 1e-6 for v in row[name])
        assert row["be_specinfer"][0] == pytest.approx(1.0)  # (1, 0, 0): nothing drafted
        assert row["be_specinfer"] != row["be_traversal"] or row["be_specinfer"][1] == pytest.approx(2.0)
        for name in ("specinfer", "traversal", "gbv"):  # per-tree labels (s = 2 trees) average to the stored mean
            trees = np.array(row[f"be_trees_{name}"], dtype=float).reshape(2, 18)
            np.testing.assert_allclose(trees.mean(axis=0), np.array(row[f"be_{name}"], dtype=float),
                                       rtol=1e-5, equal_nan=True)
        accept, beta = (np.array(row[c]).reshape(2, 4) for c in ("trunk_accept", "trunk_beta"))
        assert ((0 <= accept) & (accept <= 1 + 1e-6)).all() and ((0 <= beta) & (beta <= 1 + 1e-6)).all()
    assert meta["schema_version"] == 3
    assert meta["hardware"]["cpu"] == cpu_model() and meta["hardware"]["device"] == "cpu" and meta["versions"]["torch"]
    assert meta["trunk_columns"] == ["trunk_accept", "trunk_beta", "trunk_draft_hidden", "trunk_draft_entropy",
                                     "trunk_draft_top", "trunk_draw_q", "trunk_draw_rank", "trunk_draw_top"]
    for row in rows:  # the draft's state at trunk depths 0..L_max of each of the 2 trees; depth 0 is the root
        hidden = np.array(row["trunk_draft_hidden"]).reshape(2, 3, 16)
        np.testing.assert_allclose(hidden[:, 0], np.tile(row["draft_hidden_root"], (2, 1)), rtol=1e-5, atol=1e-6)
        entropy, top = (np.array(row[c]).reshape(2, 3) for c in ("trunk_draft_entropy", "trunk_draft_top"))
        assert (entropy >= -1e-6).all() and ((0 < top) & (top <= 1 + 1e-6)).all()
        draw_q, rank, draw_top = (np.array(row[c]).reshape(2, 3) for c in ("trunk_draw_q", "trunk_draw_rank",
                                                                           "trunk_draw_top"))
        assert (draw_q[:, 0] == 1).all() and (rank[:, 0] == 0).all()  # at the root nothing was drawn
        assert ((0 < draw_q) & (draw_q <= draw_top + 1e-7)).all() and (rank >= 0).all()
        np.testing.assert_allclose(draw_top[:, 1:], top[:, :-1], rtol=1e-6)  # drawn from the law one level up
        np.testing.assert_allclose(entropy[:, 0], row["scalars"][2], rtol=1e-4)  # entropy_q_root
    assert meta["tree_columns"] == ["be_trees_specinfer", "be_trees_traversal", "be_trees_gbv"]


def test_resume_after_interruption_gives_the_same_rows(tiny_pair, tmp_path, monkeypatch):
    full = tmp_path / "full"
    collect(load_collect_config(None, _overrides(tiny_pair, full)), progress=False)
    part = tmp_path / "part"
    import data_gen.workers as cli_module

    real_write, calls = cli_module.write_shard, []

    def dying_write(rows, path, labels):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while the second shard is being written
        real_write(rows, path, labels)

    monkeypatch.setattr(cli_module, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        collect(load_collect_config(None, _overrides(tiny_pair, part)), progress=False)
    assert len(list(part.glob("shard-*.parquet"))) == 1
    monkeypatch.setattr(cli_module, "write_shard", real_write)
    with pytest.raises(Exception, match="--resume"):
        collect(load_collect_config(None, _overrides(tiny_pair, part)), progress=False)
    summary = collect(load_collect_config(None, _overrides(tiny_pair, part)), resume=True, progress=False)
    assert summary.shards_skipped == 1
    assert _rows(part) == _rows(full)


def test_shards_split_prompts_without_overlap(tiny_pair, tmp_path):
    whole = tmp_path / "whole"
    collect(load_collect_config(None, _overrides(tiny_pair, whole, verifiers="[specinfer]")), progress=False)
    split = tmp_path / "split"
    for i in range(2):
        collect(load_collect_config(None, _overrides(tiny_pair, split, verifiers="[specinfer]")), i, 2, resume=i > 0,
                progress=False)
    assert _rows(split) == _rows(whole)


def test_two_worker_processes_write_the_same_rows_as_one(tiny_pair, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    collect(load_collect_config(None, _overrides(tiny_pair, one, verifiers="[specinfer]")), progress=False)
    collect(load_collect_config(None, _overrides(tiny_pair, two, verifiers="[specinfer]", workers=2)), progress=False)
    assert _rows(two) == _rows(one)


@pytest.mark.parametrize("chunk", [1024, 7])
def test_target_rows_equal_a_prefill_of_each_node(tiny_pair, chunk):
    """The per-sample tree passes (split into chunks) give every internal node the p of its whole prefix."""
    from data_gen.collector import Collector
    from data_gen.union import grow_union_forest
    from decode.drafting.sampling import SamplingConfig, distributions
    from decode.models.cached_lm import CachedLM
    from decode.models.loading import load_causal_lm
    from decode.verifiers import get_verifier

    target, draft = (CachedLM(load_causal_lm(tiny_pair / n)) for n in ("target", "draft"))
    latency = LatencyTable([8, 32], [1, 4], [[1.0, 2.0], [1.5, 2.5]], [[5.0, 6.0], [7.0, 9.0]])
    collector = Collector(target, draft, [get_verifier("nss")], action_grid(3, 2), latency, k_max=3, l_max=2,
                          trees_per_root=3, new_tokens=1, stride=1, seed=0, target_chunk=chunk)
    sampling, ids = SamplingConfig(1.0, 1.0), [5, 17, 300, 42, 9]
    p_root = distributions(target.prefill(ids)[-1], sampling)
    q_root = distributions(draft.prefill(ids)[-1], sampling)
    forest = grow_union_forest(q_root, collector._draft_expander(sampling), 3, 3, 2, torch.Generator().manual_seed(1))
    draft.commit([])
    p = collector._target_rows(forest, p_root, sampling)
    assert target.length == len(ids) and target.num_speculative == 0
    reference = CachedLM(load_causal_lm(tiny_pair / "target"))
    internal = forest.internal_nodes()
    assert len(internal) > 10
    for v in internal:
        path, u = [], v
        while u != 0:
            path.append(forest.tokens[u])
            u = forest.parents[u]
        want = distributions(reference.prefill(ids + path[::-1])[-1], sampling)
        torch.testing.assert_close(p[v], want, rtol=1e-4, atol=1e-6)
    leaves = sorted(set(range(forest.num_nodes)) - set(internal))
    assert float(p[leaves].abs().sum()) == 0.0


@pytest.mark.parametrize("steered", [False, True], ids=["plain", "steered"])
def test_features_match_the_decoder(tiny_pair, steered):
    """The first root's features: the collector's (full prefill) vs the decoder's (incremental) state. A steered
    draft (decode.models.steering) is steered alike in both: the root under the δ of the token before it. The
    steered case fails if either runs its root unsteered (the map moves the draft's states far beyond 1e-5)."""
    from data_gen.collector import Collector, TrajectoryJob
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.engine import SpeculativeDecoder
    from decode.models.cached_lm import CachedLM
    from decode.models.loading import load_causal_lm
    from decode.models.steering import SteeringMap, SteeringSpec, draft_mlp_shape, link_steering
    from decode.policies.base import StaticPolicy
    from decode.verifiers import get_verifier

    def pair():
        target, draft = (CachedLM(load_causal_lm(tiny_pair / n)) for n in ("target", "draft"))
        if steered:
            spec = SteeringSpec((0, 1), target.config.hidden_size, 4, *draft_mlp_shape(draft.model))
            torch.manual_seed(0)  # the same map in both runs
            steering = SteeringMap(spec)
            with torch.no_grad():
                steering.out.weight.normal_(0.0, 1.0)
            link_steering(draft, target, steering)  # linked: the decoder and the collector know nothing of it
        return target, draft

    latency = LatencyTable([8, 32], [1, 4], [[1.0, 2.0], [1.5, 2.5]], [[5.0, 6.0], [7.0, 9.0]])
    sampling = SamplingConfig(0.8, 0.95)
    ids = [5, 17, 300, 42, 9, 77, 1000]

    class Keep(StaticPolicy):
        needs_root_features = True

        def choose(self, root):
            self.features = getattr(self, "features", None) or root.features
            return super().choose(root)

    target, draft = pair()
    policy = Keep(action=Action(2, 1, 1))
    SpeculativeDecoder(target, draft, get_verifier("specinfer"), latency=latency).generate(
        ids, 3, policy, TorchRandom(0), sampling
    )
    target, draft = pair()
    collector = Collector(target, draft, [get_verifier("specinfer")], action_grid(2, 1), latency, k_max=2, l_max=1,
                          trees_per_root=1, new_tokens=1, stride=1, seed=0)
    row = collector.trajectory_rows(TrajectoryJob(0, ids, 0, sampling, 0))[0]
    want = policy.features
    torch.testing.assert_close(torch.tensor(row["scalars"]), want.scalars, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(row["target_hidden_prev"]), want.target_hidden_prev, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(row["draft_hidden_prev"]), want.draft_hidden_prev, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(row["draft_hidden_root"]), want.draft_hidden_root, rtol=1e-5, atol=1e-5)


def _cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(["collect", "--no-progress", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompts.field": "text"}, "no field 'text'"),
        ({"verifiers": "[specinfer, bogus]"}, "unknown verifier 'bogus'"),
        ({"prompts.source": "/nonexistent/prompts.jsonl"}, "prompt file not found"),
    ],
)
def test_bad_input_fails_cleanly(tiny_pair, tmp_path, capsys, change, message):
    out = tmp_path / "out"
    code, err = _cli(_overrides(tiny_pair, out, **change), capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert not list(out.glob("shard-*")) and not list(out.glob(".tmp-*"))


def test_empty_prompt_set_and_vocab_mismatch_fail_cleanly(tiny_pair, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = _cli(_overrides(tiny_pair, tmp_path / "a", **{"prompts.source": str(empty)}), capsys)
    assert code == 2 and "no prompts" in err
    tiny_llama(3, vocab=4000, hidden=16).save_pretrained(tmp_path / "odd")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"target": str(tiny_pair / "target"), "draft": str(tmp_path / "odd"),
                                   "tokenizer": str(DEFAULT_TOKENIZER)}))
    code, err = _cli(_overrides(tiny_pair, tmp_path / "b", **{"pair": str(bad)}), capsys)
    assert code == 2 and "vocab" in err.lower()
    assert not list((tmp_path / "b").glob("shard-*"))


def test_unwritable_output_fails_cleanly(tiny_pair, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, err = _cli(_overrides(tiny_pair, blocker / "out"), capsys)
    assert code == 2 and "is a file, not a folder" in err


def test_a_different_config_in_the_same_folder_is_refused(tiny_pair, tmp_path, capsys):
    out = tmp_path / "out"
    collect(load_collect_config(None, _overrides(tiny_pair, out, verifiers="[specinfer]")), progress=False)
    for shard in out.glob("shard-*.parquet"):
        shard.unlink()  # an emptied folder still holds the old dataset.json
    code, err = _cli(_overrides(tiny_pair, out, verifiers="[traversal]"), capsys)
    assert code == 2 and "different config" in err and "verifiers" in err
    assert not list(out.glob("shard-*"))


@pytest.mark.parametrize(
    ("override", "message"),
    [("latency.sizes=[]", "latency.sizes"), ("latency.sizes=[0,4]", "latency.sizes"),
     ("latency.lengths=[]", "latency.lengths"), ("latency.repeats=0", "latency.repeats")],
)
def test_a_bad_latency_grid_is_refused_at_load(override, message):
    with pytest.raises(ValueError, match=message):
        load_collect_config(None, [override])


def test_latency_sizes_default_to_every_block_size():
    assert load_collect_config(None, []).latency.sizes is None
    assert load_collect_config(None, ["latency.sizes=[1,4]"]).latency.sizes == [1, 4]


def test_a_collection_that_finds_no_roots_says_so_and_its_readers_call_it_empty(tiny_pair, tmp_path, capsys):
    """Trajectories that all end before their first root (one new token, a root every sixth step) write no shard:
    collect says so in one line and exits 2 rather than "1 shards written", and what reads the folder says it is
    empty rather than listing the columns it lacks."""
    out = tmp_path / "out"
    overrides = _overrides(tiny_pair, out, new_tokens=1, roots="steps", stride=6, prompts_per_shard=5,
                           **{"sampling.temperatures": "[0.7]", "verifiers": "[specinfer]"})
    code, err = _cli(overrides, capsys)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "collected no roots from 5 prompts: no shard written" in lines[0], lines
    assert not list(out.glob("shard-*"))
    for argv in (["expander", "--data", str(out), "--verifier", "specinfer", "--output", str(tmp_path / "e.onnx"),
                  "--no-mlflow"], ["train", "--data", str(out)], ["analyze", "--data", str(out)]):
        assert main(argv) == 2
        line = capsys.readouterr().err.strip().splitlines()
        assert len(line) == 1 and ("is empty" in line[0] or "holds no shards" in line[0] or "has no shards" in line[0]
                                   ), line


def test_the_summary_counts_the_shards_written_not_the_chunks_run(tiny_pair, tmp_path, capsys, monkeypatch):
    """A chunk whose trajectories reach no root writes no shard: the summary counts only the shards on disk."""
    from data_gen import workers

    out = tmp_path / "out"
    real = workers.write_shard
    seen = []

    def only_the_first(rows, path, labels):  # the second chunk's rows are dropped, as a chunk without roots
        seen.append(path)
        if len(seen) == 1:
            real(rows, path, labels)

    monkeypatch.setattr(workers, "write_shard", only_the_first)
    code = main(["collect", "--no-progress", *_overrides(tiny_pair, out, **{"prompts.limit": 4})])
    summary = capsys.readouterr().out
    assert code == 0 and len(seen) == 2, seen
    assert "1 shards written" in summary and len(list(out.glob("shard-*"))) == 1, summary
