"""`ddte generate` end to end on tiny saved models: output file, greedy equality, and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddte.cli import main
from tests.factories import tiny_llama


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_llama(seed=1, vocab=64, hidden=64, layers=2)
    target.save_pretrained(root / "target")
    tiny_llama(seed=2, vocab=64, hidden=32, layers=1).save_pretrained(root / "draft")
    return root, target


def test_generate_writes_jsonl_and_matches_greedy(pair_dirs, tmp_path, capsys):
    root, target = pair_dirs
    out = tmp_path / "out.jsonl"
    code = main([
        "generate", "--prompt-ids", "5,9,3", "--target", str(root / "target"), "--draft", str(root / "draft"),
        "--verifier", "specinfer", "--action", "2,1,2", "--temperature", "0", "--max-new-tokens", "10",
        "--num-samples", "2", "--output", str(out),
    ])
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["sample"] for r in records] == [0, 1]
    reference = target.generate(torch.tensor([[5, 9, 3]]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert records[0]["tokens"] == reference[0, 3:].tolist()
    assert records[0]["stats"]["target_passes"] >= 1 and "block_efficiency" in records[0]["stats"]
    captured = capsys.readouterr()
    printed = captured.err  # the statistics go to stderr, with --output or without; the samples to stdout
    assert "block efficiency" in printed and "block efficiency" not in captured.out
    assert f"wrote 2 samples to {out}" in printed and "--- sample 1" in captured.out
    passes, tokens = (sum(r["stats"][k] for r in records) for k in ("target_passes", "new_tokens"))
    assert (f"vs plain decoding: {passes} target passes instead of {tokens} (one per new token): "
            f"{tokens - passes} avoided; this run's target passes took") in printed  # no latency table: no price
    assert tokens - passes >= 0


def test_generate_sampling_is_reproducible(pair_dirs, tmp_path):
    root, _ = pair_dirs
    outs = []
    for run in range(2):
        out = tmp_path / f"run{run}.jsonl"
        main([
            "generate", "--prompt-ids", "5,9,3", "--target", str(root / "target"), "--draft", str(root / "draft"),
            "--policy", "adaptive", "--max-new-tokens", "12", "--seed", "7", "--output", str(out),
        ])
        outs.append(json.loads(out.read_text())["tokens"])
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--verifier", "bogus"], "unknown verifier"),
        (["--action", "2,x,1"], "K,L1,L2"),
        (["--action", "0,1,1"], "K >= 1"),
        (["--verifier", "block", "--action", "2,0,3"], "not lossless"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
        (["--policy", "entropy", "--entropy-threshold", "nan"], "--entropy-threshold must be a finite number"),
        (["--seed", str(2**64)], "argument --seed: an integer in [0, "),
        (["--prompt-ids", "1,,2"], "no empty items"),
        (["--threads", "1000"], "more than this machine's"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt-ids", ",".join(["5"] * 70)], "context window"),
        (["--prompt-ids", "5,1000"], "out of range"),
    ],
)
def test_bad_input_is_a_clean_error(pair_dirs, extra, message):
    root, _ = pair_dirs
    args = ["generate", "--target", str(root / "target"), "--draft", str(root / "draft"), "--max-new-tokens", "4"]
    if "--prompt-ids" not in extra:
        args += ["--prompt-ids", "5,9"]
    result = subprocess.run([sys.executable, "-m", "ddte", *args, *extra], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_missing_model_dir_and_missing_tokenizer(tmp_path, pair_dirs):
    root, _ = pair_dirs
    result = subprocess.run(
        [sys.executable, "-m", "ddte", "generate", "--prompt-ids", "1", "--target", str(tmp_path / "nope"),
         "--draft", str(root / "draft")],
        capture_output=True, text=True,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "ddte", "generate", "hello", "--target", str(root / "target"),
         "--draft", str(root / "draft")],
        capture_output=True, text=True,
    )
    assert result.returncode == 2 and "no tokenizer" in result.stderr


def test_pair_config(pair_dirs, tmp_path):
    root, _ = pair_dirs
    config = tmp_path / "pair.yaml"
    config.write_text(f"target: {root / 'target'}\ndraft: {root / 'draft'}\n")
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--prompt-ids", "4,5", "--pair", str(config), "--max-new-tokens", "3",
                 "--output", str(out)]) == 0
    assert len(json.loads(out.read_text())["tokens"]) == 3
    config.write_text("target: x\n")
    result = subprocess.run([sys.executable, "-m", "ddte", "generate", "--prompt-ids", "4", "--pair", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "needs keys target and draft" in result.stderr


def test_a_policy_file_at_another_temperature_says_so_once(pair_dirs, tmp_path, capsys):
    from decode.policies.files.deployment import Choice, Deployment

    root, _ = pair_dirs
    path = Deployment([Choice("traversal", 0.7, 1.0, "static", "2,1,2"), Choice("traversal", 1.0, 1.0, "static",
                                                                                "1,3,0")], "traversal").write(
        tmp_path / "policy.json")
    base = ["generate", "--prompt-ids", "5,9", "--target", str(root / "target"), "--draft", str(root / "draft"),
            "--policy-file", str(path), "--max-new-tokens", "3", "--num-samples", "2"]
    assert main([*base, "--temperature", "0.3"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == ["note: the policy file has choices for T=0.7 top-p=1, T=1 top-p=1; T=0.3 top-p=1 uses the "
                     "nearest, T=0.7 top-p=1"]
    assert "ms per one-token pass, latency table" in err  # the machine's table prices plain decoding's passes
    assert main([*base, "--temperature", "1"]) == 0
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("temperature", ["0", "0.3"])
def test_a_selector_at_a_temperature_it_was_not_trained_for_says_so_once(temperature, capsys):
    """The shipped traversal selector (trained at T 0.6 and 1) on the shipped pair: at T = 0 or 0.3 one note names
    the guard it uses, however many samples; at T = 1 none."""
    from tests.factories import REPO

    base = ["generate", "--prompt-ids", "5,9", "--verifier", "traversal", "--selector",
            str(REPO / "models" / "selectors" / "traversal.onnx"), "--max-new-tokens", "3", "--num-samples", "2"]
    assert main([*base, "--temperature", temperature]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: the selector was trained for T=0.6 top-p=1, T=1 top-p=1; T={temperature} top-p=1 uses "
                     "the nearest, T=0.6 top-p=1"]
    assert main([*base, "--temperature", "1"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_a_prompt_starting_with_dashes_is_text_after_a_double_dash(capsys):
    """`ddte generate -- "--x"`: what follows ``--`` is the prompt, on the shipped pair's tokenizer."""
    from ddte.cli import build_parser

    args, extra = build_parser("generate").parse_known_args(["generate", "--max-new-tokens", "2", "--", "--x"])
    assert (args.prompt, args.max_new_tokens, extra) == ("--x", 2, [])
    assert main(["generate", "--max-new-tokens", "2", "--temperature", "0", "--", "--x"]) == 0
    captured = capsys.readouterr()
    assert "--- sample 0 (2 tokens" in captured.out and "block efficiency" in captured.err
    args, extra = build_parser("generate").parse_known_args(["generate", "hello", "--", "--x"])
    assert (args.prompt, extra) == ("hello", ["--x"])  # one prompt: the second is refused as unrecognized


