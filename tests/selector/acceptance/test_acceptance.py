"""The acceptance model (selector/acceptance*.py, `ddte acceptance`) and the expander built on it: trained with
Lightning on dense labels of prompts the tree collection never used, its ONNX file computes the torch model, it starts
from the scalars alone, an expander fitted with it embeds its graph and decodes on its pair reading the draft's hidden
states only, and a model trained on the collection's own prompts is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ddte.cli import main
from tests.factories import COLLECT_PROMPTS

OTHER_PROMPTS = ["while True:\n    break\n", "def mul(a, b):\n    return a * b\n", "y = {'a': 1}\n",
                 "print('hello')\n", "import sys\nprint(sys.argv)\n", "z = (1, 2)\nprint(z)\n"]


def _dense(pair, folder, first_prompt: int, count: int):
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in COLLECT_PROMPTS + OTHER_PROMPTS))
    out = folder / "dense"
    assert main(["dense-labels", "--pair", str(pair / "pair.yaml"), "--prompts", str(prompts), "--first-prompt",
                 str(first_prompt), "--num-prompts", str(count), "--continuations", "3", "--length", "10",
                 "--temperature", "0.7", "1.0", "--kernels", "default", "--no-progress", "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def dense_after_collection(tiny_pair, tmp_path_factory):
    """Dense labels on six prompts after the five the tiny collection used (ids 5..10)."""
    return _dense(tiny_pair, tmp_path_factory.mktemp("dense"), len(COLLECT_PROMPTS), len(OTHER_PROMPTS))


@pytest.fixture(scope="module")
def acceptance_file(dense_after_collection, tmp_path_factory):
    from selector.acceptance.acceptance_train import load_acceptance_config, train_acceptance

    folder = tmp_path_factory.mktemp("acceptance")
    config = load_acceptance_config(None, [f"data.data_dir={dense_after_collection}", "trainer.max_epochs=3",
                                           f"run.output={folder / 'a.onnx'}", "model.width=8", "run.progress=false",
                                           f"run.tracking_uri=sqlite:///{folder / 'mlflow.db'}",
                                           "data.val_fraction=0.2", "data.test_fraction=0.2"])
    return train_acceptance(config), folder


def test_the_model_is_trained_scored_and_exported_with_its_parity(acceptance_file, dense_after_collection):
    import onnx
    import onnxruntime as ort

    from selector.acceptance.acceptance_data import load_dense
    from selector.acceptance.acceptance_train import format_acceptance, node_vectors

    result, folder = acceptance_file
    assert result.parity < 1e-4 and result.call_us > 0
    assert set(result.test) >= {"model/r2", "entropy/r2", "model/calibration_error"}
    table = format_acceptance(result)
    assert "| acceptance model |" in table and "entropy alone (isotonic)" in table
    props = {p.key: p.value for p in onnx.load(str(result.path)).metadata_props}
    assert np.allclose(json.loads(props["ddte.acceptance.temperatures"]), [0.7, 1.0])
    assert set(json.loads(props["ddte.acceptance.fit_prompts"])) == {str(i) for i in range(5, 11)}
    _, arrays = load_dense(dense_after_collection)
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    beta = session.run(None, {"node": node_vectors(arrays)})[0]
    assert beta.shape == (len(arrays), 2) and ((beta > 0) & (beta < 1)).all()
    # the MLflow run holds the curves, the test figures and the calibration plot
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    run = client.get_run(result.run_id)
    assert {"train/loss", "val/loss", "test/model/r2", "parity_max_abs"} <= set(run.data.metrics)
    assert {a.path for a in client.list_artifacts(result.run_id, "plots")} == {"plots/calibration.png"}
    assert run.inputs.dataset_inputs  # the data set is the run's input


def test_an_untrained_net_is_the_scalar_model_the_hidden_state_adds_to():
    from selector.acceptance.acceptance import AcceptanceNet

    net = AcceptanceNet(16, width=8).eval()
    scalars = torch.tensor([[1.2, 0.6, 2.0, 1.0]]).expand(5, 4)
    out = net(torch.randn(5, 16), scalars)
    assert torch.allclose(out, out[:1].expand(5))  # the residual starts at zero: only the scalars count


def test_the_onnx_file_is_an_ordinary_shared_file_written_over_the_old_one(tmp_path):
    """The export goes through ddte_core.paths.staged_file: 0644 over an existing 0644 file (mkstemp's 0600 was
    renamed onto it before), and no temporary file is left beside it."""
    from selector.acceptance.acceptance import AcceptanceNet
    from selector.acceptance.acceptance_train import export_acceptance

    path = tmp_path / "a.onnx"
    path.write_text("old")
    path.chmod(0o644)
    check = np.random.default_rng(0).normal(size=(4, 16 + 3)).astype(np.float32)
    parity, _ = export_acceptance(AcceptanceNet(16, width=4).eval(), path, [1.0], {"k": "v"}, check)
    assert parity < 1e-4 and oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == ["a.onnx"]


def test_an_expander_on_the_model_embeds_it_and_decodes_reading_draft_states_only(acceptance_file, tiny_collected,
                                                                                 tiny_pair, tmp_path):
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.engine import SpeculativeDecoder
    from decode.pair import load_pair_config
    from decode.policies.expander import ExpanderSource
    from decode.policies.files.expander_file import read_expander_metadata
    from decode.verifiers import get_verifier
    from selector.expander.expander import fit_expander, write_expander

    result, _ = acceptance_file
    fitted = fit_expander(tiny_collected, "traversal", folds=2, min_gain=-1.0, signals=["marginal"],
                          acceptance=result.path)
    path = tmp_path / "expander.onnx"
    write_expander(fitted, path)
    meta = read_expander_metadata(path)
    assert meta.head_inputs == "node" and [r.signal for r in meta.rules] == ["marginal", "marginal"]
    assert all({"acceptance", "marginal", "entropy"} <= set(r.offline) and r.chain_ms for r in meta.rules)
    pair = load_pair_config(tiny_pair / "pair.yaml")
    policy = ExpanderSource.for_pair(path, "traversal", pair)
    started = policy.start(SamplingConfig(0.7))
    assert started.needs_draft_hidden and not started.needs_root_features  # no root features, no target states
    decoder = SpeculativeDecoder(pair.target, pair.draft, get_verifier("traversal"), pair.eos_token_id)
    generation = decoder.generate([5, 6, 7, 8], 24, policy, TorchRandom(0), SamplingConfig(0.7))
    assert generation.stats.new_tokens == 24 and generation.stats.network_seconds


def test_a_model_trained_on_the_collections_prompts_is_refused(acceptance_file, tiny_collected, tiny_pair,
                                                                tmp_path, capsys):
    from selector.acceptance.acceptance_train import load_acceptance_config, train_acceptance

    seen = _dense(tiny_pair, tmp_path, 0, 4)  # ids 0..3: the collection's own prompts
    config = load_acceptance_config(None, [f"data.data_dir={seen}", "trainer.max_epochs=1", "model.width=4",
                                           f"run.output={tmp_path / 'seen.onnx'}", "run.progress=false",
                                           f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    path = train_acceptance(config).path
    capsys.readouterr()
    out = tmp_path / "e.onnx"
    assert main(["expander", "--data", str(tiny_collected), "--verifier", "traversal", "--acceptance", str(path),
                 "--output", str(out), "--no-mlflow", "--folds", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "trained on 4 of the collection's prompts" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_analyze_scores_the_rules_on_the_model_beside_the_others(acceptance_file, tiny_collected, tmp_path, capsys):
    result, _ = acceptance_file
    assert main(["analyze", "--data", str(tiny_collected), "--expansion", "--acceptance", str(result.path),
                 "--folds", "2", "--output", str(tmp_path / "analysis")]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [line for line in out if line.startswith("| 0.7 | traversal")]
    header = next(line for line in out if line.startswith("| T | verifier"))
    # 19 columns: the two rules and a correlation added to the 16 of the registry's seven signals and the rest
    assert len(table) == 1 and len(table[0].split("|")) == len(header.split("|")) == 21
    assert "draw_q rule" in header and "path_logq rule" in header
    expansion = json.loads((tmp_path / "analysis" / "expansion.json").read_text())
    assert {"acceptance", "marginal"} <= set(expansion["traversal/T0.7"])
    assert main(["analyze", "--data", str(tiny_collected), "--acceptance", str(result.path)]) == 2


def test_the_command_refuses_bad_input_in_one_line_before_any_work(dense_after_collection, tmp_path, capsys):
    cases = [(["acceptance"], "give --data"),
             (["acceptance", "--data", str(tmp_path)], "not a dense data set"),
             (["acceptance", "--data", str(dense_after_collection), "--output", str(tmp_path / "a.txt")],
              "an .onnx file"),
             (["acceptance", "--data", str(dense_after_collection), "model.width=0"], "width must be at least 1"),
             (["acceptance", "--data", str(dense_after_collection), "data.label=drawn"],
              "data.label must be one of exact, realized")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_the_model_trains_on_the_realized_label(dense_after_collection, tmp_path):
    """data.label=realized: the loader feeds the drawn token's min(1, p/q), not β; the model trains, scores against
    β (and the realized label) and its file says what it was fitted to."""
    import onnx

    from selector.acceptance.acceptance_data import load_dense
    from selector.acceptance.acceptance_file import AcceptanceMetadata
    from selector.acceptance.acceptance_train import _loader, load_acceptance_config, train_acceptance

    metadata, arrays = load_dense(dense_after_collection)
    assert metadata["schema_version"] == 2 and arrays.realized is not None
    assert np.isfinite(arrays.realized).all() and ((arrays.realized >= 0) & (arrays.realized <= 1)).all()
    assert not np.allclose(arrays.realized, arrays.beta)  # two labels: one met by a draw, one its mean over draws
    fed = next(iter(_loader(arrays, "realized", len(arrays), False, 0)))[2].numpy()
    assert np.array_equal(fed, arrays.realized)
    config = load_acceptance_config(None, [f"data.data_dir={dense_after_collection}", "trainer.max_epochs=2",
                                           f"run.output={tmp_path / 'r.onnx'}", "model.width=8", "run.progress=false",
                                           f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                           "data.label=realized", "data.val_fraction=0.2", "data.test_fraction=0.2"])
    result = train_acceptance(config)
    assert result.label == "realized" and result.parity < 1e-4
    assert {"model/r2", "model/realized_cross_entropy", "entropy/realized_cross_entropy"} <= set(result.test)
    props = {p.key: p.value for p in onnx.load(str(result.path)).metadata_props}
    assert AcceptanceMetadata.from_props(props, "r.onnx").label == "realized"


def _as_schema_1(dense, folder):
    """A copy of the dense set ``dense`` as schema 1 wrote it: no realized labels, no draw signals."""
    import shutil

    import pyarrow.parquet as pq

    from data_gen.dense import DRAW_COLUMNS, REALIZED_COLUMNS

    folder.mkdir()
    for shard in dense.glob("dense-*.parquet"):
        table = pq.read_table(shard)
        pq.write_table(table.drop_columns([c for c in (*REALIZED_COLUMNS, *DRAW_COLUMNS) if c in table.column_names]),
                       folder / shard.name)
    shutil.copy(dense / "README.md", folder / "README.md")
    metadata = json.loads((dense / "dense.json").read_text())
    (folder / "dense.json").write_text(json.dumps({**metadata, "schema_version": 1}))
    return folder


def test_a_schema_1_set_still_trains_on_beta_and_refuses_the_realized_label_in_one_line(dense_after_collection,
                                                                                       tmp_path, capsys):
    from selector.acceptance.acceptance_data import load_dense

    old = _as_schema_1(dense_after_collection, tmp_path / "old")
    _, arrays = load_dense(old)
    _, new = load_dense(dense_after_collection)
    assert arrays.realized is None and np.array_equal(arrays.beta, new.beta) and len(arrays.take([0, 2])) == 2
    assert arrays.label("exact") is arrays.beta
    with pytest.raises(ValueError, match="stores no realized labels"):
        arrays.label("realized")
    out = tmp_path / "a.onnx"
    assert main(["acceptance", "--data", str(old), "--output", str(out), "data.label=realized"]) == 2
    err = capsys.readouterr().err.strip()
    assert "stores no realized labels (schema 1" in err and len(err.splitlines()) == 1, err
    assert not out.exists()
    (old / "dense.json").write_text(json.dumps({**json.loads((old / "dense.json").read_text()), "schema_version": 9}))
    with pytest.raises(ValueError, match="schema version 9"):
        load_dense(old)


def test_ctrl_c_while_training_is_one_line_and_exit_130(dense_after_collection, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the fit ends `ddte acceptance` as every ddte command ends on it: one line, exit 130 (not
    Lightning's graceful shutdown's exit 1), SIGINT handled as before afterwards, no file written, and the MLflow run
    marked failed rather than left running."""
    import os
    import signal

    import mlflow

    from selector.acceptance.acceptance import AcceptanceNet

    calls = []
    real = AcceptanceNet.forward

    def interrupted_forward(self, *args, **kwargs):  # a Ctrl-C at the fit's second step (only the fit runs the net)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AcceptanceNet, "forward", interrupted_forward)
    before = signal.getsignal(signal.SIGINT)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = main(["acceptance", "--data", str(dense_after_collection), "--output", str(tmp_path / "a.onnx"),
                 "--tracking-uri", uri, "trainer.max_epochs=3", "model.width=8", "run.progress=false"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 130 and err == ["ddte acceptance: interrupted"], (code, err)
    assert signal.getsignal(signal.SIGINT) is before
    assert not (tmp_path / "a.onnx").exists()
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert runs and all(run.info.status == "FAILED" for run in runs)
