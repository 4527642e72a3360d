"""Tests for decode.models.cached_lm.CachedLM and decode.models.fast_llama.FastCachedLM (the draft's fast forward):
tree extension, breadth-first drafting, commit/crop rollback and hidden states, each against a plain HF recompute;
loading and vocabulary checks. Tiny random models built from configs; nothing is downloaded."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedModel, Qwen2Config

from decode.models.attention import ATTENTION
from decode.models.cached_lm import CachedLM, run_nodes
from decode.models.fast_llama import FastCachedLM, cached_lm
from decode.models.loading import check_same_vocab, load_causal_lm
from decode.models.slots import block_parents

V = 64
TOL = 1e-5


def _llama(seed: int = 0, attn: str = "sdpa") -> PreTrainedModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def _qwen2(seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _llama_gqa(seed: int = 0) -> PreTrainedModel:
    """Grouped-query attention and a head_dim that is not hidden / heads: what the fast forward must get right."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=500.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


MODELS = {"llama": _llama, "qwen2": _qwen2, "llama-gqa": _llama_gqa}
# (model, wrapper): HF's forward for every model; the fast forward for every one too (Qwen2: its QKV biases)
CASES = [(m, "hf") for m in sorted(MODELS)] + [("llama", "fast"), ("llama-gqa", "fast"), ("qwen2", "fast")]


@pytest.fixture(params=CASES, ids=[f"{m}-{w}" for m, w in CASES])
def lm(request) -> CachedLM:
    model, wrapper = request.param
    return (FastCachedLM if wrapper == "fast" else CachedLM)(MODELS[model]())


def _ref(lm: CachedLM, seq: list[int]) -> torch.Tensor:
    """Logits (len(seq), V) of a plain, cache-free forward."""
    with torch.inference_mode():
        return lm.model(torch.tensor([seq])).logits[0].float()


