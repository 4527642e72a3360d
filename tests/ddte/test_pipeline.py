"""`ddte pipeline`: every stage's settings checked before the first one (nothing created on a refusal), and the
whole job end to end on a tiny pair: data, selectors, bench, a policy file that generate and bench load."""

from __future__ import annotations

import json

import pytest

from ddte.cli import main
from decode.latency import LatencyTable
from tests.factories import TINY_TRAIN_CONFIG, save_tiny_pair


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("pipeline-pair"), logit_scale=10.0)
    table = LatencyTable([8, 32], [1, 4], [[1.0, 2.0], [1.5, 2.5]], [[5.0, 6.0], [7.0, 9.0]])
    (root / "latency.json").write_text(table.to_json())
    return root


def _argv(tiny, out, *extra):
    collect = [f"pair={tiny / 'pair.yaml'}", "prompts.limit=6", "prompts.max_tokens=20", "new_tokens=10", "stride=5",
               "k_max=2", "l_max=2", "trees_per_root=2", "workers=1", "device=cpu",
               f"latency.file={tiny / 'latency.json'}", "verifiers=[specinfer, traversal]"]
    return ["pipeline", "--output", str(out), f"collect.overrides={json.dumps(collect)}",
            f"train.config={TINY_TRAIN_CONFIG}", "train.overrides=[trainer.max_epochs=2, model.objective=be]",
            "bench.num_prompts=1", "bench.max_new_tokens=6", *extra]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["train.verifiers=[gbv]"], "have no labels in the collection"),
        (["train.verifiers=[bogus]"], "unknown verifier 'bogus'"),
        (["train.overrides=[not-a-key-value]"], "is not KEY=VALUE"),
        (["train.config=/nonexistent.yaml"], "not found"),
        (["bench.num_prompts=0"], "bench"),
        (["collect.overrides=[verifiers=[a,b]]"], "not valid YAML"),
        (["collect.overrides=[prompts.limit=0]"], "prompts.limit"),
    ],
)
def test_bad_settings_are_refused_before_any_stage(tiny, tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    assert main(_argv(tiny, out, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()  # no empty folder left behind


def test_the_pipeline_runs_end_to_end_and_its_choice_deploys(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_argv(tiny, out)) == 0
    printed = capsys.readouterr().out
    assert "| deploy |" in printed and "policy.json" in printed
    for name in ("data/dataset.json", "mlflow.db", "selectors/specinfer.onnx", "selectors/traversal.onnx",
                 "bench.json", "bench.png", "policy.json", "results.md"):
        assert (out / name).exists(), name
    policy = json.loads((out / "policy.json").read_text())
    assert {(c["verifier"], c["temperature"]) for c in policy["choices"]} == {
        (v, t) for v in ("specinfer", "traversal") for t in (0.6, 1.0)}
    for choice in policy["choices"]:
        assert choice["policy"] in ("static", "selector") and choice["reason"]
        assert choice["policy"] == "static" or choice["tokens_per_s"] > choice["static_tokens_per_s"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ddte-pipeline").experiment_id
    parent = client.search_runs([experiment], filter_string="tags.`mlflow.runName` = 'pipeline'")[0]
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert {r.data.tags["mlflow.runName"] for r in children} >= {"collect", "train-specinfer", "train-traversal",
                                                                   "bench"}
    bench = next(r for r in children if r.data.tags["mlflow.runName"] == "bench")
    assert "ar/T0.6/tokens_per_s" in bench.data.metrics
    assert any(k.endswith("/mean_acceptance_length") for k in bench.data.metrics)
    assert any(k.endswith("/acceptance_rate_pos1") for k in bench.data.metrics)
    assert parent.info.status == "FINISHED" and "deploy/specinfer/T0.6" in parent.data.tags
    generated = tmp_path / "g.jsonl"
    assert main(["generate", "--prompt-ids", "5,9,3", "--pair", str(tiny / "pair.yaml"), "--policy-file",
                 str(out / "policy.json"), "--max-new-tokens", "4", "--output", str(generated)]) == 0
    assert len(json.loads(generated.read_text())["tokens"]) == 4
