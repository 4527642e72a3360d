"""ONNX export: one file, named inputs with a dynamic batch, parity with torch, metadata that round-trips."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from mlflow.tracking import MlflowClient

from decode.policies.files.selector_file import INPUT_NAMES, SelectorMetadata
from selector.root.export import export_selector, load_selector, random_inputs

KEYS = {
    "ddte.feature_schema", "ddte.metadata_version", "ddte.actions", "ddte.scalar_names", "ddte.hidden_sizes",
    "ddte.verifier", "ddte.objective", "ddte.decision", "ddte.pair_fingerprint", "ddte.run_id",
    "ddte.normalisation", "ddte.data_fingerprint", "ddte.fallbacks",
}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "selector.onnx"
    return export_selector(trained.checkpoint_path, out)


def test_one_file_with_named_dynamic_inputs(exported):
    folder = exported.path.parent
    assert sorted(p.name for p in folder.iterdir()) == ["selector.onnx"]  # no .data, no temporary left
    model = onnx.load(str(exported.path))
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims == {"target_hidden_prev": ["batch", 16], "draft_hidden_prev": ["batch", 8],
                    "draft_hidden_root": ["batch", 8], "scalars": ["batch", 11]}
    out = model.graph.output[0]
    assert out.name == "scores"
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", 18]


def test_parity_on_random_and_real_rows(exported, trained):
    assert exported.max_abs_diff <= 1e-5
    assert exported.parity_rows == {"random": 64, "real": 64}
    module = load_selector(trained.checkpoint_path)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    for batch in (1, 5):  # the batch axis is dynamic
        x = random_inputs(module, batch, seed=batch)
        got = session.run(["scores"], x)[0]
        with torch.no_grad():
            want = module.deployed()(*(torch.from_numpy(x[n]) for n in INPUT_NAMES)).numpy()
            logits = module.net(*(torch.from_numpy(x[n]) for n in INPUT_NAMES)).numpy()
        assert got.shape == (batch, 18)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)  # policy: the file outputs π
        assert (got.argmax(axis=1) == logits.argmax(axis=1)).all()  # same decision as the logits


def test_metadata_round_trips(exported, trained):
    from_onnx = {p.key: p.value for p in onnx.load(str(exported.path)).metadata_props}
    from_ort = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"]) \
        .get_modelmeta().custom_metadata_map
    assert KEYS <= set(from_onnx) and from_onnx == dict(from_ort) == exported.metadata.to_props()
    assert SelectorMetadata.from_props(from_onnx) == exported.metadata  # the reader rebuilds what the writer wrote
    assert (from_onnx["ddte.feature_schema"], from_onnx["ddte.metadata_version"]) == ("1", "2")
    assert json.loads(from_onnx["ddte.actions"])[:3] == ["1,0,0", "1,0,1", "1,0,2"]
    assert len(json.loads(from_onnx["ddte.scalar_names"])) == 11
    assert json.loads(from_onnx["ddte.hidden_sizes"])["target_hidden_prev"] == 16
    assert from_onnx["ddte.verifier"] == "specinfer"
    assert (from_onnx["ddte.objective"], from_onnx["ddte.decision"]) == ("policy", "argmax")
    assert from_onnx["ddte.pair_fingerprint"] == "synthetic-pair"
    assert from_onnx["ddte.run_id"] == trained.run_id
    norm = json.loads(from_onnx["ddte.normalisation"])
    assert norm["log1p"] == ["kl_p_q_prev", "kl_q_p_prev"] and len(norm["mean"]) == len(norm["std"]) == 11
    assert from_onnx["ddte.data_fingerprint"] == trained.info.data.data_fingerprint
    assert (from_onnx["ddte.output"], from_onnx["ddte.invalid_score"]) == ("probability", "0.0")
    fallbacks = json.loads(from_onnx["ddte.fallbacks"])
    assert [(f["temperature"], f["top_p"]) for f in fallbacks] == [(0.6, 1.0), (1.0, 0.9)]  # the data's configs
    assert [f["action"] for f in fallbacks] == list(trained.info.data.static_actions.values())
    assert all(f["margin"] is None or f["margin"] >= 0 for f in fallbacks)
    fitted = json.loads(from_onnx["ddte.fit_prompts"])  # train + validation prompts: offline scores leave them out
    counts = trained.info.data.split_prompts
    assert len(fitted) == len(set(fitted)) == counts["train"] + counts["val"]


def test_a_file_without_fit_prompts_reads_as_fitted_on_nothing(exported):
    props = exported.metadata.to_props()
    del props["ddte.fit_prompts"]
    assert SelectorMetadata.from_props(props).fit_prompts == []


def test_logged_to_the_training_run_as_an_onnx_model(exported, trained):
    assert exported.mlflow_model_uri
    client = MlflowClient(trained.tracking_uri)
    experiment_id = client.get_run(trained.run_id).info.experiment_id
    models = client.search_logged_models(experiment_ids=[experiment_id])
    assert any(m.source_run_id == trained.run_id and m.name == "selector" for m in models)
    assert client.get_run(trained.run_id).data.metrics["export/max_abs_diff"] <= 1e-5
    versions = client.search_model_versions("name = 'ddte-selector-specinfer'")  # registered in the model registry
    assert any(v.run_id == trained.run_id for v in versions)


def test_registering_prints_nothing_of_mlflows_own(trained, tmp_path, capfd):
    """MLflow prints its registry lines straight to stderr; the export keeps them out of a command's output, and the
    model is still registered (a second version)."""
    export_selector(trained.checkpoint_path, tmp_path / "again.onnx")
    err = capfd.readouterr().err
    assert "Successfully registered" not in err and "Created version" not in err
    versions = MlflowClient(trained.tracking_uri).search_model_versions("name = 'ddte-selector-specinfer'")
    assert len([v for v in versions if v.run_id == trained.run_id]) >= 1


def test_the_file_is_an_ordinary_shared_file_written_over_the_old_one(trained, tmp_path):
    """Written through ddte_core.paths.staged_file: 0644 over an existing file, no temporary left beside it."""
    out = tmp_path / "sel.onnx"
    out.write_text("old")
    out.chmod(0o600)
    export_selector(trained.checkpoint_path, out, log_mlflow=False)
    assert oct(out.stat().st_mode & 0o777) == "0o644" and [p.name for p in tmp_path.iterdir()] == ["sel.onnx"]
    assert onnx.load(str(out)).graph.output[0].name == "scores"