def _rand(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check_cache(lm: CachedLM) -> None:
    if isinstance(lm, FastCachedLM):  # its own tensors: capacity may exceed the slots, never fall short
        assert lm._keys.shape[2] >= lm.length and lm._values.shape[2] >= lm.length
        return
    assert lm._cache.get_seq_length() == lm.length
    for layer in lm._cache.layers:
        assert layer.keys.shape[-2] == lm.length and layer.values.shape[-2] == lm.length


# 1 ------------------------------------------------------------------------------------------------------
def test_extend_matches_prefill(lm: CachedLM) -> None:
    rng = random.Random(1)
    seq = _rand(30, rng)
    full = lm.prefill(seq)
    assert full.shape == (30, V) and full.dtype == torch.float32
    assert _diff(full, _ref(lm, seq)) < TOL
    lm.prefill(seq[:12])
    parts = [lm.extend(seq[12:13], commit=True), lm.extend(seq[13:20], commit=True), lm.extend(seq[20:23])]
    parts += [lm.extend(seq[23:24]), lm.extend(seq[24:30])]  # speculative, linear (no mask path)
    assert _diff(torch.cat(parts), full[12:]) < TOL
    assert lm.length == 30 and lm.committed == 20 and lm.num_speculative == 10
    _check_cache(lm)


# 2 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extend_tree_matches_paths(lm: CachedLM, seed: int) -> None:
    rng = random.Random(seed)
    prefix = _rand(20, rng)
    n = 9
    local = [-1] + [rng.randrange(-1, i) for i in range(1, n)]  # -1 = child of the last prefix token
    tokens = _rand(n, rng)
    lm.prefill(prefix)
    logits = lm.extend_tree(tokens, block_parents(range(len(local)), local, {-1: lm.length - 1}))
    assert logits.shape == (n, V)
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = local[j]
        assert _diff(logits[i], _ref(lm, prefix + path[::-1])[-1]) < TOL, (i, local)
        depth = len(path) - 1
        assert lm.slots.position_of(20 + i) == 20 + depth
    assert lm.length == 20 + n and lm.committed == 20
    _check_cache(lm)


def test_extend_tree_fixed_shape_and_root_from_speculative_slot(lm: CachedLM) -> None:
    rng = random.Random(5)
    prefix, tokens = _rand(20, rng), _rand(9, rng)
    local = [-1, 0, 1, 2, 3, 2, 5, 2, 7]
    lm.prefill(prefix)
    lm.extend(tokens[:1])  # a speculative slot 20 (e.g. the bonus token) ...
    # ... and the rest of the tree below it: parents mix an absolute slot (20) and block tokens
    logits = lm.extend_tree(tokens[1:], [20 if p == 0 else -p for p in local[1:]])
    for i in range(1, 9):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = local[j]
        assert _diff(logits[i - 1], _ref(lm, prefix + path[::-1])[-1]) < TOL


# 3 ------------------------------------------------------------------------------------------------------
def test_breadth_first_branches_equal_branches_alone(lm: CachedLM) -> None:
    rng = random.Random(3)
    prefix, trunk = _rand(20, rng), _rand(2, rng)
    k, depth = 3, 3
    branches = [_rand(depth, rng) for _ in range(k)]
    lm.prefill(prefix)
    lm.extend(trunk)  # speculative trunk, slots 20, 21
    tip = lm.length - 1
    level_slots = [tip] * k
    got = [[] for _ in range(k)]
    for d in range(depth):
        base = lm.length
        # the other branches' slots of earlier levels are cached but must stay invisible
        out = lm.extend_tree([b[d] for b in branches], level_slots)
        for b in range(k):
            got[b].append(out[b])
        level_slots = [base + b for b in range(k)]
    alone = CachedLM(lm.model)
    for b in range(k):
        alone.prefill(prefix)
        ref = alone.extend(trunk + branches[b])[len(trunk) :]
        assert _diff(torch.stack(got[b]), ref) < TOL
        assert _diff(ref, _ref(lm, prefix + trunk + branches[b])[-depth:]) < TOL
    assert lm.length == 20 + 2 + k * depth
    _check_cache(lm)


def test_run_nodes_runs_a_tree_in_blocks_and_records_their_slots(lm: CachedLM) -> None:
    """A tree run in two blocks by run_nodes (the second block's parents partly in the first, partly its own) gives
    each node the logits of its path, and slots where extend_tree put it."""
    rng = random.Random(4)
    prefix = _rand(20, rng)
    parents = [-1, 0, 1, 0, 3, 2, 5, 4]  # node 0 = the root, the last prefix token
    tokens = [prefix[-1]] + _rand(7, rng)
    lm.prefill(prefix)
    slots = {0: lm.length - 1}
    first = run_nodes(lm, [1, 2, 3], tokens, parents, slots)
    second = run_nodes(lm, [4, 5, 6, 7], tokens, parents, slots)
    assert slots == {0: 19, 1: 20, 2: 21, 3: 22, 4: 23, 5: 24, 6: 25, 7: 26}
    assert block_parents([4, 5, 6, 7], parents, slots) == [22, 21, -2, -1]
    for v, row in zip([1, 2, 3, 4, 5, 6, 7], torch.cat([first, second]), strict=True):
        path, u = [], v
        while u > 0:
            path.append(tokens[u])
            u = parents[u]
        assert _diff(row, _ref(lm, prefix + path[::-1])[-1]) < TOL, v


def test_sibling_of_committed_slot_and_interleaved_blocks(lm: CachedLM) -> None:
    rng = random.Random(4)
    prefix, tok, toks = _rand(20, rng), rng.randrange(V), _rand(3, rng)
    lm.prefill(prefix)
    lm.extend_tree([tok, tok], [19, -1])  # slots 20, 21 (a chain)
    # parents: slot 15 (branch off an earlier committed slot), slot 20, token 0 of this block (slot 22)
    out = lm.extend_tree(toks, [15, 20, -1])
    assert _diff(out[0], _ref(lm, prefix[:16] + toks[:1])[-1]) < TOL
    assert _diff(out[1], _ref(lm, prefix + [tok, toks[1]])[-1]) < TOL
    assert _diff(out[2], _ref(lm, prefix[:16] + [toks[0], toks[2]])[-1]) < TOL
    assert [lm.slots.position_of(s) for s in range(20, 25)] == [20, 21, 16, 21, 17]
    assert [lm.slots.parent_of(s) for s in range(19, 25)] == [18, 19, 20, 15, 20, 22]
    with pytest.raises(ValueError):
        lm.commit([22])  # hangs off slot 15, not the committed tip
    lm.commit([20, 23])
    assert _diff(lm.extend([8])[0], _ref(lm, prefix + [tok, toks[1], 8])[-1]) < TOL


# 4 ------------------------------------------------------------------------------------------------------
def test_commit_then_bonus_matches_recompute(lm: CachedLM) -> None:
    rng = random.Random(6)
    prefix, tokens = _rand(20, rng), _rand(9, rng)
    local = [-1, 0, 1, 2, 3, 2, 5, 2, 7]
    for accepted in ([0, 1, 2, 5, 6], [0, 1, 2, 3], [0], [], [0, 1, 2, 7, 8]):
        lm.prefill(prefix)
        lm.extend_tree(tokens, block_parents(range(len(local)), local, {-1: 19}))
        lm.commit([20 + i for i in accepted])
        assert lm.length == lm.committed == 20 + len(accepted)
        _check_cache(lm)
        seq = prefix + [tokens[i] for i in accepted]
        bonus = rng.randrange(V)
        nxt = lm.extend([bonus], commit=True)
        assert _diff(nxt[0], _ref(lm, seq + [bonus])[-1]) < TOL, accepted
        # a second round of tree + commit on top of the first one
        more = _rand(3, rng)
        out = lm.extend_tree(more, [lm.length - 1, -1, lm.length - 1])
        assert _diff(out[1], _ref(lm, seq + [bonus] + more[:2])[-1]) < TOL
        lm.commit([lm.length - 1])
        assert _diff(lm.extend([5])[0], _ref(lm, seq + [bonus, more[2], 5])[-1]) < TOL


def test_commit_after_breadth_first_branches(lm: CachedLM) -> None:
    rng = random.Random(7)
    prefix, trunk = _rand(20, rng), _rand(2, rng)
    branches = [_rand(3, rng) for _ in range(3)]
    lm.prefill(prefix)
    lm.extend(trunk)
    slots = [[21] * 3]
    for d in range(3):
        base = lm.length
        lm.extend_tree([b[d] for b in branches], slots[-1])
        slots.append([base + b for b in range(3)])
    # accept the trunk and two tokens of branch 1: slots 20, 21, then branch 1's first two levels
    lm.commit([20, 21, slots[1][1], slots[2][1]])
    seq = prefix + trunk + branches[1][:2]
    assert _diff(lm.extend([9])[0], _ref(lm, seq + [9])[-1]) < TOL


def test_crop_matches_recompute(lm: CachedLM) -> None:
    rng = random.Random(8)
    seq = _rand(30, rng)
    lm.prefill(seq[:20])
    lm.extend(seq[20:30])
    lm.crop(25)  # keeps 5 speculative slots
    assert lm.length == 25 and lm.committed == 20
    assert _diff(lm.extend([3])[0], _ref(lm, seq[:25] + [3])[-1]) < TOL
    lm.crop(15)  # into the committed prefix
    assert lm.length == lm.committed == 15
    _check_cache(lm)
    assert _diff(lm.extend([4], commit=True)[0], _ref(lm, seq[:15] + [4])[-1]) < TOL
    # crop inside a tree keeps the lower slots, which may still be committed
    lm.extend_tree([1, 2, 3], [15, 15, -2])
    lm.crop(18)
    lm.commit([17])
    assert _diff(lm.extend([7])[0], _ref(lm, seq[:15] + [4, 2, 7])[-1]) < TOL
    lm.crop(0)
    assert lm.length == 0
    lm.prefill(seq[:3])
    assert _diff(lm.extend(seq[3:6])[-1], _ref(lm, seq[:6])[-1]) < TOL


def test_invalid_commit_raises(lm: CachedLM) -> None:
    rng = random.Random(9)
    lm.prefill(_rand(20, rng))
    lm.extend_tree(_rand(5, rng), block_parents(range(5), [-1, 0, 1, -1, 3], {-1: 19}))  # slots 20-22 and 23-24
    for bad in ([19], [20, 22], [21], [20, 21, 24], [25], [23, 21], [20, 20]):
        with pytest.raises(ValueError):
            lm.commit(bad)
        assert lm.length == 25 and lm.committed == 20  # nothing changed
    lm.commit([23, 24])
    assert lm.committed == 22
    for ids, parents in (([1, 2], [22, -1]), ([1], [99]), ([1, 2], [21, -2]), ([1], [-1]), ([1, 2], [21])):
        with pytest.raises(ValueError):
            lm.extend_tree(ids, parents)  # slot 22 not cached / local parent not earlier / length mismatch
        assert lm.length == 22


# 5 ------------------------------------------------------------------------------------------------------
def test_hidden_states(lm: CachedLM) -> None:
    rng = random.Random(10)
    seq = _rand(24, rng)
    hidden_size = lm.model.config.hidden_size
    logits, hidden = lm.prefill(seq[:20], output_hidden=True)
    with torch.inference_mode():
        ref = lm.model(torch.tensor([seq]), output_hidden_states=True)
    assert hidden.shape == (20, hidden_size) and hidden.dtype == torch.float32
    assert _diff(hidden, ref.hidden_states[-1][0, :20]) < TOL
    assert _diff(logits, ref.logits[0, :20]) < TOL
    logits, hidden = lm.extend_tree(seq[20:24], [19, -1, -2, -3], output_hidden=True)
    assert hidden.shape == (4, hidden_size)
    assert _diff(hidden, ref.hidden_states[-1][0, 20:]) < TOL
    tree_logits, tree_hidden = lm.extend_tree(seq[20:22], [19, 19], output_hidden=True)  # non-linear path
    assert _diff(tree_hidden[0], ref.hidden_states[-1][0, 20]) < TOL
    _, h = lm.extend([1], output_hidden=True)
    assert h.shape == (1, hidden_size)


# misc ---------------------------------------------------------------------------------------------------
def test_eager_model_switched_to_sdpa_and_bf16_runs() -> None:
    model = _llama(attn="eager")
    lm = CachedLM(model)
    assert model.config._attn_implementation == ATTENTION  # sdpa as decode.models.attention runs it
    assert lm.vocab_size == V
    lm16 = CachedLM(_llama(), dtype=torch.bfloat16)
    lm16.prefill([1, 2, 3, 4])
    out = lm16.extend_tree([5, 6, 7], [3, 3, -1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_empty_cache_rules() -> None:
    lm = CachedLM(_llama())
    with pytest.raises(ValueError):
        lm.extend([1, 2])
    with pytest.raises(ValueError):
        lm.extend_tree([1], [0])
    out = lm.extend([1, 2, 3], commit=True)
    assert _diff(out, _ref(lm, [1, 2, 3])) < TOL
    with pytest.raises(ValueError):
        lm.prefill([])


# 6 ------------------------------------------------------------------------------------------------------
def test_load_causal_lm_errors_and_round_trip(tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        load_causal_lm(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_causal_lm(str(empty))
    model = _qwen2()
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        load_causal_lm(tmp_path / "noweights")
    loaded = load_causal_lm(str(tmp_path / "m"))
    assert loaded.config._attn_implementation == "sdpa"
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    a, b = CachedLM(model), CachedLM(loaded)
    assert _diff(a.prefill(seq), b.prefill(seq)) < TOL


# 7 ------------------------------------------------------------------------------------------------------
def test_check_same_vocab() -> None:
    t, d = LlamaConfig(vocab_size=64), Qwen2Config(vocab_size=64)
    assert check_same_vocab(t, d) == 64
    padded = LlamaConfig(vocab_size=80)
    with pytest.raises(ValueError, match="vocab"):
        check_same_vocab(t, padded)
    assert check_same_vocab(padded, d, allow_padded_tail=True) == 64
    assert check_same_vocab(padded, d, allow_padded_tail=True, tokenizer_sizes=(60, 60)) == 64
    with pytest.raises(ValueError, match="tokenizer"):
        check_same_vocab(padded, d, allow_padded_tail=True, tokenizer_sizes=(60, 61))
    with pytest.raises(ValueError, match="tokenizer"):
        check_same_vocab(padded, d, allow_padded_tail=True, tokenizer_sizes=(70, 70))


def test_fast_forward_grows_past_its_first_capacity_and_falls_back_where_unsupported() -> None:
    model = _llama(3)
    fast, hf = FastCachedLM(model), CachedLM(model)
    rng = random.Random(4)
    seq = _rand(200, rng)
    fast.prefill(seq[:150])
    hf.prefill(seq[:150])
    block = _rand(120, rng)  # 270 slots: past the 256 the fast store starts with
    parents = [149] + [-(j + 1) if j % 3 else 149 for j in range(119)]
    assert _diff(fast.extend_tree(block, parents), hf.extend_tree(block, parents)) < TOL
    assert fast._keys.shape[2] >= 270
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                                       bos_token_id=1, eos_token_id=2))
    fallback = cached_lm(gpt2)
    assert type(fallback) is CachedLM and fallback.forward_name == "hf"
    assert "model_type 'gpt2'" in fallback.fast_fallback
    assert isinstance(cached_lm(_qwen2()), FastCachedLM) and cached_lm(_qwen2()).forward_name == "fast"
    assert isinstance(cached_lm(model), FastCachedLM) and not isinstance(cached_lm(model, fast=False), FastCachedLM)
    assert cached_lm(model, fast=False).fast_fallback is None
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        FastCachedLM(gpt2)
