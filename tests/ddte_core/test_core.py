"""The bottom package: the output-path check, flat MLflow params, SIGTERM as Ctrl-C, tracking URIs."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ddte_core.paths import refuse_file_in_the_way
from ddte_core.signals import sigterm_as_interrupt
from ddte_core.tracking import flatten_params, resolve_tracking_uri


def test_a_file_in_the_way_of_an_output_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert refuse_file_in_the_way(tmp_path / "new" / "out") == tmp_path / "new" / "out"
    with pytest.raises(ValueError, match="is a file, not a folder"):
        refuse_file_in_the_way(blocker / "out")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        refuse_file_in_the_way(blocker)  # a folder output cannot be a file
    assert refuse_file_in_the_way(blocker, folder=False) == blocker  # a file output may be overwritten
    assert not (tmp_path / "new").exists()  # nothing is created


def test_nested_params_are_flattened():
    assert flatten_params("config", {"run": {"seed": 0, "tags": [1]}, "lr": 0.1}) == {
        "config/run/seed": 0, "config/run/tags": [1], "config/lr": 0.1}
    assert flatten_params("", {"a": {"b": 1}}) == {"a/b": 1}


def test_sigterm_unwinds_like_ctrl_c_and_the_old_handler_returns():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the handler raises as soon as the signal arrives
    assert signal.getsignal(signal.SIGTERM) is before


def test_relative_sqlite_uri_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri(None) == "http://127.0.0.1:5000"


def test_a_new_store_has_its_default_experiment_beside_it(tmp_path, monkeypatch):
    """MLflow gives every new store a Default experiment: open_store makes it point at mlartifacts/0 beside the
    database (made), not at ./mlruns/0 of the current folder (never made); an existing store is left as it is."""
    from mlflow.tracking import MlflowClient

    from ddte_core.tracking import open_store

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert open_store(uri) == uri
    default = MlflowClient(uri).get_experiment("0")
    assert default.name == "Default" and default.artifact_location == (tmp_path / "runs" / "mlartifacts" / "0").as_uri()
    assert (tmp_path / "runs" / "mlartifacts" / "0").is_dir() and not (tmp_path / "mlruns").exists()
    other = f"sqlite:///{tmp_path / 'other.db'}"
    MlflowClient(other).search_experiments()  # opened by MLflow alone: Default under ./mlruns
    open_store(other)
    assert MlflowClient(other).get_experiment("0").artifact_location == str(tmp_path / "mlruns" / "0")
    assert open_store("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_a_staged_file_is_whole_or_absent(tmp_path):
    from ddte_core.paths import staged_file

    target = tmp_path / "sub" / "out.txt"
    with staged_file(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole" and oct(target.stat().st_mode & 0o777) == "0o644"
    try:
        with staged_file(tmp_path / "sub" / "never.txt") as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    except RuntimeError:
        pass
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["out.txt"]


def test_quiet_lightning_drops_lightnings_status_lines_and_keeps_the_rest(caplog):
    """The accelerator, loader-probe, fit-stopped and reload lines go; a line ddte's user acts on stays."""
    import logging

    from ddte_core.tracking import quiet_lightning

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO):
        with quiet_lightning():
            for line in ("GPU available: False, used: False", "`Trainer.fit` stopped: `max_epochs=2` reached.",
                         "Restoring states from the checkpoint path at x", "a line that matters"):
                rank_zero.info(line)
            logging.getLogger("lightning.pytorch.loggers.mlflow").warning("Experiment with name x not found.")
        assert [r.getMessage() for r in caplog.records] == ["a line that matters"]
        rank_zero.info("GPU available: False, used: False")  # outside the block: as Lightning logs it
        assert caplog.records[-1].getMessage().startswith("GPU available")


def test_the_environment_record_names_the_machine_and_tolerates_a_missing_transformers(monkeypatch):
    """One record for every result file: the running torch's threads, the CPU model of ddte_core.machine, and
    transformers only where it is installed."""
    import importlib.util

    import torch

    from ddte_core.machine import cpu_model, environment

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        env = environment()
    finally:
        torch.set_num_threads(threads)
    assert set(env) == {"python", "torch", "transformers", "machine", "cpu", "cores", "threads"}
    assert env["threads"] == 1 and env["cpu"] == cpu_model() and env["torch"] == torch.__version__
    assert env["transformers"]  # installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "transformers" else real(name, *rest))
    assert environment()["transformers"] is None


