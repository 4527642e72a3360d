"""What a new user trips over: each one a clear line, a non-zero exit and nothing half-written (issue audit)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddte.cli import main
from tests.factories import REPO, TINY_TRAIN_CONFIG, save_tiny_pair


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("refusals"), vocab=64, target_hidden=32, draft_hidden=16)


def _one_line(capsys, command: str) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning:")]
    assert len(err) == 1 and err[0].startswith(f"ddte {command}: error:"), err
    return err[0]


def _refused(capsys, argv: list[str], message: str, **places) -> None:
    """``argv``, its ``{place}`` names filled in, exits 2 with one ``ddte <cmd>: error:`` line holding ``message``."""
    argv = [a.format(**places) for a in argv]
    assert main(argv) == 2
    assert message in _one_line(capsys, argv[0])


def test_the_fingerprint_covers_the_weights(tmp_path):
    """A draft with the same config but other weights is another pair."""
    from decode.pair import pair_fingerprint

    a = save_tiny_pair(tmp_path / "a", vocab=64, seeds=(1, 2))
    b = save_tiny_pair(tmp_path / "b", vocab=64, seeds=(1, 3))
    assert (a / "draft" / "config.json").read_text() == (b / "draft" / "config.json").read_text()
    assert pair_fingerprint(a / "target", a / "draft") != pair_fingerprint(b / "target", b / "draft")
    assert pair_fingerprint(a / "target", a / "draft") == pair_fingerprint(a / "target", a / "draft")


def test_a_selector_trained_for_another_pair_is_refused(tiny, tmp_path, capsys):
    from selector.root.export import export_selector
    from selector.root.synthetic import write_synthetic_dataset
    from selector.root.train import train_selector

    data = write_synthetic_dataset(tmp_path / "data", n_prompts=8, roots_per_prompt=4, hidden=(32, 16))
    trained = train_selector(TINY_TRAIN_CONFIG, [f"data.data_dir={data}", f"run.output_dir={tmp_path / 'runs'}",
                                                 f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                                 "trainer.max_epochs=1"], verbose=False)
    onnx = export_selector(trained.checkpoint_path, tmp_path / "s.onnx", log_mlflow=False).path
    capsys.readouterr()  # the training's own log lines
    code = main(["generate", "--prompt-ids", "5,9", "--target", str(tiny / "target"), "--draft", str(tiny / "draft"),
                 "--verifier", "specinfer", "--selector", str(onnx), "--max-new-tokens", "3"])
    assert code == 2 and "trained on another pair" in _one_line(capsys, "generate")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "adaptive", "--action", "4,4,4"], "--policy adaptive does not use it"),
        (["--policy", "entropy", "--max-draft", "0"], "--max-draft must be >= 1"),
        (["--entropy-threshold", "0", "--policy", "entropy"], "--entropy-threshold must be a finite number > 0"),
        (["--selector", "x.onnx", "--action", "1,2,0"], "--selector chooses the tree"),
        (["--verifier", "bogus"], "--verifier: unknown verifier 'bogus'"),
        (["--action", "99,99,99"], "--action: (99,99,99) is beyond the action grid"),
        (["--output", "{file}/out.jsonl"], "is a file, not a folder"),
        (["--target", "{file}"], "is a file, not a model directory"),
    ],
)
def test_generate_refuses_options_it_would_ignore_or_misread(tiny, tmp_path, capsys, argv, message):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = [a.replace("{file}", str(blocker)) for a in argv]
    code = main(["generate", "--prompt-ids", "5,9", "--target", str(tiny / "target"), "--draft", str(tiny / "draft"),
                 "--max-new-tokens", "3", *argv])
    assert code == 2 and message in _one_line(capsys, "generate")


def test_bench_creates_a_new_output_folder_and_refuses_one_under_a_file(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    base = ["bench", "--target", str(tiny / "target"), "--draft", str(tiny / "draft"), "--num-prompts", "1",
            "--max-new-tokens", "3", "--methods", "ar"]
    assert main([*base, "--output", str(blocker / "r.json")]) == 2
    assert "is a file" in _one_line(capsys, "bench")
    assert main([*base[:-1], "traversal@99,99,99"]) == 2
    assert "(99,99,99) is beyond the action grid" in _one_line(capsys, "bench")
    assert main([*base, "--skip-prompts", "-1"]) == 2
    assert "--skip-prompts must be >= 0" in _one_line(capsys, "bench")
    assert main([*base, "--prompts", str(prompts), "--skip-prompts", "1"]) == 2
    assert "no prompts left after skipping 1" in _one_line(capsys, "bench")


def test_bench_output_parent_is_created_before_any_work(tmp_path):
    """`--output out/newdir/sub/r.json`: the folders are made (and checked) before the run, the JSON lands."""
    pair = save_tiny_pair(tmp_path / "pair", vocab=4096, target_hidden=32, draft_hidden=16)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    out = tmp_path / "newdir" / "sub" / "r.json"
    assert main(["bench", "--pair", str(pair / "pair.yaml"), "--prompts", str(prompts), "--num-prompts", "1",
                 "--max-new-tokens", "3", "--methods", "ar", "traversal@1,2,0", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] and out.with_suffix(".png").is_file()


@pytest.mark.parametrize(("second", "message"), [(b'{"prompt": ""}', "p.jsonl: row 2 has an empty 'prompt'"),
                                                 (b'{"prompt": "caf\xe9"}', "p.jsonl:2: not UTF-8 text (byte 0xe9)")])
def test_bench_refuses_an_empty_or_undecodable_prompt(tmp_path, capsys, second, message):
    pair = save_tiny_pair(tmp_path / "pair", vocab=4096, target_hidden=32, draft_hidden=16)
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(json.dumps({"prompt": "def f(x):"}).encode() + b"\n" + second + b"\n")
    capsys.readouterr()  # the pair's own save
    assert main(["bench", "--pair", str(pair / "pair.yaml"), "--prompts", str(prompts), "--num-prompts", "2",
                 "--max-new-tokens", "3", "--methods", "ar"]) == 2
    assert message in _one_line(capsys, "bench")


def test_collect_refuses_a_folder_of_foreign_files(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["collect", "--no-progress", f"output={out}", "prompts.limit=1"]) == 2
    assert "not empty and holds no data set" in _one_line(capsys, "collect")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_second_collect_on_one_output_is_refused(tiny_pair, tmp_path, capsys):
    """Another collect of the same shard holds the output's lock: this one says so and writes no shard."""
    import fcntl

    from tests.factories import collect_overrides

    out = tmp_path / "data"
    out.mkdir()
    with open(out / ".lock-shard-0-of-1", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the first run holds while it collects
        assert main(["collect", "--no-progress", *collect_overrides(tiny_pair, out)]) == 2
    assert "another ddte collect is writing shard 0/1" in _one_line(capsys, "collect")
    assert not list(out.glob("shard-*"))
    assert main(["collect", "--no-progress", *collect_overrides(tiny_pair, out)]) == 0  # released: a stale file
    assert list(out.glob("shard-*.parquet"))


def test_collect_refuses_new_tokens_beyond_the_context(tiny_pair, tmp_path, capsys):
    from tests.factories import collect_overrides

    out = tmp_path / "data"
    assert main(["collect", "--no-progress", *collect_overrides(tiny_pair, out, new_tokens=10**9)]) == 2
    assert "new_tokens (1000000000) cannot be reached in the models' 64-token context" in _one_line(capsys, "collect")
    assert not out.exists()


@pytest.mark.parametrize(("held", "message"), [("policy.json", "a finished pipeline run (policy.json)"),
                                               ("data", "an unfinished pipeline run"), ("notes.txt", "other files")])
def test_pipeline_refuses_a_used_output_without_resume(tmp_path, capsys, held, message):
    """Like collect: a folder that holds a run is continued or redone only with --resume."""
    out = tmp_path / "run"
    out.mkdir()
    (out / held).mkdir() if held == "data" else (out / held).write_text("{}")
    assert main(["pipeline", "--output", str(out)]) == 2
    line = _one_line(capsys, "pipeline")
    assert f"already holds {message}: pass --resume" in line
    assert sorted(p.name for p in out.iterdir()) == [held]


def test_bench_verifiers_refuses_a_degenerate_tree(capsys):
    assert main(["bench-verifiers", "--shapes", "wor:0,2", "--vocab", "8"]) == 2
    assert "B >= 1" in _one_line(capsys, "bench-verifiers")


def test_a_stopped_train_pair_leaves_no_staging_folder(tmp_path):
    """SIGTERM while training: the command unwinds like Ctrl-C and removes its hidden staging folder."""
    out = tmp_path / "pair"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ddte", "train-pair", "--config",
                             str(REPO / "configs" / "train-pair" / "tiny.yaml"), "--output", str(out),
                             "target.train.steps=100000", "target.train.max_minutes=null"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.exists() and any(p.name.startswith(".train-pair-")
                                                               for p in out.iterdir())):
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # The command catches the interrupt, says so and returns 130. Under pytest, about one run in three then ends
    # killed by SIGINT (-2) after that message: CPython's exit path for an interrupt it counts as unhandled, after
    # main() has returned (cause not found). Either way the clean-up has run; a kill by SIGTERM itself (-15, the
    # handler never ran) or a normal exit still fails here.
    assert proc.returncode in (130, -signal.SIGINT), proc.returncode
    assert "interrupted" in err
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_fetch_without_network_is_one_line_and_leaves_the_cache_clean(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert main(["fetch", "smollm2", "--cache", str(tmp_path)]) == 2
    assert "connect to the network" in _one_line(capsys, "fetch")
    assert not (tmp_path / "smollm2").exists()  # not even the folder the fetch made


def test_a_pair_whose_target_is_not_fetched_names_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDTE_CACHE", str(tmp_path / "empty-cache"))
    assert main(["generate", "--pair", "smollm2", "hi", "--max-new-tokens", "2"]) == 2
    assert "run `ddte fetch smollm2`" in _one_line(capsys, "generate")


def test_an_unknown_pair_name_lists_the_known_ones(capsys):
    assert main(["generate", "--pair", "nosuchpair", "hi", "--max-new-tokens", "2"]) == 2
    line = _one_line(capsys, "generate")
    assert "shipped" in line and "smollm2" in line


def test_pair_card_takes_its_pair_as_every_command_does(capsys):
    assert main(["pair-card", "--pair", "nosuchpair"]) == 2
    line = _one_line(capsys, "pair-card")
    assert "pair config 'nosuchpair' does not exist" in line and "shipped" in line


def test_a_prompt_that_is_not_utf8_or_is_empty_is_refused(tiny, capsys):
    base = ["generate", "--target", str(tiny / "target"), "--draft", str(tiny / "draft"), "--max-new-tokens", "2"]
    assert main([*base, "a\udcff\udcfe"]) == 2  # how Python's argv holds the bytes \xff\xfe
    assert "not UTF-8" in _one_line(capsys, "generate")
    assert main([*base, ""]) == 2
    assert "the prompt is empty" in _one_line(capsys, "generate")


@pytest.mark.parametrize(("content", "message"), [(b"some notes here\n", "is not a YAML config"),
                                                  (b"\xff\xfe\x00", "is not UTF-8 text")])
def test_a_config_that_is_not_a_yaml_mapping_is_refused(tmp_path, capsys, content, message):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    assert main(["collect", "--config", str(notes), f"output={tmp_path / 'out'}"]) == 2
    line = _one_line(capsys, "collect")
    assert message in line and str(notes) in line
    assert not (tmp_path / "out").exists()


def test_analyze_refuses_a_truncated_selector(tiny_collected, tmp_path, capsys):
    onnx = tmp_path / "truncated.onnx"
    onnx.write_bytes(b"\x08\x07\x12\x04garbage")
    assert main(["analyze", "--data", str(tiny_collected), "--output", str(tmp_path / "a"), "--expansion",
                 "--folds", "2", "--selector", f"specinfer={onnx}"]) == 2
    assert "not a readable ONNX selector" in _one_line(capsys, "analyze")


@pytest.mark.parametrize("verifier, message", [("traversal", "trained for verifier 'specinfer', not 'traversal'"),
                                                ("specinfer", "trained on another pair")])
def test_analyze_checks_a_selector_as_the_decoder_does(tiny_collected, tmp_path, capsys, verifier, message):
    shipped = Path(__file__).resolve().parents[2] / "models" / "selectors" / "specinfer.onnx"  # the shipped pair's
    assert main(["analyze", "--data", str(tiny_collected), "--output", str(tmp_path / "a"), "--expansion",
                 "--folds", "2", "--selector", f"{verifier}={shipped}"]) == 2
    assert message in _one_line(capsys, "analyze")
    assert not (tmp_path / "a").exists()


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT handled by default and not blocked, as a shell starts a command. An ignored
    or blocked SIGINT survives exec, and in CI's full run the pytest process had one by this test (the run then
    finished all its chunks and exited 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def test_ctrl_c_during_a_two_worker_collect_is_one_line(tmp_path):
    """Ctrl-C reaches the whole process group: the workers print nothing (no KeyboardInterrupt traceback, no leaked
    semaphore warning); the parent says "interrupted" and keeps its finished shards for --resume."""
    from tests.factories import collect_overrides, save_collect_pair

    pair = save_collect_pair(tmp_path / "pair")
    # 400 one-prompt chunks: when the first shard lands, hundreds are still to come (with 5 and then 40 prompts the
    # tiny pair's whole run sometimes ended before the signal arrived, and the run exited 0)
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(400)))
    out = tmp_path / "data"
    argv = [sys.executable, "-m", "ddte", "collect", "--no-progress",
            *collect_overrides(pair, out, workers=2, new_tokens=50, prompts_per_shard=1,
                               **{"prompts.limit": 400, "prompts.source": str(prompts)})]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO,
                            preexec_fn=_as_from_a_terminal)
    deadline = time.time() + 120
    while time.time() < deadline and not list(out.glob("shard-*.parquet")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # the signal was not honoured: stop the run rather than leave it behind
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)  # see the train-pair test above
    assert "interrupted" in err and "Traceback" not in err and "leaked" not in err, err
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    assert 1 <= len(list(out.glob("shard-*.parquet"))) < 400  # stopped part-way, its finished shards kept


