"""The per-node signal bench: every timed variant computes the signal the policy would, and the offline laws
recomputed from stored hidden states are the collector's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.node_signals import VARIANTS, signals_from_hidden, time_after_forward
from ddte.cli import main
from decode.drafting.sampling import SamplingConfig, distributions, entropy


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_every_variant_makes_the_loops_law_and_its_own_signal(temperature):
    sampling = SamplingConfig(temperature=temperature)
    logits = torch.randn(1, 512, generator=torch.Generator().manual_seed(3)) * 4  # (1, Vs)
    law = distributions(logits, sampling)[0]
    expected = {"law": 0.0, "top": float(law.max()), "entropy": float(entropy(law)),
                "entropy via log-softmax": float(entropy(law)), "collision Σq²": float((law * law).sum())}
    assert set(VARIANTS) == set(expected)
    for name, variant in VARIANTS.items():
        q, value = variant(logits, sampling)
        torch.testing.assert_close(q, law, rtol=1e-5, atol=1e-7)
        assert value == pytest.approx(expected[name], rel=1e-4, abs=1e-7), name


def test_the_timing_runs_each_variant_after_its_own_forward_and_refuses_greedy(tiny_pair):
    from decode.pair import load_pair_config

    draft = load_pair_config(tiny_pair / "pair.yaml").draft
    times, values = time_after_forward(draft, [5, 9, 11], SamplingConfig(temperature=0.7), rounds=30,
                                       variants=["law", "top", "entropy"])
    assert {name: len(ts) for name, ts in times.items()} == {"law": 30, "top": 30, "entropy": 30}
    assert all(t > 0 for ts in times.values() for t in ts)
    assert max(values["entropy"]) > 0 and 0 < min(values["top"]) <= max(values["top"]) <= 1
    assert draft.length <= 3 + 24  # the cache is cropped back as it goes
    with pytest.raises(ValueError, match="temperature > 0"):
        time_after_forward(draft, [5, 9], SamplingConfig(temperature=0.0), rounds=1)
    with pytest.raises(ValueError, match="unknown signal variants"):
        time_after_forward(draft, [5, 9], SamplingConfig(temperature=1.0), rounds=1, variants=["varentropy"])


def test_laws_recomputed_from_stored_hidden_states_are_the_collectors(tiny_pair, tiny_collected):
    """Through the draft's head the stored final hidden states give back the stored entropy and top probability;
    a hidden state off by a scale (taken before the final norm, say) would not."""
    from decode.pair import load_pair_config
    from selector.expander.expansion import evaluate_expansion, load_episodes, signal_ratios

    draft = load_pair_config(tiny_pair / "pair.yaml").draft
    head = draft.model.get_output_embeddings().weight
    metadata, episodes, _ = load_episodes(tiny_collected, "traversal")
    width = int(metadata["hidden_sizes"]["draft_hidden_root"])
    for c, data in episodes.items():
        sampling = SamplingConfig(**metadata["sampling"][c])
        signals = signals_from_hidden(data.features[..., :width], head, sampling, chunk=7)
        np.testing.assert_allclose(signals["entropy"], data.entropy, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(signals["top"], data.top, rtol=1e-4, atol=1e-5)
        unnormed = signals_from_hidden(data.features[..., :width] * 3.0, head, sampling)
        assert np.abs(unnormed["entropy"] - data.entropy).max() > 1e-2
        # the shared fit scores a signal as the expansion analysis does
        ratios = signal_ratios(data, {"top": data.top, "entropy": -data.entropy}, metadata["l_max"],
                               metadata["k_max"])
        reference = evaluate_expansion(data, metadata["l_max"], metadata["k_max"])
        assert ratios["top"] == pytest.approx(reference["top"]) and ratios["entropy"] == pytest.approx(
            reference["entropy"])


def test_the_command_prints_both_tables_and_refuses_another_pairs_data(tiny_pair, tiny_collected, tmp_path,
                                                                       capsys):
    from tests.factories import save_tiny_pair

    pair = str(tiny_pair / "pair.yaml")
    assert main(["bench-signals", "--pair", pair, "--rounds", "2", "--temperature", "0.7",
                 "--data", str(tiny_collected), "--verifiers", "traversal"]) == 0
    out = capsys.readouterr().out
    assert "| entropy via log-softmax |" in out and "| 0.7 | traversal |" in out and "| 1 | traversal |" in out
    other = save_tiny_pair(tmp_path / "other", seeds=(1, 5))
    capsys.readouterr()  # the saving's progress lines
    assert main(["bench-signals", "--pair", str(other / "pair.yaml"), "--rounds", "1",
                 "--data", str(tiny_collected)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "collected with another pair" in err[0]
    assert main(["bench-signals", "--pair", pair, "--temperature", "0"]) == 2
    assert "--temperature must be > 0" in capsys.readouterr().err
