"""The hf-assisted baseline's draft: the dtype that runs fastest stock here, chosen once, recorded, on its own copy."""

from __future__ import annotations

import pytest
import torch

import bench.stock_draft as stock_draft
import ddte_core.machine
from bench.stock_draft import FASTER, dtype_name, fastest_stock_draft, float32_copy, model_dtype, stock_pass_ms
from decode.pair import DEFAULT_DRAFT, DEFAULT_TARGET, DEFAULT_TOKENIZER

CPU = torch.device("cpu")


@pytest.fixture
def bf16_pair():
    """The shipped pair loaded in bf16 (the Qwen pair's draft dtype)."""
    from decode.pair import load_pair

    return load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, DEFAULT_TOKENIZER, dtype="bfloat16")


def fake_timings(ms: dict[torch.dtype, float], seen: list[torch.dtype]):
    """A stand-in for :func:`stock_pass_ms`: ``ms`` by the model's dtype; the dtypes it was asked about in ``seen``."""
    def measure(model):
        seen.append(model_dtype(model))
        return ms[model_dtype(model)]
    return measure


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_without_native_bf16_a_bf16_draft_is_timed_against_float32_and_the_faster_one_recorded(bf16_pair,
                                                                                                 monkeypatch):
    """The bench's rows: hf-assisted on the float32 copy (faster here), hf-assisted-own and the ddte method on the
    pair's bf16 draft, which the baseline left as it was."""
    from bench.decoding import BenchSettings, make_runners, open_bench, run_bench
    from bench.method import Method

    seen: list[torch.dtype] = []
    monkeypatch.setattr(ddte_core.machine, "native_bf16_cpu", lambda: False)
    monkeypatch.setattr(stock_draft, "stock_pass_ms", fake_timings({torch.bfloat16: 10.0, torch.float32: 4.0}, seen))
    draft = bf16_pair.draft.model
    before = snapshot(draft)
    methods = [Method.parse(m) for m in ("ar", "hf-assisted", "hf-assisted-own", "traversal@2,1,2")]
    session = open_bench(bf16_pair, methods, kernels="default")
    rows = {r["method"]: r for r in run_bench(methods, session, [[5, 9, 3]], BenchSettings(max_new_tokens=3),
                                              [1.0])}
    assert seen == [torch.bfloat16, torch.float32]  # the draft's own dtype, then float32: once per bench
    assert rows["hf-assisted"]["draft_dtype"] == "float32" and rows["hf-assisted-own"]["draft_dtype"] == "bfloat16"
    choice = rows["hf-assisted"]["draft_dtype_choice"]
    assert choice == {"own_dtype": "bfloat16", "stock_pass_ms": {"bfloat16": 10.0, "float32": 4.0},
                      "float32_when_faster_by": FASTER, "native_bf16": False}
    assert "draft_dtype" not in rows["ar"] and "draft_dtype" not in rows["traversal@2,1,2"]
    assert all(row["new_tokens"] == 3 for row in rows.values())
    # the pair's draft, which every other method runs, is the same module with the same bf16 weights
    assert bf16_pair.draft.model is draft and model_dtype(draft) == torch.bfloat16
    after = snapshot(draft)
    assert all(after[name].dtype == torch.bfloat16 and torch.equal(after[name], t) for name, t in before.items())
    _, baseline, own, ddte = make_runners(methods, session)
    assert model_dtype(baseline.assistant) == torch.float32 and baseline.assistant is not draft
    assert own.assistant is draft and ddte.decoder.draft is bf16_pair.draft
    assert bf16_pair.draft.dtype == torch.bfloat16


@pytest.mark.parametrize(("own_ms", "fp32_ms", "chosen"), [
    (10.0, 4.0, torch.float32), (10.0, 10.0 / FASTER + 0.01, torch.bfloat16), (10.0, 12.0, torch.bfloat16)])
def test_float32_only_where_it_is_measurably_faster(bf16_pair, own_ms, fp32_ms, chosen):
    """Within 5 % (or slower) the draft keeps its own dtype, and the copy is not kept."""
    seen: list[torch.dtype] = []
    draft = bf16_pair.draft.model
    baseline = fastest_stock_draft(draft, CPU, fake_timings({torch.bfloat16: own_ms, torch.float32: fp32_ms}, seen))
    assert seen == [torch.bfloat16, torch.float32] and baseline.dtype == chosen and baseline.own == torch.bfloat16
    assert (baseline.model is draft) == (chosen == torch.bfloat16)
    assert baseline.record()["draft_dtype"] == dtype_name(chosen) and dtype_name(chosen) in baseline.line()


def test_a_float32_draft_or_one_on_a_gpu_is_kept_untimed():
    from decode.pair import load_pair

    pair = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, DEFAULT_TOKENIZER)
    seen: list[torch.dtype] = []
    never = fake_timings({}, seen)
    assert fastest_stock_draft(pair.draft.model, CPU, never).model is pair.draft.model
    kept = fastest_stock_draft(pair.draft.model.to(torch.bfloat16), torch.device("cuda"), never)
    assert seen == [] and kept.dtype == torch.bfloat16 and kept.ms == {} and "not timed" in kept.line()


def test_the_float32_copy_is_the_stock_model_and_shares_nothing(bf16_pair):
    """Plain nn.Linear layers (a kernel path's layer included), every tensor its own, tied weights still tied; its
    logits are the bf16 model's run in float32."""
    from decode.models.kernels import KERNEL_PATHS, KernelLinear, stock_kernels, use_kernel

    draft = bf16_pair.draft.model
    path = next(name for name, p in KERNEL_PATHS.items() if name != "default"
                and p.unavailable(torch.bfloat16, CPU) is None)
    use_kernel(draft, path)
    copy = float32_copy(draft)
    assert not any(isinstance(m, KernelLinear) for m in copy.modules())
    assert any(isinstance(m, KernelLinear) for m in draft.modules())  # the pair's draft stays on its path
    theirs = {p.data_ptr() for p in draft.parameters()}
    assert all(p.dtype == torch.float32 and p.data_ptr() not in theirs for p in copy.parameters())
    assert copy.get_output_embeddings().weight is copy.get_input_embeddings().weight
    ids = torch.tensor([[5, 9, 3, 7]])
    with torch.inference_mode(), stock_kernels(draft):
        ours, theirs = copy(input_ids=ids).logits, draft(input_ids=ids).logits
    assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16
    assert torch.allclose(ours, theirs.float(), atol=0.05, rtol=0.02)  # the same model, bf16 rounding aside


def test_the_stock_passes_are_medians_of_a_one_token_and_a_short_pass(bf16_pair):
    """A fake clock one millisecond a call: every timed pass reads 1 ms, so the two medians sum to 2."""
    ticks = iter(range(10**6))
    calls = []
    draft = bf16_pair.draft.model
    handle = draft.register_forward_hook(lambda _m, args, kwargs, _out: calls.append(kwargs["input_ids"].shape[1]),
                                         with_kwargs=True)
    try:
        assert stock_pass_ms(draft, timer=lambda: next(ticks) / 1000) == pytest.approx(2.0)
    finally:
        handle.remove()
    assert calls == [1] * (stock_draft.REPEATS + 1) + [stock_draft.SHORT] * (stock_draft.REPEATS + 1)


def test_the_assisted_kinds_parse_and_say_which_run_stock():
    from bench.method import Method

    for text, stock in [("hf-assisted", True), ("hf-assisted-own", True), ("hf-assisted-kernels", False)]:
        method = Method.parse(text)
        assert method.is_hf and method.key == text and method.on_stock_kernels == stock
