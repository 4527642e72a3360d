"""Kernel paths for linear layers (decode/models/kernels.py) and the choice among them (decode/models/kernel_choice.py).

Exact paths must give the default path's logits to float rounding, through HF's forward (Llama, Qwen2 and
non-Llama families) and the draft's fast forward, including tree blocks, commits and crops; greedy decoding on a
multi-path tree with the chosen kernels must equal greedy decoding by full recompute. The choice is a deterministic
function of a measured table, and a table of another machine is measured again, not used.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.models import kernel_choice
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM, cached_lm
from decode.models.kernel_choice import KernelChoice, KernelRequest, PathTimes, choose_kernels, choose_path
from decode.models.kernels import KERNEL_PATHS, KernelLinear, release_stock_weights, stock_kernels, use_kernel
from decode.models.machine_cache import cache_file
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier
from tests.decode.architectures import arch_model
from tests.decode.models.test_architectures import V, _gap, _greedy_by_recompute, _recompute, _worst_gap

EXACT = [name for name, path in KERNEL_PATHS.items() if path.exact and name != "default"]
QUANTIZED = [name for name, path in KERNEL_PATHS.items() if not path.exact]
FAMILIES = ["llama", "qwen2", "gemma2", "phi", "gpt_neox"]  # Llama, Qwen2 and three families of other layouts
TOL = 1e-5  # relative to the row's largest |logit|: fp32 rounding sits near 1e-7, a wrong product far above


def _available(name: str, dtype=torch.float32) -> bool:
    return KERNEL_PATHS[name].unavailable(dtype, torch.device("cpu")) is None


@pytest.mark.parametrize("path", EXACT)
@pytest.mark.parametrize("family", FAMILIES)
def test_an_exact_path_keeps_the_targets_logits(family: str, path: str) -> None:
    if not _available(path):
        pytest.skip(f"{path} is not in this torch build")
    lm = CachedLM(arch_model(family, 1, V, 64, 2, 8))
    seq = list(range(3, 40))
    want = lm.prefill(seq)
    assert lm.use_kernel(path) > 0  # it prepacked copies
    assert any(isinstance(m, KernelLinear) for m in lm.model.modules())
    assert _gap(lm.prefill(seq), want) < TOL
    # tree blocks, commits and crops on the path, against a plain recompute on the stock layers
    assert _gap(_stock_recompute(lm, seq), want) < 1e-6
    assert _worst_gap_stock(lm) < TOL


def _stock_recompute(lm: CachedLM, seq: list[int]) -> torch.Tensor:
    with stock_kernels(lm.model):
        return _recompute(lm, seq)


def _worst_gap_stock(lm: CachedLM) -> float:
    """:func:`_worst_gap` with every reference recomputed on the stock layers."""
    import tests.decode.models.test_architectures as arch

    saved = arch._recompute
    arch._recompute = _stock_recompute
    try:
        return _worst_gap(lm)
    finally:
        arch._recompute = saved


@pytest.mark.parametrize("path", EXACT)
def test_an_exact_path_keeps_the_fast_forwards_logits(path: str) -> None:
    if not _available(path):
        pytest.skip(f"{path} is not in this torch build")
    lm = cached_lm(arch_model("qwen2", 2, V, 32, 1, 8))
    assert isinstance(lm, FastCachedLM)
    lm.use_kernel(path)
    assert lm.kernel == path
    assert _worst_gap(lm) < TOL  # its references are HF's stock forward


@pytest.mark.parametrize("path", QUANTIZED)
def test_a_quantized_path_changes_the_draft_a_little_and_warns_nothing(path: str) -> None:
    if not _available(path):
        pytest.skip(f"{path} is not in this torch build")
    lm = cached_lm(arch_model("llama", 2, V, 32, 1, 8))
    seq = list(range(3, 20))
    want = lm.prefill(seq).softmax(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated quantized-tensor constructor must stay quiet
        lm.use_kernel(path)
        got = lm.prefill(seq).softmax(-1)
    gap = float((got - want).abs().max())
    assert 1e-6 < gap < 0.1


def test_the_dynamic_int8_ops_are_still_in_torch() -> None:
    """The int8-dynamic path reaches fbgemm's ops, which torch.ao.quantization's deprecation may remove: this fails
    the day they go, rather than the path quietly disappearing from every machine's choice. oneDNN's ops are there
    too; whether they run bf16 is the CPU's and its limits' business (a CPU without AVX-512, or
    ONEDNN_MAX_CPU_ISA=AVX2, refuses it: .ci/run runs these tests so), and the path says so exactly where oneDNN
    does."""
    assert _available("int8-dynamic")
    assert hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    assert _available("onednn")
    assert _available("onednn", torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_stock_kernels_give_back_f_linear_and_default_restores_plain_layers() -> None:
    model = arch_model("llama", 3, V, 32, 1, 8)
    lm = CachedLM(model)
    seq = list(range(5, 25))
    want = lm.prefill(seq)
    lm.use_kernel("int8-weight")
    with stock_kernels(lm.model):
        assert torch.equal(lm.prefill(seq), want)
    assert not torch.equal(lm.prefill(seq), want)
    use_kernel(lm.model, "default")
    assert not any(isinstance(m, KernelLinear) for m in lm.model.modules())
    assert torch.equal(lm.prefill(seq), want)


@pytest.mark.parametrize("path", ["onednn", "int8-weight", "default"])
def test_a_layers_hooks_follow_it_onto_a_path(path: str) -> None:
    """A steered draft on HF's forward adds its bias through hooks on the up projections: they must survive."""
    from decode.models.hooks import UpProjectionBias

    lm = CachedLM(arch_model("llama", 4, V, 32, 1, 8))
    bias = UpProjectionBias(lm.model)
    seq = list(range(5, 15))
    plain = lm.prefill(seq)
    bias.delta = torch.full((1, lm.model.config.intermediate_size), 0.5)
    steered = lm.prefill(seq)
    assert not torch.allclose(plain, steered)
    lm.use_kernel(path)
    tol = 1e-5 if KERNEL_PATHS[path].exact else 0.1
    assert _gap(lm.prefill(seq), steered) < tol
    bias.remove()
    assert _gap(lm.prefill(seq), plain) < tol


