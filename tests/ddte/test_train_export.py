"""`ddte train` and `ddte export` from the console script: bad inputs give exit 2, one line, no traceback, no file."""

from __future__ import annotations

import pytest

from ddte.cli import main
from tests.factories import TINY_TRAIN_CONFIG as TINY_CONFIG


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith(f"ddte {command}: error:")]
    assert len(errors) == 1, err
    assert not any("Traceback" in line for line in err)
    return errors[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.data_dir={missing}"], "does not exist"),
        (["data.data_dir={data}", "data.verifier=bogus"], "unknown verifier 'bogus'"),
        (["data.data_dir={data}", "model.objective=ranking"], "model.objective"),
        (["data.data_dir={data}", "model.no_such_key=1"], "unknown config key(s): model.no_such_key"),
        (["not-a-key-value"], "is not KEY=VALUE"),
        (["data.data_dir={data}", "trainer.max_epochs=-1"], "trainer.max_epochs must be >= 1"),
    ],
)
def test_train_bad_input(capsys, tmp_path, synthetic_dir, overrides, message):
    fill = {"missing": tmp_path / "nope", "data": synthetic_dir}
    argv = ["train", "--config", str(TINY_CONFIG), f"run.output_dir={tmp_path / 'out'}",
            f"run.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *(o.format(**fill) for o in overrides)]
    assert main(argv) == 2
    assert message in _one_line_error(capsys, "train")
    assert not (tmp_path / "out").exists()


def test_train_too_few_prompts_fails_the_run(capsys, tmp_path):
    from mlflow.tracking import MlflowClient

    from selector.root.synthetic import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "two", n_prompts=2, roots_per_prompt=4, n_shards=1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["train", "--config", str(TINY_CONFIG), f"data.data_dir={data}", f"run.tracking_uri={uri}",
                 f"run.output_dir={tmp_path / 'out'}"]) == 2
    assert "too few prompts" in _one_line_error(capsys, "train")
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("ddte-selector-tiny").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    default = client.get_experiment("0")  # every store has one: ours points beside the database, at a folder
    assert default.artifact_location == (tmp_path / "mlartifacts" / "0").as_uri()
    assert (tmp_path / "mlartifacts" / "0").is_dir()


def test_override_forms():
    """The one override syntax of every command: dotted KEY=VALUE, the value as YAML, later ones win."""
    from selector.root.train_config import load_train_config

    config = load_train_config(TINY_CONFIG, ["model.lr=0.1", "model.mlp_hidden=[8, 4]", "run.tracking_uri=null",
                                             "trainer.max_epochs=3", "trainer.max_epochs=5"])
    assert (config.model.lr, config.model.mlp_hidden, config.run.tracking_uri) == (0.1, [8, 4], None)
    assert config.trainer.max_epochs == 5
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        load_train_config(TINY_CONFIG, ["lr"])
    with pytest.raises(ValueError, match="trainer.max_epochs: expected int"):
        load_train_config(TINY_CONFIG, ["trainer.max_epochs=many"])


def test_train_missing_config(capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in _one_line_error(capsys, "train")


def test_train_print_config(capsys, synthetic_dir):
    assert main(["train", "--config", str(TINY_CONFIG), "--print-config", "model.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "verifier: specinfer" in out


def test_export_missing_checkpoint(capsys, tmp_path):
    out = tmp_path / "sel.onnx"
    assert main(["export", "--checkpoint", str(tmp_path / "none.ckpt"), "--output", str(out)]) == 2
    assert "not found" in _one_line_error(capsys, "export")
    assert list(tmp_path.iterdir()) == []


def test_export_not_a_checkpoint(capsys, tmp_path):
    bogus = tmp_path / "bogus.ckpt"
    bogus.write_bytes(b"not a checkpoint")
    assert main(["export", "--checkpoint", str(bogus), "--output", str(tmp_path / "sel.onnx")]) == 2
    assert "not a selector checkpoint" in _one_line_error(capsys, "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bogus.ckpt"]


class _Payload:
    """A pickled object that would run code on load: weights-only loading must refuse it."""

    def __reduce__(self):
        return (print, ("unpickled",))


def test_export_refuses_a_checkpoint_that_unpickles_objects(capsys, tmp_path, trained):
    import torch

    checkpoint = torch.load(trained.checkpoint_path, map_location="cpu", weights_only=True)
    checkpoint["extra"] = _Payload()
    tainted = tmp_path / "tainted.ckpt"
    torch.save(checkpoint, tainted)
    assert main(["export", "--checkpoint", str(tainted), "--output", str(tmp_path / "sel.onnx")]) == 2
    assert "not a selector checkpoint" in _one_line_error(capsys, "export")
    assert not (tmp_path / "sel.onnx").exists()


def test_export_unwritable_output(capsys, tmp_path, trained):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # a path under a regular file cannot be created (even as root)
    assert main(["export", "--checkpoint", str(trained.checkpoint_path), "--output", str(blocker / "sel.onnx"),
                 "--no-mlflow"]) == 2
    assert "is a file, not a folder" in _one_line_error(capsys, "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_export_to_a_bogus_run_writes_nothing(capsys, tmp_path, trained, tracking_uri):
    out = tmp_path / "sel.onnx"
    assert main(["export", "--checkpoint", str(trained.checkpoint_path), "--output", str(out), "--run-id", "bogus",
                 "--tracking-uri", tracking_uri]) == 2
    assert "no MLflow run bogus" in _one_line_error(capsys, "export")
    assert list(tmp_path.iterdir()) == []


def test_export_cli_writes_and_reports(capsys, tmp_path, trained):
    out = tmp_path / "sel.onnx"
    assert main(["export", "--checkpoint", str(trained.checkpoint_path), "--output", str(out), "--no-mlflow",
                 "--parity-rows", "8"]) == 0
    printed = capsys.readouterr().out
    assert "max abs diff" in printed and "verifier specinfer" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sel.onnx"]
