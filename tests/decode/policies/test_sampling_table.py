"""The one sampling-keyed table (decode/policies/files/sampling_table.py) that every file measured at some sampling
settings uses to serve the others: nearest temperature first, then nearest top-p; the note; the static fallback
re-picked on the running machine."""

from __future__ import annotations

import pytest

from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.files.sampling_table import SamplingTable, static_on_machine


def test_the_nearest_setting_is_the_nearest_temperature_then_top_p():
    measured = [SamplingConfig(0.6, 1.0), SamplingConfig(1.0, 0.9), SamplingConfig(1.0, 1.0)]
    table = SamplingTable([(m, m) for m in measured], "the file", "has")
    assert table.nearest(SamplingConfig(0.7)) == SamplingConfig(0.6, 1.0)
    assert table.nearest(SamplingConfig(0.9, 0.92)) == SamplingConfig(1.0, 0.9)
    assert table.nearest(SamplingConfig(2.0, 1.0)) == SamplingConfig(1.0, 1.0)
    assert SamplingTable.of_temperatures([0.6, 1.0]).nearest(SamplingConfig(0.85)) == 1
    assert table.note(SamplingConfig(0.7)).endswith("uses the nearest, T=0.6 top-p=1")
    assert table.note(SamplingConfig(0.7)).startswith("note: the file has T=0.6 top-p=1")
    assert table.note(SamplingConfig(0.7), noun="x@selector=a.onnx").startswith("note: x@selector=a.onnx has")
    assert table.note(SamplingConfig(1.0, 0.9)) is None
    assert table.measured() == measured
    assert table.with_entries(["a", "b", "c"]).nearest(SamplingConfig(0.7)) == "a"
    with pytest.raises(ValueError, match="no sampling setting"):
        SamplingTable([])


def test_the_static_fallback_is_the_fitting_machines_without_a_table_or_a_profile():
    assert static_on_machine("1,2,0", None, object()) == Action(1, 2, 0)
    assert static_on_machine("1,2,0", {"actions": ["1,1,0"], "be": [2.0], "lengths": [8]}, None) == Action(1, 2, 0)
    table = SamplingTable([(SamplingConfig(1.0), ("2,1,2", None))], static=lambda entry: entry)
    assert table.statics(None) == [Action(2, 1, 2)]
