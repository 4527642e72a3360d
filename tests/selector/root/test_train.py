"""Training smoke test on the synthetic set: the loss falls, the selector beats static shapes, MLflow holds it all."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from selector.root.train import format_summary
from tests.factories import TINY_TRAIN_CONFIG as TINY_CONFIG
from tests.factories import TRAINED_EPOCHS


def _run(trained):
    return MlflowClient(trained.tracking_uri).get_run(trained.run_id)


def test_loss_falls_and_the_selector_beats_static(trained):
    history = MlflowClient(trained.tracking_uri).get_metric_history(trained.run_id, "train/loss")
    values = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(values) == TRAINED_EPOCHS  # one point per epoch
    assert values[-1] < values[0]
    # the labels depend on one scalar: even the tiny net must beat the best static shape on unseen prompts
    assert trained.metrics["ratio_vs_static"] > 1.0
    assert 0.0 <= trained.metrics["regret"] < 0.2


def test_mlflow_run_holds_metrics_params_and_artifacts(trained):
    mlflow.set_tracking_uri(trained.tracking_uri)
    frame = mlflow.search_runs(experiment_names=["ddte-selector-tiny"])
    main = frame[frame.run_id == trained.run_id].iloc[0]
    assert main["params.git_commit"]  # the repository is a git checkout
    assert len(main["params.data_fingerprint"]) == 64
    assert "params.config/model/objective" not in main.index  # each hyper-parameter logged once, by Lightning
    assert main["params.objective"] == "policy" and main["params.lr"] == "0.003"
    assert main["params.config/trainer/max_epochs"] == str(TRAINED_EPOCHS)  # sections Lightning does not log itself
    for key in ("val/ratio_vs_static", "val/ratio_vs_oracle", "val/regret", "val/ratio_vs_static/cfg1",
                "test/ratio_vs_static", "test/regret", "train_seconds"):
        assert f"metrics.{key}" in main.index and main[f"metrics.{key}"] == main[f"metrics.{key}"]  # not NaN
    run = _run(trained)
    assert len(MlflowClient(trained.tracking_uri).get_metric_history(trained.run_id, "val/regret")) == TRAINED_EPOCHS
    artifacts = {a.path for a in MlflowClient(trained.tracking_uri).list_artifacts(trained.run_id)}
    assert {"config.yaml", "summary.json", "checkpoint", "plots", "environment.json"} <= artifacts
    inputs = run.inputs.dataset_inputs  # the data set, as the run's input
    assert len(inputs) == 1 and inputs[0].dataset.digest == main["params.data_fingerprint"][:36]
    assert run.data.tags["env/torch"].startswith("2.13")
    plots = {a.path for a in MlflowClient(trained.tracking_uri).list_artifacts(trained.run_id, "plots")}
    assert {"plots/chosen_actions.png", "plots/chosen_vs_oracle_throughput.png"} <= plots
    assert run.info.status == "FINISHED"


def test_baselines_are_their_own_runs(trained):
    client = MlflowClient(trained.tracking_uri)
    experiment = client.get_experiment(_run(trained).info.experiment_id)
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.`ddte.parent_run_id` = '{trained.run_id}'")
    assert {r.data.tags["ddte.baseline"] for r in children} == {"ridge", "hgb"}
    for r in children:
        assert "test/ratio_vs_static" in r.data.metrics and "fit_seconds" in r.data.metrics
    assert set(trained.baselines) == {"ridge", "hgb"}


def test_summary_and_checkpoint(trained):
    summary = json.loads(trained.summary_path.read_text())
    assert trained.summary_path.parent == trained.checkpoint_path.parent
    assert summary["run_id"] == trained.run_id and summary["verifier"] == "specinfer"
    assert summary["test"]["ratio_vs_static"] == trained.metrics["ratio_vs_static"]
    ckpt = torch.load(trained.checkpoint_path, map_location="cpu", weights_only=True)
    assert ckpt["ddte"]["run_id"] == trained.run_id and ckpt["ddte"]["decision"] == "argmax"
    table = format_summary(trained)
    assert trained.run_id in table and "| mean |" in table


@pytest.fixture(scope="module")
def trained_be_gbv(synthetic_dir, tracking_uri, tmp_path_factory):
    """The other objective on the verifier with NaN labels (gbv on delayed trees), 3 epochs."""
    from selector.root.train import train_selector

    out = tmp_path_factory.mktemp("runs-be")
    return train_selector(TINY_CONFIG, [f"data.data_dir={synthetic_dir}", f"run.output_dir={out}",
                                        f"run.tracking_uri={tracking_uri}", "data.verifier=gbv",
                                        "model.objective=be", "trainer.max_epochs=3"], verbose=False)


def test_be_objective_on_gbv_never_picks_unlabelled_actions(trained_be_gbv, tmp_path):
    from selector.root.export import export_selector, load_selector, random_inputs
    from selector.root.model import INVALID_SCORE

    # offline_metrics raises on a NaN action, so finished test metrics mean no unlabelled action was chosen
    assert trained_be_gbv.info.data.verifier == "gbv" and trained_be_gbv.info.decision == "throughput"
    plots = {a.path for a in MlflowClient(trained_be_gbv.tracking_uri).list_artifacts(trained_be_gbv.run_id, "plots")}
    assert "plots/predicted_vs_true_be.png" in plots
    result = export_selector(trained_be_gbv.checkpoint_path, tmp_path / "gbv.onnx", log_mlflow=False)
    assert result.metadata.decision == "throughput" and result.metadata.verifier == "gbv"
    assert result.metadata.output == "expected_block_efficiency"
    assert result.metadata.invalid_score == INVALID_SCORE
    module = load_selector(trained_be_gbv.checkpoint_path)
    actions = module.info.data.actions
    delayed = [i for i, a in enumerate(actions) if a[0] != "1" and all(int(v) > 0 for v in a.split(","))]
    import onnxruntime as ort

    scores = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"]) \
        .run(["scores"], random_inputs(module, 4))[0]
    assert (scores[:, delayed] == INVALID_SCORE).all()


def test_the_config_is_typed_and_its_yaml_reads_back(tmp_path):
    """configs/train/*.yaml hold every key of TrainConfig; the resolved YAML (config.yaml of a run) reads back."""
    import dataclasses

    import yaml

    from selector.root.train_config import TrainConfig, config_yaml, load_train_config

    for path in (TINY_CONFIG, TINY_CONFIG.parent / "default.yaml"):
        written = yaml.safe_load(path.read_text())
        resolved = dataclasses.asdict(load_train_config(path))
        for key, value in written.items():
            assert ({k: resolved[key][k] for k in value} if isinstance(value, dict) else resolved[key]) == value
    config = load_train_config(TINY_CONFIG, ["model.lr=0.1"])
    (tmp_path / "resolved.yaml").write_text(config_yaml(config))
    assert load_train_config(tmp_path / "resolved.yaml") == config
    assert load_train_config(None) == TrainConfig()  # no file: the dataclasses' defaults
    with pytest.raises(ValueError, match="model.objective must be one of policy, be"):
        load_train_config(TINY_CONFIG, ["model.objective=ranking"])


def test_schema_1_data_trains_and_says_cross_fitting_is_unavailable(tmp_path):
    """A data set written before per-tree labels (schema 1) still trains a selector; its head-room figures that need
    per-tree labels are reported as unavailable, never as a number."""
    from selector.root.synthetic import write_synthetic_dataset
    from selector.root.train import format_summary, train_selector

    data = write_synthetic_dataset(tmp_path / "v1", n_prompts=10, roots_per_prompt=6, schema_version=1)
    result = train_selector(TINY_CONFIG, [f"data.data_dir={data}", f"run.output_dir={tmp_path / 'runs'}",
                                          f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                          "trainer.max_epochs=1"], verbose=False)
    rooms = result.head_room.values()
    assert rooms and all(r["cross_fitted_oracle"] is None and r["same_tree_oracle"] > 0 for r in rooms)
    assert "unavailable (needs per-tree labels of 2+ trees per root)" in format_summary(result)


def test_schema_2_training_logs_the_cross_fitted_head_room(trained):
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(trained.tracking_uri).get_run(trained.run_id).data.metrics
    for c in (0, 1):
        assert 0.5 < metrics[f"headroom/cross_fitted_oracle/cfg{c}"] < 2.0
        assert f"headroom/same_tree_oracle/cfg{c}" in metrics and f"guard/val_ratio/cfg{c}" in metrics
    assert all(f.action for f in trained.info.fallbacks)


@pytest.mark.parametrize(("override", "words"), [("model.lr=-1", "model.lr must be > 0"),
                                                 ("trainer.accelerator=gpu", "no CUDA device")])
def test_a_bad_setting_is_refused_before_any_mlflow_run(tmp_path, override, words):
    """Refused while the config is read: no MLflow database, experiment or FAILED run is left behind."""
    from selector.root.train_config import load_train_config

    if "gpu" in override and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=words):
        load_train_config(None, [override, f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    assert not list(tmp_path.iterdir())
