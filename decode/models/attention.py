"""The attention a :class:`~decode.models.cached_lm.CachedLM` runs HF's forward with: transformers' sdpa, except that a
masked pass of several query rows over grouped-query heads on a CPU reaches ``scaled_dot_product_attention`` with the
cache's own key/value heads (``enable_gqa``) instead of copies repeated per query head.

transformers (5.x) enables sdpa's GQA only when there is no mask (``use_gqa_in_sdpa``: the CUDA kernels fall back to
the math kernel with a mask and GQA); with one it repeats every layer's whole key/value cache per query head
(``repeat_kv``, 6x for Qwen2.5's 12 heads over 2) before the call. Every tree block and every batched step passes a
mask (:mod:`decode.models.masks`), so a tree pass paid that copy in each layer. torch's flash attention for CPU takes
the mask and pairs each key/value head with its query heads itself, so a masked tree or batch pass skips the copy;
the logits are the same bits.

Everything else goes to transformers' own sdpa function unchanged: one query row (transformers folds the heads into
the kv heads then, with no copy), no mask, no grouped heads, another device, dropout, a position bias or softcapping.
The function is registered under :data:`ATTENTION` in transformers' attention and mask interfaces when this module is
imported (the mask is sdpa's, so a pass without a mask of ours gets transformers' own causal mask).

**Per sequence.** A pass over a shared cache (several requests, decode/models/shared_cache.py) hands the forward
each sequence's columns (:class:`SequenceAttention`, under the keyword :data:`GROUPS`): each request's rows then
attend over its own slots only, gathered in cache order, through one kernel call that depends on nothing but that
request's rows and columns. Attention over the whole cache with the other requests masked out would be the same law
but not the same bits (the kernels block and sum over every column), and a draft with dynamically quantized
activations turns a last-bit difference into another q: a seeded request would draw otherwise beside others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from decode.models.masks import group_mask

__all__ = ["ATTENTION", "GROUPS", "SequenceAttention", "gqa_sdpa_attention_forward", "per_sequence",
           "sequence_attention"]

ATTENTION = "ddte_sdpa"  # the name a model's config carries (config._attn_implementation)
GROUPS = "ddte_sequences"  # the keyword HF's forward carries down to the attention function


class SequenceAttention(NamedTuple):
    """One sequence's part of a pass, as tensors: its query ``rows``, the key ``columns (m,)`` long (None: all) and
    its additive ``mask (n, m)`` (None: no mask for one row, sdpa's ``is_causal`` for several)."""

    rows: slice
    columns: torch.Tensor | None
    mask: torch.Tensor | None


def sequence_attention(groups: Sequence, dtype: torch.dtype, device: torch.device) -> list[SequenceAttention]:
    """:class:`SequenceAttention` of each :class:`~decode.models.masks.SequenceColumns`, built once per pass."""
    return [SequenceAttention(g.rows, None if g.columns is None else torch.from_numpy(g.columns).to(device),
                              group_mask(g, dtype, device)) for g in groups]


def per_sequence(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
                 query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 groups: Sequence[SequenceAttention]) -> torch.Tensor:
    """``attend(query_rows, keys, values, mask)`` of each sequence on its own columns, rows back in order.

    ``query (..., n, d)``, ``key``/``value (..., m, d)`` (the row and column axis second to last); returns
    ``attend``'s ``(..., n, d)``."""
    axis = query.dim() - 2
    parts = []
    for rows, columns, mask in groups:
        keys = key if columns is None else key.index_select(axis, columns)
        values = value if columns is None else value.index_select(axis, columns)
        parts.append(attend(query.narrow(axis, rows.start, rows.stop - rows.start), keys, values, mask))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)


def gqa_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                               is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: ``query (b, heads, n, d)``, ``key``/``value (b, kv_heads, m, d)``,
    ``attention_mask (b | 1, 1, n, m)`` additive or bool; returns ``(b, n, heads, d)`` and no weights. With
    :data:`GROUPS` in ``kwargs`` (a shared cache's pass, batch 1), each sequence attends over its own columns and
    the mask is not read."""
    groups = kwargs.get(GROUPS)
    if groups is not None:
        gqa = query.shape[1] != key.shape[1]

        def attend(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[None, None],
                                                  scale=scaling, is_causal=mask is None and q.shape[2] > 1,
                                                  enable_gqa=gqa)

        return per_sequence(attend, query, key, value, groups).transpose(1, 2).contiguous(), None
    if (getattr(module, "num_key_value_groups", 1) > 1 and attention_mask is not None and query.shape[2] > 1
            and query.device.type == "cpu" and not dropout and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


AttentionInterface.register(ATTENTION, gqa_sdpa_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
