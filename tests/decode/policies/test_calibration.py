"""decode.policies.calibration: what a step's outcome counts, the bound around θ, the exploration schedule, and the
marginal decision on the realized rates; the calibrated kind loads the shipped expander with one calibration per
configuration, shared by the generations it starts."""

from __future__ import annotations

import numpy as np
import pytest

from decode.policies.calibration import AcceptanceCalibration

CHAIN = np.array([10.0, 15.3, 20.6, 25.9])  # a draft pass costs half a one-token target pass: break-even near 0.53


def calibration(**kwargs) -> AcceptanceCalibration:
    return AcceptanceCalibration.around(np.linspace(0.0, 1.0, 101), theta=0.5, **kwargs)


def test_bins_are_the_fit_sets_deciles_and_the_band_reaches_two_bins_either_side_of_theta():
    c = calibration()
    assert len(c.edges) == 9 and c.bin(0.05) == 0 and c.bin(0.95) == 9
    assert c.band == (c.bin(0.5) - 2, c.bin(0.5) + 2) and c.theta == 0.5
    assert AcceptanceCalibration.around(np.full(10, 0.3), 0.5) is None  # one value: nothing to bin
    assert AcceptanceCalibration.around(np.array([np.nan]), 0.5) is None


def test_a_step_counts_the_trunk_tokens_it_tested():
    c = calibration()
    c.record({0: 0.55, 1: 0.45, 2: 0.35}, trunk=3, accepted=1)  # token 0 accepted, token 1 rejected, 2 untested
    assert c.steps == 1
    assert (c.tested[c.bin(0.55)], c.accepted[c.bin(0.55)]) == (1, 1)
    assert (c.tested[c.bin(0.45)], c.accepted[c.bin(0.45)]) == (1, 0)
    assert c.tested[c.bin(0.35)] == 0
    c.record({0: 0.55, 1: 0.45}, trunk=1, accepted=4)  # the halting node drew no trunk token: not counted
    assert c.tested[c.bin(0.45)] == 1 and c.tested[c.bin(0.55)] == 2


def test_the_counts_decide_only_in_the_band_and_with_evidence():
    c = calibration(min_count=3)
    far = 0.95  # outside the band: the fitted rule decides whatever the counts say
    for _ in range(10):
        c.record({0: far}, trunk=1, accepted=0)
    assert not c.decides(far) and c.halts(0, {0: far}, CHAIN) is None
    c.record({0: 0.6}, trunk=1, accepted=1)
    assert not c.decides(0.6) and c.halts(0, {0: 0.6}, CHAIN) is None  # one token: not evidence enough
    for accepted in (1, 1, 1):
        c.record({0: 0.6}, trunk=1, accepted=accepted)
    assert c.decides(0.6) and c.halts(0, {0: 0.6}, CHAIN) is False  # accepted every time: growing pays
    for _ in range(40):
        c.record({0: 0.6}, trunk=1, accepted=0)
    assert c.halts(0, {0: 0.6}, CHAIN) is True  # mostly rejected since: halt, though the fitted rule grows there


def test_a_band_bin_short_of_evidence_below_theta_is_explored_once_every_few_steps():
    c = calibration(min_count=5, explore_every=3)
    low = 0.45  # below θ, in the band, untested: the fitted rule halts there
    assert c.halts(0, {0: low}, CHAIN) is False  # step 0: explore
    assert c.halts(1, {0: low, 1: low}, CHAIN) is None  # once per step
    for step in range(1, 7):
        c.record({}, trunk=0, accepted=0)
        assert (c.halts(0, {0: low}, CHAIN) is False) == (step % 3 == 0)
    assert c.halts(0, {0: 0.7}, CHAIN) is None  # above θ the fitted rule grows anyway: nothing to explore


@pytest.mark.parametrize("verifier", ["traversal"])
def test_the_calibrated_kind_shares_one_calibration_per_configuration(verifier):
    from types import SimpleNamespace

    from decode.drafting.sampling import SamplingConfig
    from decode.policies.expander import ExpanderSource
    from decode.policies.files.expander_file import read_expander_metadata

    path = "models/expanders/qwen-coder-traversal.onnx"
    hidden = int(read_expander_metadata(path).draft_hidden)
    pair = SimpleNamespace(draft=SimpleNamespace(config=SimpleNamespace(hidden_size=hidden)), fingerprint=lambda: None)
    source = ExpanderSource.for_pair(path, verifier, pair, calibrate=True)
    fixed = ExpanderSource.for_pair(path, verifier, pair)
    sampling = SamplingConfig(0.6)
    first, second = source.start(sampling), source.start(sampling)
    assert first.calibration is not None and first.calibration is second.calibration
    assert fixed.start(sampling).calibration is None
    assert "calibrated online" in source.describe(sampling) and source.name == "calibrated"