@pytest.mark.parametrize("layout, args, message", [
    ("new", ["--only", "draft"], "needs a previous full run"),
    ("foreign", [], "not empty and holds no earlier run"),
    ("earlier run", [], "pass --overwrite"),
])
def test_train_pair_writes_only_a_new_folder_or_its_own_run_with_overwrite(tmp_path, capsys, layout, args, message):
    """The one overwrite rule for folder-writing commands (ddte_core.paths.check_output_folder), on train-pair: a
    refusal in one line, before any training, and the folder left as it was (a new one not created)."""
    out = tmp_path / "pair"
    if layout == "foreign":  # a data set's folder
        out.mkdir()
        (out / "dataset.json").write_text("{}")
    elif layout == "earlier run":
        out.mkdir()
        (out / "recipe.json").write_text("{}")
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    code = main(["train-pair", "--config", str(REPO / "configs" / "train-pair" / "tiny.yaml"), "--output", str(out),
                 *args])
    assert code == 2 and message in _one_line(capsys, "train-pair")
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before


def test_the_overwrite_rule_lets_a_new_or_empty_folder_or_an_own_run_with_overwrite_through(tmp_path):
    from ddte_core.paths import check_output_folder

    assert check_output_folder(tmp_path / "new") == tmp_path / "new" and not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    check_output_folder(tmp_path / "empty")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.json").write_text("{}")
    check_output_folder(tmp_path / "run", own="recipe.json", overwrite=True)
    with pytest.raises(ValueError, match="is a file"):
        check_output_folder(tmp_path / "run" / "recipe.json" / "x")


