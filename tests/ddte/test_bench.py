"""`ddte bench` end to end on tiny models with the shipped tokenizer: table, JSON rows, plot, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddte.cli import main
from decode.pair import DEFAULT_TOKENIZER
from tests.factories import tiny_llama

pytestmark = pytest.mark.skipif(not (DEFAULT_TOKENIZER / "tokenizer.json").exists(), reason="shipped tokenizer absent")


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tiny_llama(seed=1, vocab=4096, hidden=32, layers=2).save_pretrained(root / "target")
    tiny_llama(seed=2, vocab=4096, hidden=32, layers=1).save_pretrained(root / "draft")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(3)))
    return root, prompts


def test_bench_writes_rows_and_plot(pair_dirs, tmp_path, capsys):
    root, prompts = pair_dirs
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--target", str(root / "target"), "--draft", str(root / "draft"),
        "--tokenizer", str(DEFAULT_TOKENIZER), "--prompts", str(prompts), "--field", "text",
        "--num-prompts", "2", "--max-new-tokens", "6",
        "--methods", "ar", "hf-assisted", "traversal@2,1,2", "specinfer@adaptive", "traversal@entropy",
        "--output", str(out),
    ])
    assert code == 0
    payload = json.loads(out.read_text())
    rows = {r["method"]: r for r in payload["rows"]}
    assert set(rows) == {"ar", "hf-assisted", "traversal@2,1,2", "specinfer@adaptive", "traversal@entropy"}
    # each policy row against the best static row of its own verifier (specinfer has none) and, where other
    # verifiers ran static rows too, against the best of any verifier (bench/compare.py)
    assert {(c["policy"], c["against"]) for c in payload["comparisons"]} == {
        ("traversal@entropy", "own verifier"), ("specinfer@adaptive", "any verifier")}
    [comparison] = [c for c in payload["comparisons"] if c["against"] == "own verifier"]
    assert comparison["policy"] == "traversal@entropy" and comparison["best_static"] == "traversal@2,1,2"
    want = rows["traversal@entropy"]["tokens_per_s"] / rows["traversal@2,1,2"]["tokens_per_s"]
    assert comparison["ratio_vs_best_static"] == pytest.approx(want)
    assert rows["ar"]["speedup"] == pytest.approx(1.0)
    assert all(r["tokens_per_s"] > 0 and r["new_tokens"] > 0 for r in rows.values())
    assert rows["traversal@2,1,2"]["mean_acceptance_length"] >= 1.0
    assert payload["environment"]["torch"] and (tmp_path / "bench.png").stat().st_size > 1000
    assert payload["environment"]["peak_rss_bytes"] > 0  # the stock rows keep the stock weights, and say so
    assert payload["environment"]["stock_weights"] == "kept: ar, hf-assisted read them"
    printed = capsys.readouterr().out
    assert "| traversal@2,1,2 |" in printed and "best static tree in this run" in printed
    assert "peak RSS " in printed and "stock weights kept: ar, hf-assisted read them" in printed


def test_a_bench_without_stock_rows_gives_the_stock_weights_back(pair_dirs, tmp_path, capsys):
    """Only ar-kernels beside ddte's rows: no row runs the stock models, so the pair holds its kernels' copies
    alone (decode/models/release.py), and AR on the target's kernels still runs."""
    from decode.models.kernels import KERNEL_PATHS

    if KERNEL_PATHS["onednn"].unavailable(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN fp32 on this torch build")
    root, prompts = pair_dirs
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(root / "target"), "--draft", str(root / "draft"), "--tokenizer",
                 str(DEFAULT_TOKENIZER), "--prompts", str(prompts), "--field", "text", "--num-prompts", "1",
                 "--max-new-tokens", "4", "--methods", "ar-kernels", "traversal@2,1,2", "--kernels", "onednn",
                 "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["environment"]["stock_weights"] == "given back: no row runs the stock models"
    assert all(row["new_tokens"] > 0 for row in payload["rows"])
    assert "stock weights given back" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--methods", "bogus@1,2,0"], "unknown verifier"), (["--methods", "block@2,0,2"], "not lossless"),
     (["--methods", "traversal"], "bad method"), (["--prompts", "/nonexistent.jsonl"], "nonexistent"),
     (["--minutes", "0"], "--minutes must be a positive"), (["--llama-cpp", "/nonexistent"], "no llama-server"),
     (["--methods", "llama-cpp"], "needs a llama-server")],
)
def test_bench_bad_input(pair_dirs, extra, message):
    root, prompts = pair_dirs
    args = ["bench", "--target", str(root / "target"), "--draft", str(root / "draft"), "--tokenizer",
            str(DEFAULT_TOKENIZER), "--num-prompts", "1", "--max-new-tokens", "4"]
    if "--prompts" not in extra:
        args += ["--prompts", str(prompts), "--field", "text"]
    result = subprocess.run([sys.executable, "-m", "ddte", *args, *extra], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-500:]
    assert message in result.stderr and "Traceback" not in result.stderr