def test_method_is_what_the_flags_spell_in_bench_and_serve_grammar(pair_dirs, tmp_path, capsys):
    """``--method VERIFIER@SPEC`` and the policy flags are two spellings of one method, parsed by one grammar: the
    same samples; --method refuses the flags it replaces, and names itself in an error."""
    root, _ = pair_dirs
    base = ["generate", "--prompt-ids", "5,9,3", "--target", str(root / "target"), "--draft", str(root / "draft"),
            "--max-new-tokens", "6", "--seed", "3"]
    tokens = {}
    for name, flags in (("flags", ["--verifier", "specinfer", "--policy", "entropy", "--entropy-threshold", "1.5"]),
                        ("method", ["--method", "specinfer@entropy:threshold=1.5"])):
        out = tmp_path / f"{name}.jsonl"
        assert main([*base, *flags, "--output", str(out)]) == 0
        tokens[name] = json.loads(out.read_text())["tokens"]
    assert tokens["flags"] == tokens["method"]
    summary = "verifier specinfer, policy entropy stop (up to 8 tokens, halting where H > 1.5 nats)"
    assert capsys.readouterr().err.count(summary) == 2
    assert main([*base, "--method", "specinfer@2,1,2", "--action", "2,1,2"]) == 2
    assert "--method names the verifier and the policy: do not combine it with --action" in capsys.readouterr().err
    assert main([*base, "--method", "block@2,0,3"]) == 2
    err = capsys.readouterr().err
    assert "--method block@2,0,3: " in err and "not lossless" in err