@pytest.mark.parametrize("argv, message", [
    (["bench-verifiers", "--vocab", "64", "--shapes", "wor:100,1"], "at most --vocab 64 distinct children"),
    (["pipeline", "--resume", "output={out}"], "holds no pipeline run to continue"),
    (["analyze", "--data", "{data}", "--output", "{file}"], "is a file, not a folder"),
    (["analyze", "--data", "{data}", "--expansion", "--folds", "1000"], "at most that many folds"),
])
def test_late_checks_now_come_first(argv, message, tiny_collected, tmp_path, capsys):
    """Refused in one line before any work, nothing written: a tree wider than the vocabulary, --resume of nothing,
    an --output that is a file, more folds than prompts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = tmp_path / "never"
    before = sorted(p.name for p in tiny_collected.iterdir())
    _refused(capsys, argv, message, out=out, data=tiny_collected, file=blocker)
    assert not out.exists() and blocker.read_text() == "x"
    assert sorted(p.name for p in tiny_collected.iterdir()) == before


def test_pair_card_refuses_a_cache_longer_than_the_context(capsys):
    """The shipped pair's 512 positions: --cache-len 100000 is refused in one line instead of running for minutes."""
    assert main(["pair-card", "--cache-len", "100000", "--num-prompts", "1", "--timed-calls", "1"]) == 2
    assert "does not fit the pair's 512-token context" in _one_line(capsys, "pair-card")


