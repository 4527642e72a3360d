"""The one nearest-setting rule (decode/drafting/sampling.py) that every file measured at some sampling settings uses
to serve the others: nearest temperature first, then nearest top-p."""

from __future__ import annotations

from decode.drafting.sampling import SamplingConfig, nearest_note, nearest_setting


def test_the_nearest_setting_is_the_nearest_temperature_then_top_p():
    measured = [SamplingConfig(0.6, 1.0), SamplingConfig(1.0, 0.9), SamplingConfig(1.0, 1.0)]
    assert nearest_setting(measured, 0.7) == SamplingConfig(0.6, 1.0)
    assert nearest_setting(measured, 0.9, 0.92) == SamplingConfig(1.0, 0.9)
    assert nearest_setting(measured, 2.0, 1.0) == SamplingConfig(1.0, 1.0)
    temperatures = [0.6, 1.0]  # indices read through ``setting``
    assert nearest_setting(range(2), 0.85, setting=lambda i: (temperatures[i], 1.0)) == 1
    assert nearest_note("the file has", measured, SamplingConfig(0.7)).endswith("uses the nearest, T=0.6 top-p=1")
    assert nearest_note("the file has", measured, SamplingConfig(1.0, 0.9)) is None
