"""`ddte bench` end to end on tiny models with the shipped tokenizer: table, JSON rows, plot, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    # the one policy row with a static row of its verifier is compared with it; specinfer has none
    [comparison] = payload["comparisons"]
    assert comparison["policy"] == "traversal@entropy" and comparison["best_static"] == "traversal@2,1,2"
    want = rows["traversal@entropy"]["tokens_per_s"] / rows["traversal@2,1,2"]["tokens_per_s"]
    assert comparison["ratio_vs_best_static"] == pytest.approx(want)
    assert rows["ar"]["speedup"] == pytest.approx(1.0)
    assert all(r["tokens_per_s"] > 0 and r["new_tokens"] > 0 for r in rows.values())
    assert rows["traversal@2,1,2"]["block_efficiency"] >= 1.0
    assert payload["environment"]["torch"] and (tmp_path / "bench.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "| traversal@2,1,2 |" in printed and "best static tree in this run" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--methods", "bogus@1,2,0"], "unknown verifier"), (["--methods", "block@2,0,2"], "not lossless"),
     (["--methods", "traversal"], "bad method"), (["--prompts", "/nonexistent.jsonl"], "nonexistent")],
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


def test_methods_run_interleaved_in_a_rotating_order(monkeypatch):
    """Prompt by prompt, every method in turn, starting one method later each round: drift reaches all alike."""
    from types import SimpleNamespace

    from ddte.bench import methods as bench
    from decode.stats import GenerationStats

    calls = []

    def fake_runner(method, pair, settings, sampling):
        def one(ids, seed):
            calls.append((method, ids[0], seed))
            return GenerationStats(new_tokens=1, wall_seconds=0.1)

        return bench._Runner(method, one)

    monkeypatch.setattr(bench, "make_runner", fake_runner)
    settings = bench.BenchSettings(max_new_tokens=4, repeats=2, seed=5)
    results = bench.bench_methods(["a", "b", "c"], None, [[10], [11]], settings, SimpleNamespace(temperature=1.0))
    warmup, timed = calls[:3], calls[3:]
    assert warmup == [("a", 10, 5), ("b", 10, 5), ("c", 10, 5)]
    assert [c[0] for c in timed] == list("abc" "bca" "cab" "abc")
    assert [c[1:] for c in timed[::3]] == [(10, 5), (10, 1005), (11, 6), (11, 1006)]  # prompt, then repeat
    assert [r.stats.new_tokens for r in results] == [4, 4, 4]  # the warm-up is not counted


def test_prompts_come_from_any_source_collect_reads(tmp_path):
    """The default is the held-out split; builtin:train and files work as in `ddte collect`, with one-line errors."""
    from ddte.bench.methods import bench_prompts

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