def test_bf16_is_native_only_where_the_kernels_under_their_limits_run_it(monkeypatch):
    """bfloat16-native asks the kernels that will run: a oneDNN ISA limit below AVX512_CORE_BF16 makes bf16 emulated
    whatever /proc/cpuinfo says, and the dtype it picks is then fp32."""
    import torch

    import ddte_core.machine as machine
    from decode.pair import resolve_dtype

    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: True)
    for name, value in (("ONEDNN_MAX_CPU_ISA", "AVX2"), ("DNNL_MAX_CPU_ISA", "avx512_core")):
        machine.bf16_kernels_native.cache_clear()
        monkeypatch.setenv(name, value)
        try:
            assert not machine.native_bf16_cpu(), name
            assert resolve_dtype("bfloat16-native", torch.device("cpu")) == torch.float32
        finally:
            monkeypatch.delenv(name)
            machine.bf16_kernels_native.cache_clear()


def test_under_the_avx2_limit_the_bf16_probe_itself_says_emulated():
    """The probe, not only the variable's name: in a process started under ONEDNN_MAX_CPU_ISA=AVX2 (a Zen 3's
    refusal), oneDNN's bf16 product is refused, so bf16 is not native even with the name check set aside."""
    import os
    import subprocess
    import sys

    code = ("import ddte_core.machine as m; m._ISA_WITHOUT_BF16 = set(); "
            "print(m.bf16_kernels_native(), m.kernel_limits())")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    native, limits = out.stdout.strip().split(" ", 1)
    assert native == "False" and "ONEDNN_MAX_CPU_ISA=AVX2" in limits and "ATen AVX2" in limits


@pytest.mark.parametrize("place", ["file", "under-a-file", "proc"])
@pytest.mark.parametrize("variable", ["DDTE_LATENCY_CACHE", "DDTE_CACHE"])
def test_an_unusable_machine_cache_is_named_by_its_variable(tmp_path, monkeypatch, place, variable):
    """A cache variable naming a file, a place under a file, or where nothing can be written is one line naming the
    variable, not an OSError's "File exists" or "No such file or directory"; nothing is created."""
    from ddte_core.paths import latency_cache

    (tmp_path / "a-file").write_text("x")
    value = {"file": tmp_path / "a-file", "under-a-file": tmp_path / "a-file" / "sub", "proc": "/proc/ddte-nope"}[place]
    monkeypatch.delenv("DDTE_LATENCY_CACHE", raising=False)
    monkeypatch.setenv(variable, str(value))
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=rf"\${variable}"):
        latency_cache()
    assert sorted(tmp_path.iterdir()) == before


def test_a_signal_inside_a_store_write_waits_for_the_write_and_lightnings_exit_is_an_interrupt():
    """training_interrupts: a Ctrl-C (or SIGTERM) that arrives while the run's client writes lets the write finish,
    then interrupts; Lightning's sys.exit(1) after it caught the interrupt is a KeyboardInterrupt again; both
    signals' handlers come back."""
    import signal

    from ddte_core.signals import training_interrupts

    class Client:
        def __init__(self, sig):
            self.done, self.sig = [], sig

        def log_batch(self, name):  # a write a signal arrives in the middle of
            os.kill(os.getpid(), self.sig)
            time.sleep(0.05)  # the handler has run by now: the signal was pending on the write
            self.done.append(name)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in (signal.SIGINT, signal.SIGTERM):
        client = Client(sig)
        with pytest.raises(KeyboardInterrupt), training_interrupts(client):
            client.log_batch("metrics")
            client.log_batch("never")
        assert client.done == ["metrics"], sig
        assert "log_batch" not in vars(client)  # the guard is gone with the block
    with pytest.raises(KeyboardInterrupt), training_interrupts(None):  # what Lightning does with the interrupt
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise SystemExit(1) from None
    with pytest.raises(SystemExit), training_interrupts(None):  # an exit no signal started stays one
        raise SystemExit(3)
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