def test_released_stock_weights_free_the_copies_but_keep_tied_ones() -> None:
    model = arch_model("llama", 3, V, 32, 1, 8)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as small drafts are
    lm = CachedLM(model)
    seq = list(range(5, 25))
    lm.use_kernel("onednn")
    want = lm.prefill(seq)
    freed = release_stock_weights(lm.model)
    assert freed == sum(m.in_features * m.out_features * 4 for m in lm.model.modules()
                        if isinstance(m, KernelLinear) and m is not lm.model.lm_head)
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert torch.equal(lm.prefill(seq), want)
    with pytest.raises(ValueError, match="released"), stock_kernels(lm.model):
        lm.prefill(seq)


@pytest.mark.parametrize("verifier", ["traversal", "specinfer"])
def test_greedy_on_a_multi_path_tree_equals_a_full_recompute_on_the_chosen_kernels(verifier: str) -> None:
    target = CachedLM(arch_model("qwen2", 1, V, 64, 2, 8))
    draft = cached_lm(arch_model("qwen2", 2, V, 32, 1, 8))
    choice = choose_kernels(target, draft, KernelRequest("onednn", "int8-dynamic"), "pair", None)
    assert (choice.target, choice.draft, target.kernel, draft.kernel) == ("onednn", "int8-dynamic") * 2
    prompt = [5, 9, 3, 17, 22, 40, 2, 11]
    want = _greedy_by_recompute(target.model, prompt, 24)  # the target's own layers, on its chosen path
    decoder = SpeculativeDecoder(target, draft, get_verifier(verifier))
    got = decoder.generate(prompt, 24, StaticPolicy(Action(2, 1, 2)), TorchRandom(0), SamplingConfig(0.0))
    assert got.tokens == want