def test_pair_card_refuses_more_threads_than_cores_before_loading(tmp_path, capsys, monkeypatch):
    """#54: --threads beyond the machine's cores is one line, before the pair loads."""
    import decode.pair

    monkeypatch.setattr(decode.pair, "load_pair_spec", lambda *a, **k: pytest.fail("the pair was loaded"))
    out = tmp_path / "card.json"
    threads = (os.cpu_count() or 1) + 1
    assert main(["pair-card", "--threads", str(threads), "--output", str(out)]) == 2
    assert f"--threads {threads} is more than this machine's {threads - 1} cores" in _one_line(capsys, "pair-card")
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--sample-tokens", "--max-new-tokens"])
def test_pair_card_refuses_sampling_past_the_context_before_measuring(flag, tmp_path, capsys, monkeypatch):
    """#54: 600 sampled tokens ran past the shipped pair's 512 positions, 100,000 ran for minutes: one line before
    any pass is timed or sampled."""
    from ddte.pair_card import card, folder

    for module, name in ((card, "loop_latency"), (folder, "measure_folder")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the card measured"))
    out = tmp_path / "card.json"
    assert main(["pair-card", flag, "600", "--output", str(out)]) == 2
    assert f"{flag} 600 runs past the pair's 512-token context (at most 511)" in _one_line(capsys, "pair-card")
    assert not out.exists()


@pytest.mark.parametrize("command", [
    ["analyze", "--data", "{data}"],
    ["train", "data.data_dir={data}", "run.output_dir={tmp}/runs", "run.tracking_uri=sqlite:///{tmp}/mlflow.db"],
])
def test_a_corrupt_shard_is_named(command, tiny_collected, tmp_path, capsys):
    """A shard that is not parquet: one line naming that file, whichever command reads the data set."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_collected, data)
    shard = sorted(data.glob("shard-*.parquet"))[-1]
    shard.write_bytes(b"not parquet")
    argv = [a.format(data=data, tmp=tmp_path) for a in command]
    assert main(argv) == 2
    line = _one_line(capsys, argv[0])
    assert shard.name in line and "not a readable parquet shard" in line


@pytest.mark.parametrize("argv, message", [
    (["train", "data.data_dir={data}", "run.output_dir={out}", "run.tracking_uri=garbage"], "tracking URI 'garbage'"),
    (["train", "data.data_dir={data}", "run.output_dir={out}", "run.tracking_uri=sqlite:////proc/m.db"],
     "its folder is not writable"),
    (["expander", "--data", "{data}", "--verifier", "specinfer", "--output", "{out}/e.onnx", "--tracking-uri",
      "sqlite:////proc/m.db"],
     "its folder is not writable"),
    (["bench-verifiers", "--vocab", "64", "--shapes", "2,1,1", "--output", "/proc/x.json"],
     "its folder is not writable"),
    (["build-prompts", "--output", "/proc/x.jsonl", "--num-prompts", "2"], "its folder is not writable"),
])
def test_an_unwritable_place_is_refused_before_any_work(argv, message, tiny_collected, tmp_path, capsys):
    """MLflow stores and output files where nothing can be written (/proc: even root cannot create a file there):
    one line before any work, nothing written."""
    out = tmp_path / "never"
    _refused(capsys, argv, message, out=out, data=tiny_collected)
    assert not out.exists()


@pytest.mark.parametrize("broken", ["weights", "config"])
def test_a_model_folder_with_a_corrupt_file_is_one_line(tiny, tmp_path, capsys, broken):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny / "target", target)
    if broken == "weights":
        next(target.glob("*.safetensors")).write_bytes(b"\xff" * 64)
    else:
        (target / "config.json").write_text("{not json")
    code = main(["generate", "--prompt-ids", "5,9", "--target", str(target), "--draft", str(tiny / "draft"),
                 "--max-new-tokens", "3"])
    assert code == 2 and "could not be loaded" in _one_line(capsys, "generate")


@pytest.mark.parametrize("argv, message", [
    (["expander", "--data", "{data}", "--verifier", "specinfer", "--output", "{out}/e.onnx", "--folds", "1000",
      "--no-mlflow"], "1000 folds: the data set holds"),
    (["collect", "--config", "{repo}/configs/collect/default.yaml", "--output", "{out}", "--threads", "1000"],
     "threads must be at most this machine's"),
    (["collect", "--config", "{repo}/configs/collect/default.yaml", "--output", "{out}", "--threads", "-1"],
     "threads must be null (torch's choice) or >= 1"),
])
def test_counts_beyond_what_the_data_or_machine_holds_are_refused(argv, message, tiny_collected, tmp_path, capsys):
    out = tmp_path / "never"
    _refused(capsys, argv, message, out=out, data=tiny_collected, repo=REPO)
    assert not out.exists()


@pytest.mark.parametrize("dropped", ["train", "bench"])
def test_a_pipeline_config_missing_a_stage_is_refused(tmp_path, capsys, dropped):
    """Without its train: or bench: section a pipeline would run on defaults it never named."""
    import yaml

    config = yaml.safe_load((REPO / "configs" / "pipeline" / "default.yaml").read_text())
    del config[dropped]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "never"
    assert main(["pipeline", "--config", str(path), f"output={out}"]) == 2
    assert f"has no '{dropped}:' section" in _one_line(capsys, "pipeline")
    assert not out.exists()


def test_bench_field_without_a_prompt_file_is_refused(capsys):
    """--field shapes only a --prompts file or hf: set; with the pair's own prompts it would be ignored."""
    assert main(["bench", "--field", "nonexistent", "--num-prompts", "1", "--methods", "ar"]) == 2
    assert "--field names the text field of a --prompts file" in _one_line(capsys, "bench")


@pytest.mark.parametrize("argv, message", [
    (["analyze", "--data", "{data}", "--selector", "specinfer=x.onnx"], "give --expansion as well"),
    (["analyze", "--data", "{data}", "--output", "{out}", "--expansion", "--selector", "specinfer={file}"],
     "not a readable ONNX selector"),
    (["collect", "--config", "{repo}/configs/collect/default.yaml", "--output", "{out}", "--resume"],
     "holds no collection to continue"),
    (["export", "--checkpoint", "{file}", "--output", "{out}/s.txt"], "an ONNX file, named *.onnx"),
    (["generate", "--prompt-ids", "5,9", "--latency", "fitted"], "--latency is the step-time model of"),
    (["pair-card", "--heldout-blocks", "-1"], "--heldout-blocks must be at least 1"),
    (["bench-signals", "--verifiers", "traversal"], "give --data as well"),
    (["build-prompts", "--output", ""], "--output is empty"),
    (["train", "data.data_dir={data}", "run.output_dir={file}/runs"], "is a file, not a folder"),
    (["train", "data.data_dir={data}", "run.output_dir={out}", "data.val_fraction=1.5"],
     "data.val_fraction (1.5) and data.test_fraction"),
])
def test_options_that_would_be_ignored_or_fail_late_are_refused_first(argv, message, tiny_collected, tmp_path,
                                                                      capsys, monkeypatch):
    """Round 4 of the sweep: one line, exit 2, no output and no MLflow store in the working folder."""
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = tmp_path / "never"
    _refused(capsys, argv, message, out=out, data=tiny_collected, file=blocker, repo=REPO)
    assert not out.exists() and not (tmp_path / "mlflow.db").exists() and blocker.read_text() == "x"


@pytest.mark.parametrize("argv, message", [
    (["build-prompts", "--output", "/dev/null", "--num-prompts", "2"], "is not a regular file"),
    (["build-prompts", "--output", "{loop}", "--num-prompts", "2"], "a symbolic link that leads nowhere"),
    (["bench-verifiers", "--vocab", "99999999999", "--shapes", "1,2,0"], "--vocab must be at most"),
    (["bench", "--repeats", "99999999999999", "--methods", "ar"], "--repeats must be at most 1000"),
    (["fetch", "smollm2", "--cache", ""], "--cache is empty"),
    (["collect", "--config", "{repo}/configs/collect/default.yaml", "--output", "{out}", "output={out}2"],
     "--output and output= are the same setting"),
    (["train-pair", "--config", "{empty}", "--output", "{out}"], "has no 'target:' section"),
])
def test_outputs_that_are_no_files_and_sizes_beyond_memory_are_refused(argv, message, tmp_path, capsys):
    """Sweep round 5: a device or a link loop as an output (a staged write would replace /dev/null itself, as
    root), sizes that would exhaust memory, an empty cache path, one setting given twice, an empty recipe."""
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    out = tmp_path / "never"
    _refused(capsys, argv, message, out=out, loop=loop, repo=REPO, empty=empty)
    assert not out.exists() and not Path("/dev/null").is_file() and loop.is_symlink()


def test_an_output_link_is_written_through(tmp_path):
    target = tmp_path / "real.jsonl"
    target.write_text("old")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert main(["build-prompts", "--output", str(link), "--num-prompts", "2"]) == 0
    assert link.is_symlink() and target.read_text().count("\n") == 2



# ------------------------------------------------------------- relabel and analyze: every place checked before work


def _refused_before_work(capsys, monkeypatch, argv: list[str], message: str) -> None:
    """``argv`` exits 2 with one line holding ``message`` and no temporary name, before relabel's measurement or
    analyze's analysis (both made to fail loudly), with nothing printed on stdout."""
    def work(*args, **kwargs):
        raise AssertionError("the work ran before the refusal")

    monkeypatch.setattr("data_gen.relabel.relabel_latency", work)
    monkeypatch.setattr("data_gen.analyze.analyze", work)
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.strip().splitlines() if not line.startswith("warning:")]
    assert captured.out == ""
    assert len(err) == 1 and err[0].startswith(f"ddte {argv[0]}: error:") and message in err[0], err
    assert ".tmp" not in err[0]


