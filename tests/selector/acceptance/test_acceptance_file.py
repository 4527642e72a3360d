"""The acceptance model's file contract (selector/acceptance/acceptance_file.py): one typed owner of the
``ddte.acceptance.*`` metadata, which files written before it still read as."""

from __future__ import annotations

import json

import pytest

from selector.acceptance.acceptance_file import AcceptanceMetadata


def test_the_metadata_round_trips_and_an_earlier_files_props_read_as_it():
    meta = AcceptanceMetadata(16, [0.7, 1.0], "f" * 64, "d" * 64, ["5", "6"], "mixed:train")
    assert AcceptanceMetadata.from_props(meta.to_props(), "a.onnx") == meta
    earlier = {"ddte.acceptance." + key: json.dumps(value) for key, value in {  # as acceptance_train wrote them
        "hidden_size": 16, "temperatures": [0.7, 1.0], "inputs": ["draft_hidden", "entropy", "top1", "depth"],
        "pair_fingerprint": "f" * 64, "data_fingerprint": "d" * 64, "fit_prompts": [5, 6],
        "prompts": "mixed:train"}.items()}
    assert AcceptanceMetadata.from_props(earlier, "a.onnx") == meta
    assert meta.column(0.75) == 0 and meta.column(0.9) == 1


def test_a_model_of_another_pair_draft_or_of_the_collections_prompts_is_refused():
    meta = AcceptanceMetadata(16, [1.0], "f" * 64, fit_prompts=["5"])
    meta.check_for("a.onnx", "f" * 64, 16, {"7"})
    with pytest.raises(ValueError, match="another pair"):
        meta.check_for("a.onnx", "e" * 64, 16, set())
    with pytest.raises(ValueError, match="hidden state of 16, not 8"):
        meta.check_for("a.onnx", "f" * 64, 8, set())
    with pytest.raises(ValueError, match="trained on 1 of the collection's prompts"):
        meta.check_for("a.onnx", "f" * 64, 16, {"5"})
    with pytest.raises(ValueError, match="not an acceptance model"):
        AcceptanceMetadata.from_props({}, "a.onnx")
