"""The `ddte` console script: subcommands registered, help texts present, bad input gives a clean exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddte.cli import SUBCOMMANDS, build_parser, main


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices  # the registered subcommands
    assert set(choices) == set(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert len(capsys.readouterr().out) > 100


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_bench_verifiers_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        ["bench-verifiers", "--vocab", "64", "--trees", "2,1,2", "1,3,0", "--samples", "2", "--repeats", "1",
         "--output", str(out)]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| traversal | 2,1,2 | 64 |" in table
    rows = json.loads(out.read_text())["rows"]
    gbv = [r for r in rows if r["verifier"] == "gbv" and r["tree"] == "2,1,2"][0]
    assert gbv["verify_us"] is None  # not lossless on a delayed tree with L1 > 0: shown as '-'
    assert all(r["verify_us"] > 0 for r in rows if r["verify_us"] is not None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench-verifiers", "--verifiers", "bogus"], "unknown verifier"),
        (["bench-verifiers", "--trees", "4,x,8"], "bad tree spec"),
        (["bench-verifiers", "--trees", "0,1,1"], "K must be >= 1"),
        (["bench-verifiers", "--samples", "0"], ">= 1"),
    ],
)
def test_bad_input_is_a_clean_error(argv, message):
    result = subprocess.run([sys.executable, "-m", "ddte", *argv], capture_output=True, text=True)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