@pytest.mark.parametrize("argv, message", [
    (["relabel", "--data", "{data}", "--output", "/proc/ddte-x", "latency.file=null"],
     "--output /proc/ddte-x: its folder is not writable"),
    (["relabel", "--data", "{data}", "--output", "{out}", "--save-latency", "{tmp}", "latency.file=null"],
     "--save-latency {tmp} is a folder; give a file name"),
    (["relabel", "--data", "{data}", "--output", "{out}", "--save-latency", "/proc/x.json", "latency.file=null"],
     "--save-latency /proc/x.json: its folder is not writable"),
    (["analyze", "--data", "{data}", "--output", "/proc/ddte-x"], "--output /proc/ddte-x: nothing can be written"),
    (["analyze", "--data", "{file}"], "--data: {file} is a file, not a data set folder"),
])
def test_relabel_and_analyze_check_their_places_before_any_work(argv, message, tiny_collected, tmp_path, capsys,
                                                                 monkeypatch):
    """#54: an output in /proc, a --save-latency folder or unwritable place, a --data file: one line naming the
    user's path, before the measurement or the analysis, nothing written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    places = {"data": tiny_collected, "out": tmp_path / "never", "tmp": tmp_path, "file": blocker}
    before = sorted(p.name for p in tiny_collected.iterdir())
    _refused_before_work(capsys, monkeypatch, [a.format(**places) for a in argv], message.format(**places))
    assert not places["out"].exists() and blocker.read_text() == "x"
    assert sorted(p.name for p in tiny_collected.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("damage, message", [
    (lambda shard: shard.write_bytes(b"not parquet"), "not a readable parquet shard"),
    (lambda shard: shard.write_bytes(shard.read_bytes()[:-100]), "not a readable parquet shard"),
])
def test_relabel_names_a_corrupt_shard_before_measuring(damage, message, tiny_collected, tmp_path, capsys,
                                                        monkeypatch):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_collected, data)
    shard = sorted(data.glob("shard-*.parquet"))[-1]
    damage(shard)
    out = tmp_path / "out"
    _refused_before_work(capsys, monkeypatch, ["relabel", "--data", str(data), "--output", str(out),
                                               "latency.file=null"], message)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def _selector_on_the_data_sets_pair(tiny_collected, tmp_path) -> Path:
    """The shipped pair's specinfer selector, its metadata saying it was made on the data set's pair: its hidden
    sizes stay the shipped pair's."""
    import onnx

    collected = json.loads((tiny_collected / "dataset.json").read_text())
    model = onnx.load(str(REPO / "models" / "selectors" / "specinfer.onnx"))
    props = {p.key: p for p in model.metadata_props}
    props["ddte.pair_fingerprint"].value = collected["pair"]["fingerprint"]
    path = tmp_path / "specinfer.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("given, message", [
    ("specinfer", "trained on hidden sizes"),
    ("traversal", "trained for verifier 'specinfer', not 'traversal'"),
    ("nosuch", "this data set has labels for"),
])
def test_analyze_checks_a_selector_against_the_data_set_before_the_analysis(given, message, tiny_collected, tmp_path,
                                                                            capsys, monkeypatch):
    """#54: a selector of other hidden sizes, or for another verifier, is refused as generate refuses it, against
    the data set's pair fingerprint and hidden sizes, before any analysis."""
    selector = _selector_on_the_data_sets_pair(tiny_collected, tmp_path)
    out = tmp_path / "a"
    _refused_before_work(capsys, monkeypatch, ["analyze", "--data", str(tiny_collected), "--output", str(out),
                                               "--expansion", "--folds", "2", "--selector", f"{given}={selector}"],
                         message)
    assert not out.exists()


