"""An expander file without its fit sets says that nothing was refitted on this machine (issue 72, round 5): with a
machine's latency table a file with fit sets refits each rule there (tests/selector/expander/test_expander.py); one
without them runs its rules as fitted elsewhere, and its line must say so rather than pass for a choice made here.
"""

from __future__ import annotations

from decode.drafting.sampling import SamplingConfig
from decode.policies.expander import ExpanderSource
from decode.policies.files.expander_file import ExpanderMetadata
from tests.decode.policies.test_machine_fit import FLAT, STEEP
from tests.factories import REPO

SHIPPED = REPO / "models" / "expanders" / "smollm2-traversal.onnx"


def _without_fit_sets(path, folder):
    """A copy of the expander file ``path`` whose metadata lost its fit sets (as an older or stripped file)."""
    import onnx

    model = onnx.load(str(path))
    key = ExpanderMetadata.PREFIX + "fit_sets"
    kept = [p for p in model.metadata_props if p.key != key]
    assert len(kept) == len(model.metadata_props) - 1, "the shipped file carries fit sets"
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    out = folder / path.name
    onnx.save(model, str(out))
    return out


def test_a_file_without_fit_sets_says_it_was_not_refitted_here(tmp_path):
    from decode.policies.files.expander_file import read_expander_metadata

    stripped = _without_fit_sets(SHIPPED, tmp_path)
    meta = read_expander_metadata(SHIPPED)
    sampling = SamplingConfig(meta.rules[0].temperature)
    # the control: the whole file refits on a machine's table and says so
    whole = ExpanderSource(SHIPPED, verifier=meta.verifier, draft_hidden=meta.draft_hidden, machine=FLAT)
    assert whole.deployed(sampling).refit is not None and "not refitted" not in whole.describe(sampling)
    for table in (FLAT, STEEP):
        bare = ExpanderSource(stripped, verifier=meta.verifier, draft_hidden=meta.draft_hidden, machine=table)
        deployed = bare.deployed(sampling)
        assert deployed.refit is None and deployed.unrefitted
        line = bare.describe(sampling)
        assert "not refitted on this machine: the file carries no fit sets" in line, line
        assert "offline" not in line and "refitted on this machine's latency table" not in line
    # without a table nothing could have been refitted: nothing to say
    assert "not refitted" not in ExpanderSource(stripped, verifier=meta.verifier,
                                                draft_hidden=meta.draft_hidden).describe(sampling)
