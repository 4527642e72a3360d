"""The `ddte` console script: subcommands registered and lazily imported, one flag convention, help texts
present, bad input gives a clean exit 2."""

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


def _visible_options(name: str) -> dict[str, object]:
    """Option string -> argparse action of one subcommand (every one: no command has hidden aliases)."""
    parser = build_parser(name)
    sub = parser._subparsers._group_actions[0].choices[name]
    return {o: a for a in sub._actions for o in a.option_strings}


# The agreed spellings (ddte/commands/common.py); the retired ones are gone, not hidden.
RETIRED = {"--out", "--out-dir", "--json", "--data-dir", "--new-tokens", "--set", "--count", "--models"}


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_subcommand_uses_the_agreed_flag_names(name):
    options = _visible_options(name)
    assert not RETIRED & set(options), f"{name} shows a retired spelling"
    writes = {"generate", "bench", "bench-verifiers", "build-prompts", "train-pair", "pair-card", "collect",
              "relabel", "analyze", "export", "pipeline"}
    if name in writes:
        assert "--output" in options, f"{name} must name what it writes --output"
    if name in {"relabel", "analyze", "train", "export"}:
        assert "--data" in options, f"{name} must name the data set it reads --data"
    if "--threads" in options and name != "collect":  # collect's threads come from its config unless given
        assert options["--threads"].default == 1
    if "--prompts" in options:
        assert options["--prompts"].type is None  # a file everywhere; a count is --num-prompts
    if "--dtype" in options:  # the models' dtype everywhere (bench-verifiers' distributions: --prob-dtype)
        assert "bfloat16" in options["--dtype"].choices
    if "--trees" in options:  # a count (analyze); tree shapes are --shapes
        assert options["--trees"].type is int
    if "--repeats" in options:  # runs per prompt (bench); timed calls per figure are --timed-calls
        assert "per prompt" in options["--repeats"].help


@pytest.mark.parametrize(("argv", "overrides", "option"), [
    (["collect", "prompts.limit=2", "--output", "X", "trees_per_root=1"], ["prompts.limit=2", "trees_per_root=1"],
     ("output", "X")),
    (["train", "trainer.max_epochs=2", "--data", "X", "model.lr=0.01"], ["trainer.max_epochs=2", "model.lr=0.01"],
     ("data", "X")),
])
def test_overrides_go_anywhere_on_the_command_line(argv, overrides, option):
    args = build_parser(argv[0]).parse_args(argv)
    assert args.overrides == overrides and getattr(args, option[0]) == option[1]


def test_no_command_shows_short_flags_and_build_prompts_usage_requires_its_output(capsys):
    for name in SUBCOMMANDS:
        shown = [o for o in _visible_options(name) if not o.startswith("--") and o != "-h"]
        assert not shown, f"{name} shows short flags {shown}"
    with pytest.raises(SystemExit):
        main(["build-prompts", "--help"])
    assert "--output OUTPUT" in capsys.readouterr().out.split("\n\n")[0]  # required: in the usage line


def test_collect_takes_the_flag_names_of_the_other_commands():
    from ddte.commands.collect import overrides_from_args

    args = build_parser("collect").parse_args(["collect", "--num-prompts", "5", "--max-new-tokens", "32",
                                               "stride=4"])
    assert overrides_from_args(args) == ["stride=4", "prompts.limit=5", "new_tokens=32"]
    from data_gen.config import load_collect_config
    from ddte.commands.collect import DEFAULT_CONFIG

    assert load_collect_config(DEFAULT_CONFIG).threads == 1  # the README's --threads default, from the config


def test_every_command_runs_its_models_on_the_same_default_device():
    """--device is cpu unless asked: in generate and bench (the flag), in collect (its config, the flag unset) and so
    in the pipeline's collect stage."""
    from data_gen.config import CollectConfig, load_collect_config
    from ddte.commands.collect import DEFAULT_CONFIG, overrides_from_args

    with_device = [name for name in SUBCOMMANDS if "--device" in _visible_options(name)]
    assert {"generate", "bench", "collect"} <= set(with_device)
    for name in with_device:
        option = _visible_options(name)["--device"]
        assert option.default == ("cpu" if name != "collect" else None), name
        assert "auto: cuda when available" in option.help, name
    args = build_parser("collect").parse_args(["collect"])
    assert load_collect_config(DEFAULT_CONFIG, overrides_from_args(args)).device == "cpu"
    assert CollectConfig().device == "cpu"


def test_top_level_help_imports_no_command(tmp_path):
    """`ddte --help` builds the command map from names alone; `ddte generate --help` imports generate's shell
    only, and no torch."""
    code = (
        "import sys; from ddte import cli; cli.build_parser(None); "
        "heavy = [m for m in ('torch', 'transformers', 'lightning') if m in sys.modules]; "
        "shells = [m for m in sys.modules if m.startswith('ddte.commands.') and m != 'ddte.commands.common']; "
        "cli.build_parser('generate'); "
        "after = [m for m in sys.modules if m.startswith('ddte.commands.') and m != 'ddte.commands.common']; "
        "print(heavy, shells, after, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[] [] ['ddte.commands.generate'] False"


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_bench_verifiers_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        ["bench-verifiers", "--vocab", "64", "--shapes", "2,1,2", "1,3,0", "--samples", "2", "--timed-calls", "1",
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
        (["bench-verifiers", "--shapes", "4,x,8"], "bad tree spec"),
        (["bench-verifiers", "--shapes", "0,1,1"], "K must be >= 1"),
        (["bench-verifiers", "--samples", "0"], ">= 1"),
    ],
)
def test_bad_input_is_a_clean_error(argv, message):
    result = subprocess.run([sys.executable, "-m", "ddte", *argv], capture_output=True, text=True)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
