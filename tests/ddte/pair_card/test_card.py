"""pair-card runs end to end on a tiny pair and follows the pair it is given (its passes are the decoder's own,
tested in tests/decode)."""

from __future__ import annotations

import json

import pytest

from ddte.commands import pair_card
from ddte.pair_card.folder import train_pair_folder
from ddte.pair_card.markdown import markdown
from tests.factories import REPO, run_subcommand


def _pair_yaml(folder, path):
    path.write_text(json.dumps({k: str(folder / k) for k in ("target", "draft", "tokenizer")}))  # JSON is YAML
    return path


def test_card_runs_end_to_end(tiny_pair, tmp_path):
    """--pair names a `ddte train-pair` folder's models, as in every command: the full card."""
    out = tmp_path / "card.json"
    argv = ["--pair", str(_pair_yaml(tiny_pair, tmp_path / "pair.yaml")), "--output", str(out),
            "--num-prompts", "3", "--max-new-tokens", "4",
            "--heldout-blocks", "4", "--timed-calls", "2", "--sample-tokens", "5", "--cache-len", "16",
            "--tree-nodes", "8"]
    assert run_subcommand(pair_card, argv) == 0
    result = json.loads(out.read_text())
    acc = result["acceptance_heldout_T1"]
    assert acc["contexts"] == 12 and 0.0 <= acc["percentiles"]["p5"] <= acc["mean"] <= 1.0
    assert result["latency"]["target"]["tree_ms"] > 0 and result["latency"]["ratio_one_token"] > 0
    assert result["heldout"]["target"]["perplexity"] > 1
    assert 0.0 <= result["acceptance_heldout_T0.6"]["mean"] <= 1.0
    for t in ("1", "0.6"):
        calibration = result[f"calibration_T{t}"]
        assert calibration["nodes"] == 3 * 4 * 8 and 0.0 <= calibration["mean_accept"] <= 1.0
        assert -1.0 <= calibration["corr_top_accept"] <= 1.0 and 0.0 <= calibration["auc_top_accept"] <= 1.0
    loop = result["loop_latency"]
    assert loop["draft_wrapper"] == "FastCachedLM" and loop["ratio_one_token"] > 0
    assert result["cores"] and result["threads"] == 1 and result["torch"] and result["models_dir"] == str(tiny_pair)
    text = markdown(result)
    assert "acceptance" in text and "corr(top probability" in text and "in the decoding loop" in text
    assert "held-out perplexity" in text and "| heldout | 12 |" in text


def test_the_card_follows_the_pair(tiny_pair, tmp_path, capsys):
    """A pair laid out as `ddte train-pair` writes one (recipe.json beside target/, draft/, tokenizer/; the shipped
    pair by default) gets the full card, any other pair the loop card."""
    from decode.pair_spec import read_pair_config
    from tests.factories import save_tiny_pair

    assert train_pair_folder(read_pair_config("shipped")) == REPO / "models"
    assert train_pair_folder(read_pair_config(_pair_yaml(tiny_pair, tmp_path / "p.yaml"))) == tiny_pair
    assert train_pair_folder(read_pair_config(save_tiny_pair(tmp_path / "other") / "pair.yaml")) is None
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_subcommand(pair_card, ["--help"])
    assert exit_info.value.code == 0 and "--pair PAIR" in capsys.readouterr().out


def test_the_card_of_a_pair_yaml_reports_loop_ratios_and_acceptance_per_temperature(tmp_path, capsys, monkeypatch):
    """Any pair's card; its T = 0.8 sample shows a progress bar on stderr once it runs long (here: at once)."""
    from ddte.pair_card import card
    from tests.factories import save_tiny_pair

    monkeypatch.setattr(card, "PROGRESS_DELAY_S", 0.0)

    root = save_tiny_pair(tmp_path / "pair", vocab=4096, context=128)
    out = tmp_path / "card.json"
    argv = ["--pair", str(root / "pair.yaml"), "--output", str(out), "--num-prompts", "2", "--max-new-tokens", "3",
            "--timed-calls", "1", "--sample-tokens", "3", "--cache-len", "16", "--tree-nodes", "4"]
    assert run_subcommand(pair_card, argv) == 0
    result = json.loads(out.read_text())
    loop = result["loop_latency"]
    assert loop["target_one_token_ms"] > 0 and loop["draft_first_pass_ms"] >= loop["draft_one_token_ms"] > 0
    for t in ("0.6", "1"):
        assert result[f"acceptance_heldout_T{t}"]["contexts"] == 2 * 3
    assert "heldout" not in result and "calibration_T1" not in result  # a folder's section only
    assert "sample" in capsys.readouterr().err
    text = markdown(result)
    assert "draft, a step's first pass" in text and "heldout (2 prompts" in text and "held-out loss" not in text


def test_the_json_is_written_whole_as_an_ordinary_shared_file(tmp_path):
    """write_json goes through ddte_core.paths.staged_file: 0644 over an old file, no temporary left beside it."""
    from ddte.pair_card.card import write_json

    out = tmp_path / "card.json"
    out.write_text("old")
    out.chmod(0o600)
    write_json({"a": "é"}, out)
    assert json.loads(out.read_text()) == {"a": "é"} and oct(out.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == ["card.json"]


@pytest.mark.parametrize(("given", "folder", "reaches"), [
    (["--kernels", "draft=int8-dynamic"], False, "draft=int8-dynamic"),
    ([], False, None),  # the pair's own kernels
    (["--kernels", "auto"], True, "auto"),
    ([], True, "default"),  # a train-pair folder's card: the default path, unless --kernels says otherwise
])
def test_kernels_reaches_use_kernels(tiny_pair, tmp_path, monkeypatch, given, folder, reaches):
    """--kernels parses as in every command and is what the card asks pair.use_kernels for; measuring stops there."""
    from decode.pair import LoadedPair
    from tests.factories import save_tiny_pair

    asked = []

    def use_kernels(self, request=None, cache=None, announce=None, progress=False, release=False):
        asked.append(request)
        raise ValueError("stop here")

    monkeypatch.setattr(LoadedPair, "use_kernels", use_kernels)
    pair = _pair_yaml(tiny_pair, tmp_path / "p.yaml") if folder else save_tiny_pair(tmp_path / "o") / "pair.yaml"
    with pytest.raises(Exception, match="stop here"):
        run_subcommand(pair_card, ["--pair", str(pair), "--cache-len", "16", "--sample-tokens", "8", *given])
    assert asked == [reaches]


@pytest.mark.parametrize("value", ["fastest", "target=int8-dynamic", "gpu=default"])
def test_a_bad_kernels_is_one_line_and_exit_2_before_any_model_loads(value, capsys, monkeypatch):
    from ddte.cli import main
    from decode import pair_spec

    monkeypatch.setattr(pair_spec, "read_pair_config", lambda *_: pytest.fail("read the pair before --kernels"))
    assert main(["pair-card", "--kernels", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddte pair-card: error: ") and value.split("=")[-1] in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("name", ["card.json", "smollm2-card.json"])
def test_the_shipped_cards_read_as_before(name):
    """models/ holds cards written before the card was one: their tables still come out, each figure where it was."""
    result = json.loads((REPO / "models" / name).read_text())
    text = markdown(result)
    acceptance = result.get("acceptance_T1") or result["acceptance_like_T1"]
    assert f"{acceptance['mean']:.3f} ± {acceptance['std']:.3f}" in text
    assert f"| target, 1 token | {result['loop_latency']['target_one_token_ms']:.2f} | 1 |" in text
    assert ("held-out perplexity" in text) == ("heldout" in result)
