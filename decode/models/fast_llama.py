"""A cheaper forward for small Llama-family drafts: the same math as HF's, a fraction of the per-call overhead.

Covers the decoder layout Llama, Mistral, Qwen2 and Qwen3 share (RMSNorm, rotary attention with grouped-query heads,
a SiLU-gated MLP): projection biases where the model has them (Qwen2's QKV, Llama's ``attention_bias``/``mlp_bias``),
Qwen3's per-head query/key norms, and sliding windows, full or per layer (Mistral, Qwen2 ``use_sliding_window``),
through :class:`~decode.models.cached_lm.CachedLM`'s masks. Any other draft (Gemma, Phi, GPT-2, OLMo2, Granite,
SmolLM3's NoPE layers, a rope scaling, ...) runs HF's forward: :func:`cached_lm` falls back to
:class:`~decode.models.cached_lm.CachedLM` and records why in ``fast_fallback``.

A 0.8 M-parameter draft computes almost nothing per token, so HF's forward spends most of each call on framework
work (cache objects, mask construction, hooks, output dataclasses). :class:`FastCachedLM` reads the HF model's weights
(QKV and gate/up fused into one matrix each, rotary tables precomputed) and runs a handful of torch ops per layer
on key/value tensors it owns. The slot layout, tree attention and rollback are
:class:`~decode.models.cached_lm.CachedLM`'s (shared :mod:`decode.models.slots` bookkeeping): only the key/value store
and the forward differ. Logits equal the HF forward's to float rounding (tests: ≤ 1e-5), including after tree blocks,
commits and crops.

The target keeps HF's forward: it is where the compute is, and its baseline (HF ``generate``) must see the same
model code as ddte's loop.

**Kernels.** Each layer's matrices run through a :class:`~decode.models.kernels.PreparedLinear` of the path
``kernel`` names (:mod:`decode.models.kernels`; ``default`` is ``F.linear``), the output head too where it is a plain
linear layer (a draft vocabulary's head keeps its own product). A quantized path gives another q, not an
approximation the verifier has to correct for: the drafting loop samples from that q and hands the same q to the
verifier, so decoding stays exactly lossless (tests/decode/exact/test_int8_draft.py, with a negative control).
Which path pays is the CPU's business: :mod:`decode.models.kernel_choice` measures it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from decode.models.attention import SequenceAttention, per_sequence, sequence_attention
from decode.models.cached_lm import CachedLM, ForwardOutput
from decode.models.kernels import DEFAULT, kernel_path
from decode.models.masks import (
    SequenceColumns,
    additive_mask,
    attention_windows,
    block_patterns,
    causal_pattern,
    window_of,
)
from decode.models.release import drop_weight, own_mapped, shared_weights
from decode.models.rows import select_rows

_INITIAL_SLOTS = 256
# model types whose decoder layer the fast forward reproduces (see the module docstring)
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_MATRICES = ("wqkv", "wo", "wgu", "wd")  # a layer's matrices, each with its bias under "b" + name[1:]


def fast_path_unsupported(model) -> str | None:
    """Why :class:`FastCachedLM` cannot run ``model`` exactly (None when it can)."""
    config = model.config
    if getattr(config, "model_type", None) not in FAST_MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {', '.join(FAST_MODEL_TYPES)}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r} is not the default"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    try:
        attention_windows(config)
    except ValueError as err:
        return str(err)
    return None


class FastCachedLM(CachedLM):
    """:class:`CachedLM` with a plain-torch Llama forward and its own key/value tensors (see the module docstring).

    ``model`` keeps the HF module (for anything that needs it, e.g. HF assisted generation as a baseline).
    """

    forward_name = "fast"
    released: bool  # its stock weights were given back (use_kernel's release): it stays on its path
    head: torch.nn.Module  # the HF module's output head (a ReleasedLinear once given back)
    _head: Callable[[torch.Tensor], torch.Tensor]  # what the forward runs: the head's kernel, or the head
    _head_source: tuple[torch.nn.Module, str] | None  # (parent, attribute) of the head in the HF module
    layers: list[dict[str, Any]]  # per layer: norms, fused biases, and each matrix's kernel under "k" + name
    _sources: list[dict[str, list[tuple[torch.nn.Module, str]]]]  # per layer: each matrix's HF linear layers

    def __init__(self, model, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 kernel: str = DEFAULT) -> None:
        reason = fast_path_unsupported(model)
        if reason is not None:
            raise ValueError(f"the fast forward does not support this model: {reason}")
        super().__init__(model, device, dtype)
        self.per_sequence = set(self.layer_windows) == {None}  # its own attention, per sequence where no window cuts
        self._load_weights()
        self.use_kernel(kernel)

    def use_kernel(self, name: str, release: bool = False) -> int:
        """Run every layer matrix (and a plain output head) through kernel path ``name``; the bytes it copied. A fused
        matrix (QKV, gate/up) is built from the HF module's weights as its kernel is prepared and outlives that only
        where the path reads it (``default``: ``F.linear`` on it). ``release`` (a path that owns its copy): each HF
        layer the copy came from is given back at once and the rest of the HF module owned (decode/models/release.py):
        the draft then runs on ``name`` for good, and the HF module no longer runs.

        Raises:
            ValueError: an unknown path, one that cannot run this model's weights here, or weights given back.
        """
        path = kernel_path(name)
        reason = path.unavailable(self.dtype, self.device)
        if reason is not None:
            raise ValueError(reason)
        if self.released:
            raise ValueError("this draft's stock weights were given back: it stays on the kernel path it runs")
        release = release and path.owns_copy
        keep = shared_weights(self.model) if release else set()
        nbytes = 0
        self._head = self.head
        if isinstance(self.head, torch.nn.Linear):  # the largest matrix first (decode/models/kernels.py use_kernel)
            self._head = path.prepare(self.head.weight, self.head.bias)
            nbytes += self._head.nbytes
            if release and self._head_source is not None:
                drop_weight(*self._head_source, keep)
                self.head = getattr(*self._head_source)
        for w, sources in zip(self.layers, self._sources, strict=True):
            for matrix in _MATRICES:
                w["k" + matrix] = path.prepare(_fused_weight(sources[matrix]), w["b" + matrix[1:]])
                nbytes += w["k" + matrix].nbytes
                for parent, attribute in sources[matrix] if release else ():
                    drop_weight(parent, attribute, keep)
        if release:
            own_mapped(self.model)
            self._bind()  # the views of the norms, now of their copies (the embedding stays in the file)
            self.released = True
        self.kernel = name
        return nbytes

    # --- weights --------------------------------------------------------------------------------------
    def _load_weights(self) -> None:
        """Which HF layers each matrix comes from (``self._sources``), the fused biases, and the views of the
        embedding, the norms and the head (:meth:`_bind`); the matrices themselves are read by :meth:`use_kernel`."""
        cfg, inner = self.config, self.model.model
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = self._head_dim_of_config()
        self.eps = cfg.rms_norm_eps
        self.released = False
        self.layers, self._sources = [], []
        with torch.no_grad():
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                self._sources.append({"wqkv": [(att, "q_proj"), (att, "k_proj"), (att, "v_proj")],
                                      "wo": [(att, "o_proj")], "wgu": [(mlp, "gate_proj"), (mlp, "up_proj")],
                                      "wd": [(mlp, "down_proj")]})
                self.layers.append({
                    "bqkv": _fused_bias(att.q_proj, att.k_proj, att.v_proj),  # Qwen2: QKV biases; Llama: none
                    "bo": _fused_bias(att.o_proj),
                    "bgu": _fused_bias(mlp.gate_proj, mlp.up_proj),
                    "bd": _fused_bias(mlp.down_proj),
                })
            self.head = self.model.get_output_embeddings()  # nn.Linear, or a draft vocabulary's SubsetHead
            self._head_source = next(((self.model, n) for n, m in self.model.named_children() if m is self.head), None)
            self._bind()
            theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4))
            inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
            positions = torch.arange(2 * self.context_limit + 1, dtype=torch.float32)  # tree depths stay below
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)  # HF's layout: rotate_half pairs i with i + head_dim / 2
            self.cos = emb.cos().to(self.device, self.dtype)
            self.sin = emb.sin().to(self.device, self.dtype)
        self._q_width, self._kv_width = self.n_heads * self.head_dim, self.n_kv * self.head_dim

    def _bind(self) -> None:
        """Views of the HF module's embedding ``(V, H)``, final norm ``(H,)`` and each layer's norms (``ln1``, ``ln2``
        ``(H,)``; Qwen3's per-head ``qn``, ``kn`` ``(head_dim,)``, which RMS-normalize each head's query and key
        before the rotation): read again once :func:`~decode.models.release.own_mapped` copied the norms."""
        inner = self.model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        for w, layer in zip(self.layers, inner.layers, strict=True):
            att = layer.self_attn
            w["ln1"] = layer.input_layernorm.weight.detach()
            w["ln2"] = layer.post_attention_layernorm.weight.detach()
            w["qn"] = att.q_norm.weight.detach() if hasattr(att, "q_norm") else None
            w["kn"] = att.k_norm.weight.detach() if hasattr(att, "k_norm") else None

    # --- the key/value store --------------------------------------------------------------------------
    def _new_cache(self) -> None:
        layers = len(self.model.model.layers)
        shape = (layers, self.config.num_key_value_heads, _INITIAL_SLOTS, self._head_dim_of_config())
        self._keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._values = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _head_dim_of_config(self) -> int:
        """The config's head_dim, else hidden_size / heads (the cache is made before the weights are read)."""
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def _reserve(self, slots: int) -> None:
        """Grow the key/value tensors (doubling) to hold ``slots`` slots."""
        capacity = self._keys.shape[2]
        if slots <= capacity:
            return
        while capacity < slots:
            capacity *= 2
        grown = (*self._keys.shape[:2], capacity, self._keys.shape[3])
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = torch.zeros(grown, dtype=self.dtype, device=self.device)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def _move_slots(self, source: torch.Tensor, first: int) -> None:
        k = source.numel()
        self._keys[:, :, first : first + k] = self._keys.index_select(2, source)
        self._values[:, :, first : first + k] = self._values.index_select(2, source)

    def _truncate(self, length: int) -> None:
        pass  # rows past the slot count are dead; they are overwritten by the next block

    # --- the forward ----------------------------------------------------------------------------------
    def _forward(self, ids, allowed: np.ndarray | None, pos: np.ndarray, output_hidden: bool,
                 up_bias: torch.Tensor | None, tap_layers: tuple[int, ...],
                 last: int | np.ndarray | None = None, groups: list[SequenceColumns] | None = None) -> ForwardOutput:
        """Logits ``(n, V)`` (and final normed hidden states ``(n, H)``, the tapped layers' inputs) of ``ids`` after
        the cached slots, as :meth:`CachedLM._forward` (``last``: the rows to keep; ``groups``: each sequence's
        columns, attention per sequence)."""
        n, start = len(ids), self.length
        self._reserve(start + n)
        with torch.inference_mode():
            index = torch.as_tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.from_numpy(pos).to(self.device)
            cos, sin = self.cos[positions].unsqueeze(0), self.sin[positions].unsqueeze(0)  # (1, n, d)
            sequences = None
            if groups is not None and self.per_sequence:
                sequences = sequence_attention(groups, self.dtype, self.device)
            masks = None if sequences is not None else self._masks(allowed, pos, n, start)
            x = self.embed[index]  # (n, H)
            inputs = []  # each layer's input (HF's hidden_states[i]), kept only when taps read them
            for i, w in enumerate(self.layers):
                if tap_layers:
                    inputs.append(x)
                mask = None if masks is None else window_of(self.layer_windows, i, masks)
                x = x + self._attention(i, F.rms_norm(x, x.shape[-1:], w["ln1"], self.eps), w, cos, sin, mask,
                                        start, n, sequences)
                h = F.rms_norm(x, x.shape[-1:], w["ln2"], self.eps)
                gate, up = w["kwgu"](h).chunk(2, dim=-1)
                if up_bias is not None:  # SD²: the step's bias on the up projection, every token alike
                    up = up + up_bias[i]
                x = x + w["kwd"](F.silu(gate) * up)
            hidden = F.rms_norm(x, x.shape[-1:], self.final_norm, self.eps)
            tapped = None
            if tap_layers:  # hidden_states[L] is the final normed state, as in HF's output
                tapped = torch.stack([(inputs + [hidden])[i] for i in tap_layers], dim=1).float()
            if last is not None:
                hidden = select_rows(hidden, last)
            logits = self._head(hidden).float()  # (n, V), or the kept rows
            return ForwardOutput(logits, hidden.float() if output_hidden else None, tapped)

    def _masks(self, allowed: np.ndarray | None, pos: np.ndarray, n: int,
               start: int) -> dict[int | None, torch.Tensor] | None:
        """Additive ``(1, n, start + n)`` masks keyed by window (:func:`~decode.models.masks.block_patterns`); None
        where plain causal attention is exact for every layer (one token, or a prefill, that no window cuts)."""
        patterns = block_patterns(self.layer_windows, allowed, pos, self.slots)
        if patterns is None:
            if n == 1 or start == 0:
                return None
            # sdpa's is_causal aligns the block to the top-left corner, not after the cached slots
            patterns = {None: causal_pattern(n, start)}
        return {w: additive_mask(p, self.dtype, self.device).unsqueeze(0) for w, p in patterns.items()}

    def _attention(self, i: int, h: torch.Tensor, w: dict, cos, sin, mask, start: int, n: int,
                   sequences: list[SequenceAttention] | None) -> torch.Tensor:
        """Self-attention of layer i for the block's n tokens over the cached slots and themselves (each sequence
        over its own, given ``sequences``)."""
        d = self.head_dim
        qkv = w["kwqkv"](h)  # (n, (heads + 2 kv_heads) · d)
        q = qkv[:, : self._q_width].view(n, self.n_heads, d)
        k = qkv[:, self._q_width : self._q_width + self._kv_width].view(n, self.n_kv, d)
        if w["qn"] is not None:
            q, k = F.rms_norm(q, (d,), w["qn"], self.eps), F.rms_norm(k, (d,), w["kn"], self.eps)
        q, k = q.transpose(0, 1), k.transpose(0, 1)  # (heads, n, d), (kv_heads, n, d)
        v = qkv[:, self._q_width + self._kv_width :].view(n, self.n_kv, d).transpose(0, 1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        self._keys[i, :, start : start + n] = k
        self._values[i, :, start : start + n] = v
        keys, values = self._keys[i, :, : start + n], self._values[i, :, : start + n]  # (kv_heads, start + n, d)
        if sequences is not None:
            out = per_sequence(self._attend, q, keys, values, sequences)
        else:
            out = self._attend(q, keys, values, mask)
        return w["kwo"](out.transpose(0, 1).reshape(n, self._q_width))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """``q (heads, n, d)`` over ``keys``/``values (kv_heads, m, d)`` with an additive ``mask (n, m)`` or
        ``(1, n, m)`` (None: no mask for one row, causal for several); ``(heads, n, d)``."""
        n = q.shape[1]
        if mask is not None and mask.dim() == 2:
            mask = mask[None]
        if n > 1:
            # Batched 4-D inputs reach torch's flash attention for CPU, which pairs each kv head with its heads /
            # kv_heads queries itself (enable_gqa). The 3-D call below falls back to the math kernel, after a copy of
            # the keys per head. One query row stays below: flash runs it slower than the math kernel.
            return F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                                  attn_mask=None if mask is None else mask[None],
                                                  is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads)[0]
        # one row: each kv head's query heads become its rows (query head j reads kv head j // group, as HF's
        # repeat_kv pairs them), one math-kernel call with no copy of the keys (4x faster than repeating them)
        group = self.n_heads // self.n_kv
        out = F.scaled_dot_product_attention(q.view(self.n_kv, group, -1), keys, values, attn_mask=mask)
        return out.view(self.n_heads, 1, -1)


def _fused_weight(sources: list[tuple[torch.nn.Module, str]]) -> torch.Tensor:
    """The weights ``(N_i, K)`` of the linear layers ``parent.attribute`` stacked as one matrix ``(sum N_i, K)``: a new
    tensor for several, the layer's own weight for one."""
    weights = [getattr(parent, attribute).weight.detach() for parent, attribute in sources]
    return weights[0] if len(weights) == 1 else torch.cat(weights)


def _fused_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The biases of ``linears`` concatenated as their fused output is (zeros for one without), or None if none has."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                      for lin in linears])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as HF applies it: x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def cached_lm(model, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, fast: bool = True):
    """A :class:`FastCachedLM` where the fast forward supports the model (and ``fast``), else a :class:`CachedLM`
    (HF's forward, the same logits) whose ``fast_fallback`` says why the fast one was not taken (None when
    ``fast`` was off). Both start on the default kernels (:meth:`~CachedLM.use_kernel` changes them)."""
    reason = fast_path_unsupported(model) if fast else None
    if fast and reason is None:
        return FastCachedLM(model, device, dtype)
    lm = CachedLM(model, device, dtype)
    lm.fast_fallback = reason
    return lm
