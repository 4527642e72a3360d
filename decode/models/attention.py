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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

__all__ = ["ATTENTION", "gqa_sdpa_attention_forward"]

ATTENTION = "ddte_sdpa"  # the name a model's config carries (config._attn_implementation)


def gqa_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                               is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: ``query (b, heads, n, d)``, ``key``/``value (b, kv_heads, m, d)``,
    ``attention_mask (b | 1, 1, n, m)`` additive or bool; returns ``(b, n, heads, d)`` and no weights."""
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
