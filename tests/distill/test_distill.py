"""`ddte distill` end to end in seconds on a tiny pair and a few corpus files: the loss falls, acceptance rises,
the draft is written whole and tracked; on-policy data stays in the training split; bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch

from ddte.cli import main
from distill.config import DistillConfig, load_distill_config
from tests.factories import REPO, save_tiny_pair, tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("distill-pair"), target_hidden=32, draft_hidden=16,
                          logit_scale=4.0, context=128)


def _overrides(tiny, tmp_path, **extra) -> list[str]:
    base = {
        "target": tiny / "target", "draft": tiny / "draft", "tokenizer": REPO / "models" / "tokenizer",
        "output": tmp_path / "out", "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "data.seq_len": 32, "data.batch_size": 8, "data.max_files": 3, "data.val_blocks": 8,
        "data.onpolicy_prefix": 8, "data.onpolicy_tokens": 8, "data.warm_start_steps": 10,
        "train.steps": 40, "train.val_every": 20, "train.warmup_steps": 5, "train.lr": 0.01, "train.threads": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_distillation_raises_acceptance_and_writes_a_loadable_draft(tiny, tmp_path, capsys):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    assert main(["distill", "--no-progress", *_overrides(tiny, tmp_path)]) == 0
    out = tmp_path / "out"
    summary = json.loads((out / "distill.json").read_text())
    for t in ("0.6", "1"):
        assert summary["after"][f"acceptance_T{t}"] > summary["before"][f"acceptance_T{t}"] + 0.02
    assert summary["after"]["loss"] < summary["before"]["loss"]
    draft = AutoModelForCausalLM.from_pretrained(out)  # safetensors, loads as fp32
    assert draft.config.hidden_size == 16 and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging folder left
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(summary["run_id"])
    assert "val/acceptance_T1" in run.data.metrics
    assert run.data.params["config/divergence"] == DistillConfig().divergence
    history = client.get_metric_history(summary["run_id"], "train/loss")
    assert len(history) >= 3
    assert any(a.path == "draft" for a in client.list_artifacts(summary["run_id"]))
    assert "acceptance_T1:" in capsys.readouterr().out


def test_on_policy_sequences_continue_training_windows(tiny, tmp_path):
    """The draft's own samples extend windows of training-split text; held-out modules never enter the stream."""
    from data_gen.corpus import split_of
    from distill.data import corpus_files
    from distill.module import DistillModule
    from distill.run import load_models

    config = load_distill_config(None, _overrides(tiny, tmp_path))
    train, heldout = corpus_files(config.data.heldout_fraction, 40)
    assert train and all(split_of(f.relpath) == "train" for f in train)
    assert not {f.relpath for f in train} & {f.relpath for f in heldout}
    _, target, draft = load_models(config)
    module = DistillModule(draft, target, "tvd", [1.0], config.data, config.train)
    windows = torch.randint(3, 4096, (4, 32))
    sequences = module._on_policy(windows)
    assert sequences.shape == (4, 8 + 8) and torch.equal(sequences[:, :8], windows[:, :8])
    assert draft.training  # sampling leaves the draft in training mode


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"divergence": "hellinger"}, "divergence must be one of"),
        ({"train.steps": 0}, "train: steps"),
        ({"draft": "/nonexistent/draft"}, "does not exist"),
        ({"data.onpolicy_fraction": 1.5}, "onpolicy_fraction"),
        ({"steer.enabled": "true", "data.text": "laws", "data.responses": 2, "teacher_topk": 4}, "steer.enabled"),
        ({"steer.enabled": "true", "steer.target_layers": "[0,9]"}, "the target has hidden states 0..1"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tiny, tmp_path, capsys, change, message):
    assert main(["distill", "--no-progress", *_overrides(tiny, tmp_path, **change)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not (tmp_path / "out").exists()


def test_a_draft_of_another_vocabulary_is_refused(tiny, tmp_path, capsys):
    tiny_llama(5, vocab=4000, hidden=16).save_pretrained(tmp_path / "odd")
    assert main(["distill", "--no-progress", *_overrides(tiny, tmp_path, draft=tmp_path / "odd")]) == 2
    assert "vocabulary mismatch" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_an_existing_output_is_refused_unless_overwrite(tiny, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["distill", "--no-progress", *_overrides(tiny, tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err


def test_steered_distillation_trains_the_map_and_writes_a_steered_draft(tiny, tmp_path):
    """steer.enabled: the map leaves zero, the draft folder carries it bound to this target, and the pair loads
    steered; beside another target it is refused."""
    from decode.models.steering import SteeringMap
    from decode.pair import load_pair

    overrides = _overrides(tiny, tmp_path, **{"steer.enabled": "true", "steer.rank": 4, "steer.max_offset": 3,
                                              "train.steps": 12, "train.val_every": 12})
    assert main(["distill", "--no-progress", *overrides]) == 0
    out = tmp_path / "out"
    steering = SteeringMap.load(out)
    assert steering.spec.target_layers == (0, 1) and steering.spec.rank == 4 and steering.spec.max_offset == 3
    assert float(steering.out.weight.detach().abs().max()) > 0  # trained away from its zero start
    assert json.loads((out / "distill.json").read_text())["steering"]["parameters"] > 0
    pair = load_pair(tiny / "target", out, REPO / "models" / "tokenizer")
    assert pair.draft.hook is not None and pair.target.hook.tap_layers == (0, 1)
    other = save_tiny_pair(tmp_path / "other", target_hidden=32, draft_hidden=16, context=128, seeds=(9, 2))
    with pytest.raises(ValueError, match="another target"):
        load_pair(other / "target", out, REPO / "models" / "tokenizer")
