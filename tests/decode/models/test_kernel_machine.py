"""The kernel choice asks the machine (decode/models/kernels.py, kernel_choice.py, machine_cache.py).

A path that cannot run here (oneDNN's bf16 prepacking on a CPU without AVX-512 raises) is found by one trial, skipped
in ``auto`` with its reason in the kernel line, and refused in one line when asked for by name; ``auto`` measures only
the roles it is asked to; a near-tie keeps the default; ``onednn-wide`` runs one-token passes on ``F.linear`` and
wider ones on the oneDNN copy; two measurements on one empty cache run one after the other and agree.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from decode.models import kernel_choice
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import cached_lm
from decode.models.kernel_choice import KernelRequest, PathTimes, choose_kernels, choose_path
from decode.models.kernels import KERNEL_PATHS, release_stock_weights, trial_failure
from decode.models.machine_cache import measurement_lock
from tests.decode.architectures import arch_model
from tests.decode.models.test_architectures import V

ONEDNN_BF16 = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw"


def _oneDNN_without_bf16(monkeypatch) -> None:  # noqa: N802 - the library's name
    """Make ``onednn`` and ``onednn-wide`` fail on bf16 as they do on an AMD EPYC without AVX-512."""
    for name in ("onednn", "onednn-wide"):
        real = KERNEL_PATHS[name].prepare_fn

        def prepare(weight, bias, real=real):
            if weight.dtype == torch.bfloat16:
                raise RuntimeError(ONEDNN_BF16)
            return real(weight, bias)

        monkeypatch.setitem(KERNEL_PATHS, name, dataclasses.replace(KERNEL_PATHS[name], prepare_fn=prepare))


def _pair(dtype=torch.float32):
    target = CachedLM(arch_model("llama", 1, V, 32, 1, 8), dtype=dtype)
    draft = cached_lm(arch_model("llama", 2, V, 16, 1, 8), dtype=dtype)
    return target, draft


def _quick(monkeypatch, calls: list[str]) -> None:
    real = kernel_choice.measure_paths
    monkeypatch.setattr(kernel_choice, "measure_paths",
                        lambda model, role, paths, **kw: calls.append(role) or real(model, role, paths, repeats=1))


def test_a_path_that_fails_its_trial_is_unavailable_with_the_cpus_reason(monkeypatch) -> None:
    _oneDNN_without_bf16(monkeypatch)
    reason = KERNEL_PATHS["onednn"].unavailable(torch.bfloat16, torch.device("cpu"))
    assert reason is not None and "cannot run bfloat16 on this CPU" in reason and "avx512bw" in reason
    assert KERNEL_PATHS["onednn"].unavailable(torch.float32, torch.device("cpu")) is None
    assert KERNEL_PATHS["default"].unavailable(torch.bfloat16, torch.device("cpu")) is None


def test_the_trial_runs_once_per_process(monkeypatch) -> None:
    calls = []
    path = dataclasses.replace(KERNEL_PATHS["int8-weight"], name="counted",
                               prepare_fn=lambda w, b: calls.append(1) or (lambda x: F.linear(x, w.float()), 0))
    assert trial_failure(path, torch.float32) is None
    assert trial_failure(path, torch.float32) is None and len(calls) == 1


def test_auto_skips_a_path_the_cpu_cannot_run_and_says_why(monkeypatch) -> None:
    _oneDNN_without_bf16(monkeypatch)
    target, draft = _pair(torch.bfloat16)
    calls: list[str] = []
    _quick(monkeypatch, calls)
    choice = choose_kernels(target, draft, KernelRequest(), "pair", None)
    assert "onednn" not in choice.times["target"].block_ms and "default" in choice.times["target"].block_ms
    assert choice.target == "default" and target.kernel == "default"
    assert "skipped onednn: onednn cannot run bfloat16 on this CPU" in choice.line()


@pytest.mark.parametrize("request_text", ["onednn", "target=onednn,draft=int8-dynamic", "target=auto,draft=onednn"])
def test_a_fixed_path_the_cpu_cannot_run_is_one_line_before_any_measurement(monkeypatch, request_text) -> None:
    _oneDNN_without_bf16(monkeypatch)
    target, draft = _pair(torch.bfloat16)
    calls: list[str] = []
    _quick(monkeypatch, calls)
    refusal = r"^--kernels: the (target|draft) cannot take onednn: onednn cannot run"
    with pytest.raises(ValueError, match=refusal) as err:
        choose_kernels(target, draft, KernelRequest.parse(request_text), "pair", None)
    assert "\n" not in str(err.value) and calls == []


@pytest.mark.parametrize("request_text, measured", [("target=auto,draft=int8-dynamic", ["target"]),
                                                    ("target=default,draft=auto", ["draft"])])
def test_auto_measures_only_the_roles_it_is_asked_to(monkeypatch, tmp_path, request_text, measured) -> None:
    target, draft = _pair()
    calls: list[str] = []
    _quick(monkeypatch, calls)
    choice = choose_kernels(target, draft, KernelRequest.parse(request_text), "pair", tmp_path)
    assert calls == measured and set(choice.times) == set(measured)
    # a later full auto measures only the role the cache lacks, then reads both
    choose_kernels(target, draft, KernelRequest(), "pair", tmp_path)
    choose_kernels(target, draft, KernelRequest(), "pair", tmp_path)
    assert sorted(calls) == ["draft", "target"]


def test_a_near_tie_keeps_the_default() -> None:
    def times(onednn: float) -> PathTimes:
        return PathTimes([1, 2, 4, 8, 16], 64, {"default": [10.0] * 5, "onednn": [10.0 * onednn] * 5},
                         {"default": 100.0, "onednn": 100.0 * onednn})

    assert choose_path(times(0.97), "target") == "default"  # 3 % faster: within the noise
    assert choose_path(times(0.90), "target") == "onednn"


def test_onednn_wide_runs_one_token_on_f_linear_and_wider_blocks_on_the_copy() -> None:
    if KERNEL_PATHS["onednn-wide"].unavailable(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN fp32 on this torch build")
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    wide = KERNEL_PATHS["onednn-wide"].prepare(weight, bias)
    packed = KERNEL_PATHS["onednn"].prepare(weight, bias)
    one, block = torch.randn(1, 1, 32, generator=g), torch.randn(1, 6, 32, generator=g)
    assert torch.equal(wide(one), F.linear(one, weight, bias))
    assert torch.equal(wide(block), packed(block))
    assert (wide(block) - F.linear(block, weight, bias)).abs().max() < 1e-4


def test_release_keeps_the_weight_a_path_still_reads() -> None:
    if KERNEL_PATHS["onednn-wide"].unavailable(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN fp32 on this torch build")
    lm = CachedLM(arch_model("llama", 1, V, 32, 1, 8))
    seq = list(range(3, 20))
    want = lm.prefill(seq)
    lm.use_kernel("onednn-wide")
    assert release_stock_weights(lm.model) == 0
    assert (lm.prefill(seq) - want).abs().max() < 1e-4


def test_two_measurements_on_one_empty_cache_run_one_after_the_other(monkeypatch, tmp_path) -> None:
    running, overlaps, calls = [], [], []
    real = kernel_choice.measure_paths

    def measure(model, role, paths, **kw):
        running.append(role)
        overlaps.append(len(running) > 1)
        time.sleep(0.05)
        calls.append(role)
        try:
            return real(model, role, paths, repeats=1)
        finally:
            running.remove(role)

    monkeypatch.setattr(kernel_choice, "measure_paths", measure)
    pairs = [_pair(), _pair()]
    choices = [None, None]

    def run(i: int) -> None:
        choices[i] = choose_kernels(*pairs[i], KernelRequest(), "pair", tmp_path)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not any(overlaps) and calls == ["target", "draft"]  # the second waited, then read the first's
    assert choices[0].line() == choices[1].line()


def test_the_lock_excludes_a_second_holder(tmp_path) -> None:
    order = []

    def hold(name: str) -> None:
        with measurement_lock(tmp_path):
            order.append(f"{name} in")
            time.sleep(0.05)
            order.append(f"{name} out")

    threads = [threading.Thread(target=hold, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert order[0].endswith("in") and order[1] == order[0].replace("in", "out")



@pytest.mark.parametrize("kernels_flag, exit_code", [("onednn", 2), ("target=onednn,draft=default", 2), ("auto", 0)])
def test_generate_on_a_cpu_without_bf16_onednn(tmp_path, monkeypatch, capsys, kernels_flag, exit_code) -> None:
    """A bf16 pair on a CPU whose oneDNN cannot prepack bf16: a fixed request is one line and exit 2, auto runs and
    prints a kernel line naming what it skipped."""
    from ddte.cli import main
    from tests.factories import save_tiny_pair

    _oneDNN_without_bf16(monkeypatch)
    monkeypatch.setenv("DDTE_LATENCY_CACHE", str(tmp_path / "cache"))
    pair = save_tiny_pair(tmp_path / "pair", vocab=64)
    capsys.readouterr()  # the saving's progress lines
    argv = ["generate", "--prompt-ids", "5,9", "--target", str(pair / "target"), "--draft", str(pair / "draft"),
            "--dtype", "bfloat16", "--verifier", "specinfer", "--action", "1,2,0", "--max-new-tokens", "3",
            "--kernels", kernels_flag]
    assert main(argv) == exit_code
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    if exit_code:
        assert len(err) == 1 and "cannot take onednn: onednn cannot run bfloat16 on this CPU" in err[0], err
    else:
        assert any(line.startswith("kernels: ") and "skipped onednn" in line for line in err), err


@pytest.mark.parametrize("limit", [("ONEDNN_MAX_CPU_ISA", "AVX2"), ("ATEN_CPU_CAPABILITY", "avx2"),
                                   ("DNNL_MAX_CPU_ISA", "AVX512_CORE")])
def test_a_choice_made_under_a_kernel_limit_is_cached_apart(monkeypatch, tmp_path, limit) -> None:
    """A limit on the kernels changes which paths run: a choice measured under one is never read by a plain run, nor
    the plain run's under the limit."""
    from decode.models.machine_cache import machine_identity

    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    calls: list[str] = []
    _quick(monkeypatch, calls)
    target, draft = _pair()
    plain = choose_kernels(target, draft, KernelRequest(), "pair", tmp_path)
    monkeypatch.setenv(*limit)
    limited = choose_kernels(target, draft, KernelRequest(), "pair", tmp_path)
    assert calls == ["target", "draft"] * 2, "the choice made without the limit was read under it"
    assert f"{limit[0]}={limit[1]}" in limited.machine and limit[0] not in plain.machine
    assert f"{limit[0]}={limit[1]}" in machine_identity(target, draft)  # the latency tables' key too
    monkeypatch.delenv(limit[0])
    choose_kernels(target, draft, KernelRequest(), "pair", tmp_path)
    assert calls == ["target", "draft"] * 2  # the plain choice is still there for a plain run