def test_methods_run_interleaved_in_a_rotating_order():
    """Prompt by prompt, every method in turn, starting one method later each round: drift reaches all alike."""
    from bench import decoding as bench
    from bench.method import Method
    from decode.drafting.sampling import SamplingConfig
    from decode.stats import GenerationStats

    calls = []
    verifier = dict(zip("abc", ("nss", "specinfer", "traversal"), strict=True))

    class FakeRunner:
        def __init__(self, name):
            self.name, self.method, self.notes = name, Method.static(verifier[name], "1,2,0"), {}

        def one(self, ids, seed, sampling, max_new):
            calls.append((self.name, ids[0], seed, sampling.temperature, max_new))
            return GenerationStats(new_tokens=1, wall_seconds=0.1, network_seconds=[2e-6] * (self.name == "b"))

    settings = bench.BenchSettings(max_new_tokens=4, repeats=2, seed=5)
    runners = [FakeRunner(m) for m in "abc"]
    results = bench.bench_methods(runners, [[10], [11]], settings, SamplingConfig(0.6))
    warmup, timed = calls[:3], calls[3:]
    assert [c[:3] for c in warmup] == [("a", 10, 5), ("b", 10, 5), ("c", 10, 5)]
    assert [c[0] for c in timed] == list("abc" "bca" "cab" "abc")
    assert [c[1:3] for c in timed[::3]] == [(10, 5), (10, 1005), (11, 6), (11, 1006)]  # prompt, then repeat
    assert {c[3:] for c in calls} == {(0.6, 4)}  # the sampling settings travel with every call
    assert [r.stats.new_tokens for r in results] == [4, 4, 4]  # the warm-up is not counted
    assert [r.selector_call_us for r in results] == [None, pytest.approx(2.0), None]


@pytest.mark.parametrize(("seconds", "timed"), [(None, 6), (90.0, 3), (1.0, 2)])
def test_a_time_budget_ends_a_block_at_the_last_round_that_fits(monkeypatch, seconds, timed):
    """Each call of a method takes 10 clock seconds (a clock of the test's): a round of two methods 20. With 90 s
    the warm-up (20) and three timed rounds (80) fit, a fourth would not; a budget too short still runs two timed
    rounds (a paired interval needs them); no budget runs every prompt. Every method runs the same prompts."""
    from bench import decoding as bench
    from bench.method import Method
    from decode.drafting.sampling import SamplingConfig
    from decode.stats import GenerationStats

    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    class ClockedRunner:
        def __init__(self, verifier):
            self.method, self.notes = Method.static(verifier, "1,2,0"), {}

        def one(self, ids, seed, sampling, max_new):
            clock[0] += 10.0
            return GenerationStats(new_tokens=1, wall_seconds=10.0)

    settings = bench.BenchSettings(max_new_tokens=4, seconds=seconds)
    results = bench.bench_methods([ClockedRunner("nss"), ClockedRunner("traversal")], [[i] for i in range(6)],
                                  settings, SamplingConfig(1.0))
    assert [[p["prompt"] for p in r.per_prompt] for r in results] == [list(range(timed))] * 2


