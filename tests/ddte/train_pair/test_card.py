"""pair-card runs end to end on a tiny pair and follows the pair it is given (its passes are the decoder's own,
tested in tests/decode)."""

from __future__ import annotations

import json

import pytest

from ddte.commands import pair_card
from ddte.pair_card import shipped as card
from tests.factories import run_subcommand


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
    acc = result["acceptance_T1"]
    assert acc["contexts"] == 12 and 0.0 <= acc["percentiles"]["p5"] <= acc["mean"] <= 1.0
    assert result["latency"]["target"]["tree_ms"] > 0 and result["latency"]["ratio_one_token"] > 0
    assert result["heldout"]["target"]["perplexity"] > 1
    assert 0.0 <= result["acceptance_T0.6"]["mean"] <= 1.0
    for t in ("1", "0.6"):
        calibration = result[f"calibration_T{t}"]
        assert calibration["nodes"] == 3 * 4 * 8 and 0.0 <= calibration["mean_accept"] <= 1.0
        assert -1.0 <= calibration["corr_top_accept"] <= 1.0 and 0.0 <= calibration["auc_top_accept"] <= 1.0
    loop = result["loop_latency"]
    assert loop["draft_wrapper"] == "FastCachedLM" and loop["ratio_one_token"] > 0
    text = card.markdown(result)
    assert "acceptance" in text and "corr(top probability" in text and "in the decoding loop" in text


def test_the_card_follows_the_pair(tiny_pair, tmp_path, capsys):
    """A pair laid out as `ddte train-pair` writes one (recipe.json beside target/, draft/, tokenizer/; the shipped
    pair by default) gets the full card, any other pair the loop card."""
    from decode.pair import read_pair_config
    from tests.factories import REPO, save_tiny_pair

    assert card.train_pair_folder(read_pair_config("shipped")) == REPO / "models"
    assert card.train_pair_folder(read_pair_config(_pair_yaml(tiny_pair, tmp_path / "p.yaml"))) == tiny_pair
    assert card.train_pair_folder(read_pair_config(save_tiny_pair(tmp_path / "other") / "pair.yaml")) is None
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_subcommand(pair_card, ["--help"])
    assert exit_info.value.code == 0 and "--pair PAIR" in capsys.readouterr().out


def test_the_card_of_a_pair_yaml_reports_loop_ratios_and_acceptance_per_temperature(tmp_path):
    from tests.factories import save_tiny_pair

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
    from ddte.pair_card.any_pair import pair_markdown

    assert "draft, a step's first pass" in pair_markdown(result) and "heldout (2 prompts" in pair_markdown(result)
