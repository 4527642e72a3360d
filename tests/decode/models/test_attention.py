"""decode.models.attention: the sdpa a CachedLM runs HF's forward with equals transformers' stock sdpa to float
rounding, with and without a mask, for one and several query rows, with grouped-query heads (and without); a masked
pass of several rows reaches torch's sdpa with the cache's own key/value heads (enable_gqa), which the stock path
does not (the spy's negative control). Tiny random models built from configs; nothing is downloaded."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen2Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from decode.models.attention import ATTENTION, gqa_sdpa_attention_forward
from decode.models.cached_lm import CachedLM
from decode.models.shared_cache import Block, SharedCache
from tests.decode.architectures import randomized

V = 64
TOL = 1e-5


def _model(kind: str, kv_heads: int):
    from transformers import AutoModelForCausalLM

    common = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
              "num_attention_heads": 6, "num_key_value_heads": kv_heads, "max_position_embeddings": 256,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    config = Qwen2Config(**common) if kind == "qwen2" else LlamaConfig(**common, head_dim=16)
    torch.manual_seed(0)
    return randomized(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval())


def _pair(kind: str, kv_heads: int = 2, dtype: torch.dtype | None = None) -> tuple[CachedLM, CachedLM]:
    """The same weights twice: ddte's attention (CachedLM's default) and transformers' stock sdpa."""
    model = _model(kind, kv_heads)
    ours, stock = CachedLM(copy.deepcopy(model), dtype=dtype), CachedLM(model, dtype=dtype)
    stock.model.set_attn_implementation("sdpa")
    assert ours.model.config._attn_implementation == ATTENTION
    assert stock.model.config._attn_implementation == "sdpa"
    return ours, stock


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("mask", ["none", "additive", "bool"])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_function_equals_stock_sdpa(rows: int, mask: str, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows + 7 * heads)
    cached, d = 9, 16
    q = torch.randn(1, heads, rows, d, generator=g).to(dtype)
    k, v = (torch.randn(1, kv_heads, cached + rows, d, generator=g).to(dtype) for _ in range(2))
    allowed = torch.rand(rows, cached + rows, generator=g) < 0.6
    allowed[:, 0] = True  # every row sees a slot
    attention_mask = {"none": None, "bool": allowed[None, None],
                      "additive": torch.zeros(rows, cached + rows, dtype=dtype).masked_fill(
                          ~allowed, torch.finfo(dtype).min)[None, None]}[mask]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    out, weights = gqa_sdpa_attention_forward(module, q, k, v, attention_mask, scaling=d ** -0.5)
    ref, _ = sdpa_attention_forward(module, q, k, v, attention_mask, scaling=d ** -0.5)
    assert weights is None and out.shape == ref.shape == (1, rows, heads, d) and out.is_contiguous()
    assert _diff(out.float(), ref.float()) < (TOL if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_cached_passes_equal_stock_sdpa(kind: str) -> None:
    """A prefill (no mask), a tree block (several masked rows), one masked row, a committed linear run after the
    cache (transformers' own causal mask), each against the same passes on stock sdpa."""
    ours, stock = _pair(kind)
    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(20)]
    steps = [("prefill", (prompt,)), ("extend_tree", ([5, 6, 7, 8, 9], [19, 19, -1, -2, -1])), ("commit", ([20, 22],)),
             ("extend_tree", ([11], [21])), ("commit", ([],)), ("extend", ([3, 4, 5, 6], True)),
             ("extend", ([7], True))]
    for name, args in steps:
        a, b = getattr(ours, name)(*args), getattr(stock, name)(*args)
        if a is not None:
            assert a.shape == b.shape and _diff(a, b) < TOL, name


@pytest.mark.parametrize("kv_heads", [2, 3])
def test_shared_cache_block_diagonal_equals_stock_sdpa(kv_heads: int) -> None:
    """Three sequences in one cache, trees of every one in one block (the block-diagonal mask of a batched step)."""
    rng = random.Random(kv_heads)
    caches = [SharedCache(lm) for lm in _pair("qwen2", kv_heads)]
    runs = {s: [rng.randrange(V) for _ in range(n)] for s, n in zip((0, 1, 2), (7, 12, 3), strict=True)}
    blocks = [Block(0, [1, 2, 3], [None, -1, -1]), Block(1, [4], [None]), Block(2, [5, 6, 7, 8], [None, -1, -2, -2])]
    outs = []
    for cache in caches:
        for _ in range(3):
            cache.add()
        cache.settle(runs)
        outs.append(cache.run(blocks))
    for a, b in zip(*outs, strict=True):
        assert _diff(a.logits, b.logits) < TOL


def test_masked_rows_reach_sdpa_with_unrepeated_kv_heads(monkeypatch) -> None:
    """The path is the one measured: a tree block's calls carry the cache's 2 key/value heads and enable_gqa; on
    stock sdpa the keys arrive repeated to the 6 query heads (negative control); one masked row is left to
    transformers (which folds the heads itself)."""
    calls: list[tuple[int, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((key.shape[1], bool(kwargs.get("enable_gqa", False))))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ours, stock = _pair("qwen2")
    for lm, expected in ((ours, (2, True)), (stock, (6, False))):
        lm.prefill(list(range(10)))
        calls.clear()
        lm.extend_tree([1, 2, 3], [9, -1, 9])
        assert calls == [expected] * 2
    calls.clear()
    ours.extend_tree([4], [10])
    assert calls and all(not gqa for _, gqa in calls)


def test_bf16_target_passes_equal_stock_sdpa() -> None:
    ours, stock = _pair("qwen2", dtype=torch.bfloat16)
    for lm in (ours, stock):
        lm.prefill(list(range(1, 30)))
    a, b = ours.extend_tree([5, 6, 7, 8], [28, -1, -1, -2]), stock.extend_tree([5, 6, 7, 8], [28, -1, -1, -2])
    assert _diff(a, b) < 5e-2