def test_one_decoder_per_verifier_serves_every_method_and_temperature(pair_dirs):
    """Methods of one verifier share a decoder; each method's policy is built once and started per generation."""
    from bench.decoding import BenchSettings, make_runners, open_bench, run_bench
    from bench.method import Method
    from decode.pair import load_pair

    root, _ = pair_dirs
    pair = load_pair(root / "target", root / "draft", DEFAULT_TOKENIZER)
    methods = [Method.parse(m) for m in ("ar", "traversal@2,1,2", "traversal@adaptive", "specinfer@1,3,0")]
    session = open_bench(pair, methods, kernels="default")
    ar, static, adaptive, other = make_runners(methods, session)
    assert ar.decoder is None and static.decoder is adaptive.decoder is not other.decoder
    rows = run_bench(methods[1:3], session, [[5, 9, 3]], BenchSettings(max_new_tokens=3), [0.0, 1.0])
    assert [(r["method"], r["temperature"]) for r in rows] == [
        ("traversal@2,1,2", 0.0), ("traversal@adaptive", 0.0), ("traversal@2,1,2", 1.0), ("traversal@adaptive", 1.0)]
    assert all(r["new_tokens"] == 3 for r in rows)


def test_a_method_with_another_draft_runs_that_draft_steered_beside_the_pairs_own(pair_dirs, tmp_path, capsys):
    """``+draft=FOLDER``: one decoder per (verifier, draft); a steered draft there is steered, the pair's own is not;
    a missing folder is one line."""
    import torch

    from bench.decoding import make_runners, open_bench
    from bench.method import Method
    from decode.drafting.sampling import SamplingConfig
    from decode.models.steering import SteeringLink, SteeringMap, SteeringSpec
    from decode.pair import load_pair, model_fingerprint

    root, prompts = pair_dirs
    other = tmp_path / "steered"
    tiny_llama(seed=3, vocab=4096, hidden=32, layers=1).save_pretrained(other)
    SteeringMap(SteeringSpec((1,), 32, 4, 1, 64, model_fingerprint(root / "target"))).save(other)
    pair = load_pair(root / "target", root / "draft", DEFAULT_TOKENIZER)
    methods = [Method.parse(m) for m in ("traversal@2,1,2", f"traversal@2,1,2+draft={other}",
                                         f"traversal@adaptive+draft={other}")]
    own, steered, adaptive = make_runners(methods, open_bench(pair, methods, kernels="default"))
    assert own.decoder is not steered.decoder and steered.decoder is adaptive.decoder
    assert own.decoder.draft.hook is None and isinstance(steered.decoder.draft.hook, SteeringLink)
    assert steered.decoder.draft.model is not pair.draft.model
    taps, hook = [], pair.target.hook
    tapped = hook.tapped
    hook.tapped = lambda states: (taps.append(states), tapped(states))[1]  # the target taps for the steered draft
    stats = steered.one([5, 9, 3], 0, SamplingConfig(1.0), 4)
    del hook.tapped
    assert stats.new_tokens == 4 and taps and torch.is_tensor(taps[0])
    assert steered.decoder.draft.hook.target is pair.target  # linked to the pair's own target
    assert own.one([5, 9, 3], 0, SamplingConfig(1.0), 4).new_tokens == 4
    assert main(["bench", "--target", str(root / "target"), "--draft", str(root / "draft"), "--tokenizer",
                 str(DEFAULT_TOKENIZER), "--prompts", str(prompts), "--field", "text", "--num-prompts", "1",
                 "--methods", f"traversal@2,1,2+draft={tmp_path / 'missing'}"]) == 2
    assert "draft folder" in capsys.readouterr().err


def test_prompts_come_from_any_source_collect_reads(tmp_path):
    """The default is the held-out split; builtin:train and files work as in `ddte collect`, with one-line errors."""
    from bench.decoding import bench_prompts

    heldout, train = bench_prompts(None, "prompt", 3), bench_prompts("builtin:train", "prompt", 3)
    assert heldout == bench_prompts("builtin:heldout", "prompt", 3) and len(train) == 3
    assert bench_prompts(None, "prompt", 2, skip=1) == heldout[1:]  # past the prompts another bench chose on
    assert not set(heldout) & set(train)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "def f(x):"}) + "\n")
    assert bench_prompts(str(path), "text", 5) == ["def f(x):"]
    with pytest.raises(ValueError, match="no prompts left after skipping 1"):
        bench_prompts(str(path), "text", 5, skip=1)
    with pytest.raises(ValueError, match="not found"):
        bench_prompts(str(tmp_path / "missing.jsonl"), "prompt", 1)