def _times(block: dict[str, list[float]], prefill: dict[str, float]) -> PathTimes:
    return PathTimes([1, 2, 4, 8], 64, block, prefill)


def test_the_choice_is_a_function_of_the_table() -> None:
    times = _times({"default": [10, 12, 30, 40], "onednn": [11, 12, 13, 15], "int8-dynamic": [4, 4, 5, 6]},
                   {"default": 100, "onednn": 95, "int8-dynamic": 40})
    assert choose_path(times, "draft") == "int8-dynamic"
    assert all(choose_path(times, "draft") == "int8-dynamic" for _ in range(5))
    flat = _times({"default": [10, 12, 30, 40], "onednn": [11, 12, 13, 15]}, {"default": 100, "onednn": 95})
    assert choose_path(flat, "draft") == "onednn"
    # the one-token pass weighs most for the draft: a path slower there loses what it gains on wide passes
    steep = _times({"default": [10, 12, 14, 16], "onednn": [13, 12, 13, 15]}, {"default": 100, "onednn": 100})
    assert choose_path(steep, "draft") == "default"
    tie = _times({"default": [10, 10, 10, 10], "onednn": [10, 10, 10, 10]}, {"default": 100, "onednn": 100})
    assert choose_path(tie, "draft") == "default"  # ties go to the earlier path


def test_a_choice_measured_elsewhere_is_measured_again(tmp_path, monkeypatch) -> None:
    target = CachedLM(arch_model("llama", 1, V, 32, 1, 8))
    draft = cached_lm(arch_model("llama", 2, V, 16, 1, 8))
    calls = []
    real = kernel_choice.measure_paths
    monkeypatch.setattr(kernel_choice, "measure_paths",
                        lambda model, role, paths, **kw: calls.append(role) or real(model, role, paths, repeats=1))
    first = choose_kernels(target, draft, KernelRequest(), "pair-a", tmp_path)
    assert calls == ["target", "draft"]
    again = choose_kernels(target, draft, KernelRequest(), "pair-a", tmp_path)  # cached: no measurement
    assert calls == ["target", "draft"] and (again.target, again.draft) == (first.target, first.draft)
    # the same file, recording another processor: measured anew, not used
    path = cache_file(tmp_path, "kernels", "pair-a", first.machine)
    forged = KernelChoice.from_json(path.read_text())
    forged.machine = forged.machine.replace("flags", "flags 0000")
    path.write_text(forged.to_json())
    choose_kernels(target, draft, KernelRequest(), "pair-a", tmp_path)
    assert calls == ["target", "draft"] * 2
    # and another pair never reads this one's
    choose_kernels(target, draft, KernelRequest(), "pair-b", tmp_path)
    assert calls == ["target", "draft"] * 3
    # a fixed request measures nothing
    choose_kernels(target, draft, KernelRequest("default", "int8-weight"), "pair-c", tmp_path)
    assert len(calls) == 6 and draft.kernel == "int8-weight"


@pytest.mark.parametrize("text, error", [
    ("int8-dynamic", "the target takes only exact paths"),
    ("target=int8-weight,draft=default", "the target takes only exact paths"),
    ("fastest", "unknown kernel path"),
    ("target=onednn,target=default", "is not auto"),
    ("pilot=onednn", "is not auto"),
])
def test_bad_kernel_requests_are_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        KernelRequest.parse(text)


