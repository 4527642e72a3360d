"""Interrupts end every command as ddte's others end (issue 72, round 5): one line, the conventional exit code (130 for
Ctrl-C, ddte/cli.py), no traceback from a library's own shutdown (Lightning's graceful one, a client thread, uvicorn's
cancelled tasks).
"""

from __future__ import annotations

from ddte.cli import main


def test_ctrl_c_while_a_selector_trains_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """`ddte train` fits with Lightning too: its graceful shutdown's exit 1 is ddte's interrupt, one line and 130."""
    import os
    import signal

    from selector.root.model import SelectorModule
    from selector.root.synthetic import write_synthetic_dataset
    from tests.factories import TINY_TRAIN_CONFIG

    data = write_synthetic_dataset(tmp_path / "data", n_prompts=8, roots_per_prompt=4, hidden=(32, 16))
    real, calls = SelectorModule.training_step, []

    def interrupted_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SelectorModule, "training_step", interrupted_step)
    before = signal.getsignal(signal.SIGINT)
    capsys.readouterr()
    code = main(["train", "--config", str(TINY_TRAIN_CONFIG), "--data", str(data), "--tracking-uri",
                 f"sqlite:///{tmp_path / 'mlflow.db'}", f"run.output_dir={tmp_path / 'runs'}", "trainer.max_epochs=3"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 130 and err == ["ddte train: interrupted"], (code, err)
    assert signal.getsignal(signal.SIGINT) is before
