"""`ddte pipeline`: every stage's settings checked before the first one (nothing created on a refusal), and the
whole job end to end on a tiny pair: data, selectors, bench, a policy file that generate and bench load."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ddte.cli import main
from decode.cost.table import LatencyTable
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
        (["train.config=/nonexistent.yaml"], "does not exist"),
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
    assert main(_argv(tiny, out, "expander.enabled=true", "expander.folds=2")) == 0
    printed = capsys.readouterr().out
    assert "| deploy |" in printed and "policy.json" in printed
    for name in ("data/dataset.json", "mlflow.db", "selectors/specinfer.onnx", "selectors/traversal.onnx",
                 "expanders/specinfer.onnx", "expanders/traversal.onnx", "bench.json", "bench.png", "policy.json",
                 "results.md"):
        assert (out / name).exists(), name
    policy = json.loads((out / "policy.json").read_text())
    assert {k: policy["source"][k] for k in ("bench", "data")} == {"bench": "bench.json", "data": "data"}  # beside it
    assert "torch thread" in policy["source"]["machine"]  # the machine whose bench chose the static trees
    assert {(c["verifier"], c["temperature"]) for c in policy["choices"]} == {
        (v, t) for v in ("specinfer", "traversal") for t in (0.6, 1.0)}
    bench_file = json.loads((out / "bench.json").read_text())
    for choice in policy["choices"]:
        assert choice["policy"] in ("static", "selector") and choice["reason"]
        assert choice["policy"] == "static" or choice["tokens_per_s"] > choice["static_tokens_per_s"]
        benched = bench_file["settings"]["candidates"][choice["verifier"]][str(choice["temperature"])]
        assert len(benched) >= 2  # the training split's runners-up were benched
        assert choice["action"] == benched[0]  # one prompt gives no interval: the training split's choice stays
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ddte-pipeline").experiment_id
    parent = client.search_runs([experiment], filter_string="tags.`mlflow.runName` = 'pipeline'")[0]
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert {r.data.tags["mlflow.runName"] for r in children} >= {"collect", "train-specinfer", "train-traversal",
                                                                   "bench"}
    bench = next(r for r in children if r.data.tags["mlflow.runName"] == "bench")
    timed = sum(row["wall_seconds"] for row in bench_file["rows"])
    assert bench.info.end_time - bench.info.start_time >= 1000 * timed  # the run spans the bench it records
    assert "ar/T0.6/tokens_per_s" in bench.data.metrics
    assert any(k.endswith("/mean_acceptance_length") for k in bench.data.metrics)
    assert any(k.endswith("/acceptance_rate_pos1") for k in bench.data.metrics)
    assert parent.info.status == "FINISHED" and "deploy/specinfer/T0.6" in parent.data.tags
    generated = tmp_path / "g.jsonl"
    assert main(["generate", "--prompt-ids", "5,9,3", "--pair", str(tiny / "pair.yaml"), "--policy-file",
                 str(out / "policy.json"), "--max-new-tokens", "4", "--output", str(generated)]) == 0
    assert len(json.loads(generated.read_text())["tokens"]) == 4


def _bench_row(method: str, temperature: float, seconds: float, prompts: int = 4) -> dict:
    per_prompt = [{"prompt": i, "repeat": 0, "new_tokens": 100.0, "wall_seconds": seconds * (1 + 0.1 * i)}
                  for i in range(prompts)]
    return {"method": method, "temperature": temperature, "per_prompt": per_prompt,
            "tokens_per_s": 100.0 * prompts / sum(p["wall_seconds"] for p in per_prompt)}


def _selector_metadata(fallback: str, margin: float | None):
    from decode.policies.files.sampling_table import SamplingTable
    from decode.policies.files.selector_file import Fallback

    return SimpleNamespace(guard_table=lambda: SamplingTable.of([Fallback(1.0, 1.0, fallback, margin)]))


def test_static_candidates_are_the_fallback_then_the_training_split_runners_up():
    from ddte.pipeline import static_candidates
    from decode.drafting.sampling import SamplingConfig

    sampling = [SamplingConfig(0.6), SamplingConfig(1.0)]
    ranking = {0: ["1,3,0", "1,7,0", "1,5,0"], 1: ["1,5,0", "2,1,3", "1,3,0"]}
    metadata = _selector_metadata("1,0,3", None)
    chosen = static_candidates(metadata, sampling, ranking, [0.6, 0.9], 3)
    assert chosen == {0.6: ["1,3,0", "1,7,0", "1,5,0"], 0.9: ["1,3,0", "1,5,0", "2,1,3"]}  # 0.9: the T = 1 ranking
    assert static_candidates(metadata, sampling, ranking, [0.6], 1) == {0.6: ["1,3,0"]}
    assert static_candidates(metadata, sampling, {}, [0.6], 3) == {0.6: ["1,3,0"]}  # no ranking


@pytest.mark.parametrize(
    ("margin", "selector_seconds", "policy", "action"),
    [
        (None, 0.5, "static", "1,5,0"),  # guard off: the runner-up that beat the training split's choice clearly
        (0.01, 0.95, "static", "1,5,0"),  # beats the fallback (1.0 s) but not the kept static (0.9 s)
        (0.01, 0.85, "selector", "1,3,0"),  # beats the kept static; its fallback is recorded
    ],
)
def test_the_decision_deploys_the_fastest_measured_policy(tmp_path, margin, selector_seconds, policy, action):
    from ddte.pipeline import decide

    path = tmp_path / "selectors" / "traversal.onnx"
    actions = ["1,3,0", "1,5,0", "1,7,0"]
    rows = [_bench_row(f"traversal@{a}", 0.6, s) for a, s in zip(actions, (1.0, 0.9, 1.1), strict=True)]
    rows.append(_bench_row(f"traversal@selector={path}", 0.6, selector_seconds))
    [choice] = decide(rows, {"traversal": {0.6: actions}}, {"traversal": _selector_metadata("1,0,3", margin)},
                      {"traversal": path}, tmp_path)
    assert (choice.policy, choice.action) == (policy, action)
    assert choice.static_tokens_per_s == pytest.approx(rows[1]["tokens_per_s"])
    assert choice.selector == ("selectors/traversal.onnx" if policy == "selector" else None)
    assert "(1,5,0) ran 1.111× the training split's choice (1,3,0)" in choice.reason
    assert "beyond this bench's noise" in choice.reason and "other half" in choice.reason


def test_the_decision_deploys_an_expander_that_beat_the_kept_static_and_the_selector(tmp_path, monkeypatch):
    from ddte.pipeline import decide, keep_statics
    from ddte.pipeline import results as pipeline_results

    selector, expander = tmp_path / "selectors" / "traversal.onnx", tmp_path / "expanders" / "traversal.onnx"
    actions = ["1,3,0", "1,5,0"]
    rows = [_bench_row(f"traversal@{a}", 0.6, s) for a, s in zip(actions, (1.0, 1.05), strict=True)]
    rows += [_bench_row(f"traversal@selector={selector}", 0.6, 0.95),
             _bench_row(f"traversal@expander={expander}", 0.6, 0.9)]
    candidates = {"traversal": {0.6: actions}}
    kept = keep_statics(rows, candidates)
    [choice] = decide(rows, candidates, {"traversal": _selector_metadata("1,0,3", 0.01)}, {"traversal": selector},
                      tmp_path, kept, {"traversal": expander})
    assert (choice.policy, choice.action, choice.expander, choice.selector) == (
        "expander", "1,3,0", "expanders/traversal.onnx", None)
    assert "the selector ran at 1.053×" in choice.reason and "the expander ran at 1.111×" in choice.reason
    slow = [r if "expander" not in r["method"] else _bench_row(f"traversal@expander={expander}", 0.6, 1.2)
            for r in rows]
    [static] = decide(slow, candidates, {"traversal": _selector_metadata("1,0,3", None)}, {"traversal": selector},
                      tmp_path, kept, {"traversal": expander})
    assert static.policy == "static" and static.expander is None and "the expander ran at 0.833×" in static.reason
    monkeypatch.setattr(pipeline_results, "head_room_lines", lambda data_dir, verifiers: [])
    bench = {"rows": rows, "settings": {"bench": {"num_prompts": 4, "repeats": 1, "max_new_tokens": 100}}}
    text = pipeline_results.results_markdown(bench, {}, candidates, kept, [choice], {}, tmp_path)
    [row] = [line for line in text.splitlines() if line.startswith("| 0.6 | traversal |")]
    assert row.endswith("| 91.5 | 1.053 | - | 96.6 | 1.111 | expander (expanders/traversal.onnx) |")


def test_a_policy_ahead_of_the_kept_static_only_within_the_bench_noise_is_not_deployed(tmp_path):
    """An expander faster on average but slower on some prompts (its paired interval holds 1) leaves the static."""
    from ddte.pipeline import decide, keep_statics

    selector, expander = tmp_path / "selectors" / "traversal.onnx", tmp_path / "expanders" / "traversal.onnx"
    candidates = {"traversal": {0.6: ["1,0,0"]}}
    static = _bench_row("traversal@1,0,0", 0.6, 1.0, prompts=6)
    noisy = _bench_row(f"traversal@expander={expander}", 0.6, 1.0, prompts=6)
    for p, factor in zip(noisy["per_prompt"], (0.8, 1.1, 0.85, 1.12, 0.9, 1.05), strict=True):
        p["wall_seconds"] *= factor  # ahead on three prompts, behind on three
    noisy["tokens_per_s"] = 600.0 / sum(p["wall_seconds"] for p in noisy["per_prompt"])
    assert noisy["tokens_per_s"] > static["tokens_per_s"]
    rows = [static, noisy]
    kept = keep_statics(rows, candidates)
    [choice] = decide(rows, candidates, {"traversal": _selector_metadata("1,0,0", None)}, {"traversal": selector},
                      tmp_path, kept, {"traversal": expander})
    assert choice.policy == "static" and choice.expander is None
    assert "within this bench's noise" in choice.reason and "90% interval" in choice.reason


def test_results_md_says_why_a_selector_whose_guard_never_leaves_its_fallback_has_no_figures(tmp_path, monkeypatch):
    """A selector left out of the bench (its guard never leaves the fallback) reads as exactly that in results.md and
    policy.json's reason, not as a guard that was switched off."""
    from ddte.pipeline import decide, keep_statics
    from ddte.pipeline import results as pipeline_results

    monkeypatch.setattr(pipeline_results, "head_room_lines", lambda data_dir, verifiers: [])
    actions = ["1,3,0", "2,1,3"]
    rows = [_bench_row("ar", 0.6, 2.0)] + [_bench_row(f"traversal@{a}", 0.6, s)
                                           for a, s in zip(actions, (1.0, 1.1), strict=True)]
    candidates = {"traversal": {0.6: actions}}
    kept = keep_statics(rows, candidates)
    [choice] = decide(rows, candidates, {"traversal": _selector_metadata("1,0,3", None)},
                      {"traversal": tmp_path / "selectors" / "traversal.onnx"}, tmp_path, kept)
    assert choice.policy == "static" and "guard never leaves its fallback here" in choice.reason
    bench = {"rows": rows, "settings": {"bench": {"num_prompts": 4, "repeats": 1, "max_new_tokens": 100}}}
    text = pipeline_results.results_markdown(bench, {}, candidates, kept, [choice], {}, tmp_path)
    [row] = [line for line in text.splitlines() if line.startswith("| 0.6 | traversal |")]
    assert "| = fallback (its guard never leaves it here: not benched) | - | 0 % | - | - | (1,3,0) |" in row
    assert "guard off" not in text + choice.reason and "guard is off" not in choice.reason