def test_kernel_requests_parse() -> None:
    assert KernelRequest.parse("auto") == KernelRequest()
    assert KernelRequest.parse("onednn") == KernelRequest("onednn", "onednn")
    assert KernelRequest.parse("draft=int8-dynamic") == KernelRequest("auto", "int8-dynamic")
    assert KernelRequest.parse("target=default, draft=int8-weight") == KernelRequest("default", "int8-weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dynamic_int8_rows_output_is_the_same_alone_and_beside_other_rows(dtype) -> None:
    """A row's product on int8-dynamic depends on that row alone, bit for bit: in a batch its rows are other
    requests' tokens, and a scale shared across them would make one request's draws depend on the others."""
    if not _available("int8-dynamic", dtype):
        pytest.skip("int8-dynamic is not in this torch build")
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(37, 50, generator=g).to(dtype), torch.randn(37, generator=g).to(dtype)
    prepared = KERNEL_PATHS["int8-dynamic"].prepare(weight, bias)
    # rows of very different magnitudes, signs and spreads, a zero row among them
    x = torch.randn(12, 50, generator=g) * torch.logspace(-3, 3, 12)[:, None]
    x[3] = x[3].abs()
    x[7] = 0.0
    x = x.to(dtype)
    together = prepared(x)
    for i in range(len(x)):
        assert torch.equal(prepared(x[i:i + 1])[0], together[i]), i
    for rows in ([0, 11], [5, 3, 9], [7, 1]):
        assert torch.equal(prepared(x[rows]), together[rows]), rows
    assert torch.equal(prepared(x.view(3, 4, 50)).view(12, -1), together)  # HF's (batch, M, K) input
    assert torch.equal(together[7], bias.float().to(dtype))  # a zero row gives the bias
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    gap = (together.float() - want).abs().amax(dim=1) / want.abs().amax(dim=1)
    assert float(gap.max()) < 0.05  # each row keeps its own precision, the smallest as the largest


@pytest.mark.parametrize("forge", ["quantized-target", "unmeasured-draft", "not-the-rules-choice", "times-dropped"])
def test_a_cached_choice_passes_the_command_lines_checks_or_is_measured_again(tmp_path, monkeypatch, forge) -> None:
    """What a kernel cache says is applied only where a request on the command line could have asked for it and the
    rule would have chosen it from the cached times: a cache naming a quantized target (nobody opted in), a path the
    times never measured, or a choice its times contradict is measured again, never applied."""
    target = CachedLM(arch_model("llama", 1, V, 32, 1, 8))
    draft = cached_lm(arch_model("llama", 2, V, 16, 1, 8))
    calls = []
    real = kernel_choice.measure_paths
    monkeypatch.setattr(kernel_choice, "measure_paths",
                        lambda model, role, paths, **kw: calls.append(role) or real(model, role, paths, repeats=1))
    first = choose_kernels(target, draft, KernelRequest(), "pair-a", tmp_path)
    path = cache_file(tmp_path, "kernels", "pair-a", first.machine)
    forged = KernelChoice.from_json(path.read_text())
    if forge == "quantized-target":
        forged.target = "int8-dynamic"
        forged.times["target"].block_ms["int8-dynamic"] = [0.001] * len(forged.times["target"].shapes)
        forged.times["target"].prefill_ms["int8-dynamic"] = 0.001
    elif forge == "unmeasured-draft":
        forged.draft = "int8-weight"
        forged.times["draft"].block_ms.pop("int8-weight", None)
        forged.times["draft"].prefill_ms.pop("int8-weight", None)
    elif forge == "not-the-rules-choice":
        times = forged.times["draft"]
        times.block_ms = {name: [1.0] * len(times.shapes) for name in times.block_ms}
        times.prefill_ms = {name: 1.0 for name in times.block_ms}
        forged.draft = list(times.block_ms)[-1]  # a tie goes to the default
    else:
        del forged.times["target"]
    path.write_text(forged.to_json())
    calls.clear()
    again = choose_kernels(target, draft, KernelRequest(), "pair-a", tmp_path)
    assert calls, "the forged cache was applied without measuring"
    assert KERNEL_PATHS[again.target].exact and KERNEL_PATHS[target.kernel].exact
    assert "opt-in" not in again.line()
    reread = KernelChoice.from_json(path.read_text())  # the cache holds a sound choice again
    assert all(kernel_choice.cached_refusal(reread, role, lm) is None
               for role, lm in (("target", target), ("draft", draft)))