def test_a_policy_file_is_read_once_for_all_its_verifiers(pair_dirs, tmp_path, monkeypatch):
    """--policy-file names two verifiers: the file is read once, to list them and to build both policies."""
    import decode.policies.files.deployment
    from decode.policies.files.deployment import Choice, Deployment

    root, prompts = pair_dirs
    policy = Deployment([Choice("traversal", 1.0, 1.0, "static", "2,1,2"), Choice("specinfer", 1.0, 1.0, "static",
                                                                                    "1,3,0")], "traversal")
    path = policy.write(tmp_path / "policy.json")
    reads, load = [], decode.policies.files.deployment.load_deployment

    def counted(file):
        reads.append(file)
        return load(file)

    monkeypatch.setattr(decode.policies.files.deployment, "load_deployment", counted)
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(root / "target"), "--draft", str(root / "draft"), "--tokenizer",
                 str(DEFAULT_TOKENIZER), "--prompts", str(prompts), "--field", "text", "--num-prompts", "1",
                 "--max-new-tokens", "3", "--methods", "ar", "--policy-file", str(path), "--output", str(out)]) == 0
    methods = [r["method"] for r in json.loads(out.read_text())["rows"]]
    assert methods == ["ar", f"traversal@policy={path}", f"specinfer@policy={path}"]
    assert reads == [str(path)]  # once: the command lists the verifiers, and the runners are handed what it read


def test_bench_says_when_it_cuts_a_prompt_and_names_its_prompt_file(pair_dirs, tmp_path, capsys):
    root, _ = pair_dirs
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "x = 1\n" * 200}) + "\n" + json.dumps({"prompt": "def f():"}) + "\n")
    assert main(["bench", "--target", str(root / "target"), "--draft", str(root / "draft"), "--tokenizer",
                 str(DEFAULT_TOKENIZER), "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "4",
                 "--methods", "ar"]) == 0
    captured = capsys.readouterr()
    assert "warning: 1 of 2 prompts are longer than the 64-token context" in captured.err
    assert f"2 prompts from {prompts}" in captured.out and "held-out" not in captured.out


def test_bench_says_when_a_policy_file_stands_in_at_another_temperature(pair_dirs, tmp_path, capsys):
    from decode.policies.files.deployment import Choice, Deployment

    root, prompts = pair_dirs
    path = Deployment([Choice("traversal", 0.7, 1.0, "static", "2,1,2")], "traversal").write(tmp_path / "policy.json")
    assert main(["bench", "--target", str(root / "target"), "--draft", str(root / "draft"), "--tokenizer",
                 str(DEFAULT_TOKENIZER), "--prompts", str(prompts), "--field", "text", "--num-prompts", "1",
                 "--max-new-tokens", "3", "--methods", "ar", "--policy-file", str(path), "--temperature", "0.7",
                 "1"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: traversal@policy=policy.json has choices for T=0.7 top-p=1; T=1 top-p=1 uses the "
                     "nearest, T=0.7 top-p=1"]


def test_bench_says_when_a_selector_stands_in_at_another_temperature(capsys):
    """The shipped traversal selector (trained at T 0.6 and 1) on the shipped pair, benched at T 0.3 and 1: one note,
    for T 0.3 only, read from the file's metadata before the run."""
    from tests.factories import REPO

    selector = REPO / "models" / "selectors" / "traversal.onnx"
    assert main(["bench", "--num-prompts", "1", "--max-new-tokens", "3", "--methods", f"traversal@selector={selector}",
                 "--temperature", "0.3", "1"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: traversal@selector=")
    assert notes[0].endswith("was trained for T=0.6 top-p=1, T=1 top-p=1; T=0.3 top-p=1 uses the nearest, "
                             "T=0.6 top-p=1")
