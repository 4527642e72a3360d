"""Every bad input is one line and a non-zero exit before any work (issue 72, round 5): nothing that a check can ask
of the flags, the pair's config or a file's path waits for the models to load or a server to start.

Each test replaces the work (the pair's loading, the bench's server, the pipeline's job) with a tripwire: a check that
comes after the work starts fails it with the tripwire's exception instead of the one line.
"""

from __future__ import annotations

import json

import pytest

from ddte.cli import main
from tests.factories import save_tiny_pair


class WorkStarted(Exception):  # noqa: N818 - the tripwire's name says what happened
    """Raised by a tripwire: the command began its work before it refused its input."""


def _trip(*_, **__):
    raise WorkStarted("the command started its work before refusing its input")


def _one_line(capsys, command: str) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"ddte {command}: error:"), err
    return err[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("before-work"), vocab=4096)
    quantized = json.loads((root / "pair.yaml").read_text()) | {"target_quant": "int8-dynamic"}
    (root / "quantized.yaml").write_text(json.dumps(quantized))
    return root


@pytest.mark.parametrize("argv", [
    ["pipeline", "--output", ""], ["pipeline", "--output", " "], ["collect", "--output", ""],
    ["acceptance", "--output", ""], ["acceptance", "--data", ""], ["expander", "--data", "", "--verifier", "gbv",
                                                                   "--output", "x.onnx"],
    ["train", "--data", " "], ["generate", "x", "--selector", ""], ["serve", "--policy-file", ""],
    ["bench", "--pair", ""], ["dense-labels", "--output", ""], ["bench-serve", "--output", ""],
])
def test_an_empty_path_is_refused_before_the_command_runs(argv, capsys, monkeypatch):
    """An empty --output (or any path option) would read as "not given", the config's own folder, or the working
    folder: refused in one line, whatever the command."""
    import ddte.pipeline

    monkeypatch.setattr(ddte.pipeline, "load_pipeline", _trip)
    monkeypatch.setattr("decode.session.PairRequest.load", _trip)
    assert main(argv) == 2
    flag = next(a for a in argv if a.startswith("--") and argv[argv.index(a) + 1].strip() == "")
    assert f"{flag} is empty" in _one_line(capsys, argv[0])


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
@pytest.mark.parametrize("extra, message", [
    (["--kernels", "onednn", "--dtype", "float16"], "the target cannot take onednn: onednn runs float32, bfloat16"),
    (["--kernels", "draft=int8-dynamic", "--dtype", "float16"], "the draft cannot take int8-dynamic"),
    (["--kernels", "target=onednn", "--pair", "{quantized}"], "this pair's target_quant runs its target on"),
    (["--kernels", "int8-weight"], "the target takes only exact paths"),
    (["--method", "traversal@expander={missing}"], "expander file '{missing}' does not exist"),
    (["--method", "traversal@selector={missing}"], "selector file '{missing}' does not exist"),
    (["--method", "traversal@selector={folder}"], "is a folder"),
])
def test_kernels_and_policy_files_are_refused_before_the_models_load(command, extra, message, tiny, tmp_path,
                                                                     capsys, monkeypatch):
    monkeypatch.setattr("decode.session.PairRequest.load", _trip)
    places = {"quantized": str(tiny / "quantized.yaml"), "missing": str(tmp_path / "nope.onnx"),
              "folder": str(tmp_path)}
    extra = [a.format(**places) for a in extra]
    if command == "bench" and "--method" in extra:
        extra[extra.index("--method")] = "--methods"
    pair = [] if "--pair" in extra else ["--pair", str(tiny / "pair.yaml")]
    argv = {"generate": ["generate", "x", "--max-new-tokens", "2"], "serve": ["serve", "--port", "0"],
            "bench": ["bench", "--num-prompts", "1"]}[command] + pair + extra
    assert main(argv) == 2
    assert message.format(**places) in _one_line(capsys, command)


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-1"], "--temperature must be in [0, 2]"),
    (["--temperature", "nan"], "--temperature must be in [0, 2]"),
    (["--temperature", "2.5"], "--temperature must be in [0, 2]"),
    (["--max-new-tokens", "100000"], "--max-new-tokens 100000 does not fit"),
    (["--max-new-tokens", "60"], "--max-new-tokens 60 does not fit"),  # the tiny pair's 64-token context
    (["--kernels", "fastest"], "unknown kernel path 'fastest'"),
    (["--kernels", "onednn", "--pair", "{quantized}"], "this pair's target_quant runs its target on"),
    (["--method", "traversal@expander={missing}"], "expander file '{missing}' does not exist"),
    (["--method", "nobody@1,3,0"], "unknown verifier 'nobody'"),
    (["--pair", "{missing}"], "does not exist"),
])
def test_bench_serve_refuses_what_its_server_would_before_starting_one(extra, message, tiny, tmp_path, capsys,
                                                                       monkeypatch):
    import bench.serve_load

    monkeypatch.setattr(bench.serve_load, "live_server", _trip)
    monkeypatch.setattr(bench.serve_load, "against_generate", _trip)
    places = {"quantized": str(tiny / "quantized.yaml"), "missing": str(tmp_path / "nope.onnx")}
    extra = [a.format(**places) for a in extra]
    pair = [] if "--pair" in extra else ["--pair", str(tiny / "pair.yaml")]
    assert main(["bench-serve", *pair, *extra]) == 2
    assert message.format(**places) in _one_line(capsys, "bench-serve")


def test_a_request_the_running_server_refuses_ends_the_bench_in_one_line(monkeypatch):
    """What no check can see before the server runs (here: a refusal) stops the level with one line naming the
    request, never a client thread's traceback."""
    import bench.serve_load as load

    def refused(*_, **__):
        raise ValueError("Error code: 400 - {'error': {'message': 'no'}}\nmore")

    monkeypatch.setattr(load, "stream_one", refused)
    with pytest.raises(RuntimeError, match=r"failed request \d+: ValueError: Error code: 400") as caught:
        load.run_level("http://127.0.0.1:9", load.LoadPlan(requests=4), 1, 2)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("extra, message", [
    (["--pair", "{quantized}", "--kernels", "target=onednn"], "this pair's target_quant runs its target on"),
    (["--pair", "{pair}", "--kernels", "draft=onednn-wide,target=int8-dynamic"], "the target takes only exact"),
])
def test_pair_card_refuses_its_kernels_before_measuring(extra, message, tiny, capsys, monkeypatch):
    import ddte.pair_card.card

    monkeypatch.setattr(ddte.pair_card.card, "measure", _trip)
    extra = [a.format(quantized=tiny / "quantized.yaml", pair=tiny / "pair.yaml") for a in extra]
    assert main(["pair-card", *extra]) == 2
    assert message in _one_line(capsys, "pair-card")


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_an_unusable_latency_cache_is_named_before_the_models_load(command, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("decode.session.PairRequest.load", _trip)
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("DDTE_LATENCY_CACHE", str(tmp_path / "a-file"))
    argv = {"generate": ["generate", "x", "--max-new-tokens", "2"], "serve": ["serve", "--port", "0"],
            "bench": ["bench", "--num-prompts", "1"]}[command]
    assert main([*argv, "--pair", str(tiny / "pair.yaml")]) == 2
    assert "$DDTE_LATENCY_CACHE" in _one_line(capsys, command)