BAD_POLICY_CHOICE = {"verifier": "traversal", "temperature": 1.0, "top_p": 1.0, "policy": "static", "action": "1,2,0"}


@pytest.mark.parametrize(("command", "argv", "message"), [
    ("generate", ["--entropy-threshold", "1.5"], "--entropy-threshold belongs to the entropy policy"),
    ("generate", ["--max-draft", "4"], "--max-draft belongs to the adaptive and entropy policies"),
    ("generate", ["--policy", "adaptive", "--entropy-threshold", "1.5"], "--entropy-threshold belongs to"),
    ("generate", ["--chat", "on"], "--chat on renders a text prompt through the chat template"),
    ("generate", ["--action", "-1,2,2"], "--action: an action needs K >= 1"),
    ("generate", ["--action=-1,2,2"], "--action: an action needs K >= 1"),
    ("generate", ["--pair", "shipped"], "--pair names the target and the draft: do not combine it with --target"),
    ("bench", ["--pair", "shipped"], "--pair names the target and the draft: do not combine it with --target"),
    ("bench", ["--temperature", "0.6", "0.6"], "--temperature 0.6 is given twice"),
    ("bench", ["--plot", "{out}/x.json"], "--plot {out}/x.json: name the figure *.png, *.svg or *.pdf"),
    ("generate", ["--policy-file", "{policy}", "temperature=NaN"], "temperature must be a finite number >= 0"),
    ("generate", ["--policy-file", "{policy}", "temperature=\"0.6\""], "temperature must be a finite number"),
    ("generate", ["--policy-file", "{policy}", "temperature=null"], "temperature must be a finite number"),
    ("bench", ["--policy-file", "{policy}", "temperature=[1]"], "temperature must be a finite number >= 0"),
    ("bench", ["--methods", "traversal@policy={policy}", "action=\"9,9,9\""], "action: (9,9,9) is beyond the"),
    ("serve", ["--policy-file", "{policy}", "action=\"9,9,9\""], "action: (9,9,9) is beyond the action grid"),
])
def test_flags_and_policy_files_that_would_be_dropped_or_fail_late_are_one_line(tiny, tmp_path, capsys, command,
                                                                                argv, message):
    """Issue #54: a flag its policy would not read, a second spelling of one setting, a plot format that is not
    written, a value starting with '-', and a policy.json field the matching flag would refuse (the field to change
    given as ``FIELD=JSON``): exit 2, one line naming it, nothing written, before any model loads."""
    from decode.policies.files.deployment import FORMAT

    out = tmp_path / "never"
    changes = [a for a in argv if "=" in a and not a.startswith("-") and "@" not in a]
    policy = tmp_path / "policy.json"
    choice = BAD_POLICY_CHOICE | {k: json.loads(v) for k, v in (c.split("=", 1) for c in changes)}
    policy.write_text(json.dumps({"format": FORMAT, "verifier": "traversal", "choices": [choice]}))
    argv = [a.format(out=out, policy=policy) for a in argv if a not in changes]
    models = ["--target", str(tiny / "target"), "--draft", str(tiny / "draft")]
    base = {"generate": ["--prompt-ids", "5,9", "--max-new-tokens", "3", "--output", str(out / "o.jsonl")],
            "bench": ["--num-prompts", "1", "--max-new-tokens", "3", "--methods", "ar", "--output",
                      str(out / "b.json")],
            "serve": ["--port", "0"]}[command]
    _refused(capsys, [command, *models, *base, *argv], message.format(out=out))
    assert not out.exists()
