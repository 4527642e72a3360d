"""Attention masks of a tree of cached slots, sliding windows included: pure functions of the slot layout.

A block of n new tokens sees the slots its :class:`~decode.models.slots.BlockPlan` allows, ``(n, length + n)`` bool
(its root-to-token path), at explicit positions. Models take that as an additive float mask of shape
``(1, 1, n, length + n)`` in the model dtype (``0`` = attend, ``torch.finfo(dtype).min`` = blocked); a block that
merely continues a linear cache runs without one (the model's own causal path). Works with sdpa and eager attention;
never use flex_attention with these masks on CPU (with torch 2.13 a custom 4-D mask there aborts the process).

Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``, the sliding layers of Gemma2/Gemma3) is applied
by these masks too: a token attends to the ancestors on its own path whose position is within the window
(``position(query) - position(key) < window``, HF's convention). The cache keeps every slot in **full** layers (never
HF's ``DynamicSlidingWindowLayer``, which drops old entries and could not be rolled back slot by slot). A hybrid model
(``config.layer_types`` mixing full and sliding layers) takes a dict of masks keyed by layer type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from decode.models.slots import SlotLayout

__all__ = ["SequenceColumns", "additive_mask", "attention_windows", "block_patterns", "causal_pattern", "group_mask",
           "layer_windows", "sequence_columns", "window_of"]

# the layer types of config.layer_types these masks express; any other (chunked, linear or recurrent attention,
# layers sharing another's cache) needs a mask or a cache this package does not build
LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention type: ``config.layer_types`` where the model has them, else every layer sliding when
    ``sliding_window`` is set (Mistral, Phi3, Starcoder2 choose their mask that way), else full."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)[: config.num_hidden_layers]
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def attention_windows(config: PretrainedConfig) -> dict[str, int | None]:
    """The sliding window of each attention layer type a model uses (None = full attention).

    Raises:
        ValueError: a layer type other than full or sliding attention (e.g. chunked attention), a chunk size, or
            a model that attends bidirectionally; these masks would get them wrong.
    """
    text = config.get_text_config(decoder=True)
    if getattr(text, "use_bidirectional_attention", False) or not getattr(text, "is_causal", True):
        raise ValueError(f"{text.model_type} attends bidirectionally; CachedLM needs a causal LM")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise ValueError(f"{text.model_type} uses chunked attention, which CachedLM's masks do not implement")
    windows: dict[str, int | None] = {}
    for layer_type in _layer_types(text):
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"{text.model_type} has a {layer_type!r} layer; CachedLM runs only {LAYER_TYPES}")
        window = text.sliding_window if layer_type == "sliding_attention" else None
        if layer_type == "sliding_attention" and (window is None or int(window) < 1):
            raise ValueError(f"{text.model_type} has sliding layers but sliding_window={window!r}")
        windows[layer_type] = None if window is None else int(window)
    return windows


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each decoder layer's sliding window, None for full attention (ValueError as :func:`attention_windows`)."""
    windows = attention_windows(config)
    return [windows[t] for t in _layer_types(config.get_text_config(decoder=True))]


def causal_pattern(n: int, start: int) -> np.ndarray:
    """``(n, start + n)`` bool: n tokens after ``start`` linear slots, each seeing every earlier slot and itself."""
    return np.concatenate([np.ones((n, start), dtype=bool), np.tri(n, dtype=bool)], axis=1)


def block_patterns(windows: list[int | None], allowed: np.ndarray | None, positions: np.ndarray,
                   cached: SlotLayout) -> dict[int | None, np.ndarray] | None:
    """Attention pattern of a block per window, or None where every layer may run its model's causal mask.

    Args:
        windows: each layer's window (:func:`layer_windows`).
        allowed: ``(n, length + n)`` bool, which cached and new slots each new token sees (its path), or None for a
            block that continues a linear cache.
        positions: ``(n,)`` the new tokens' positions.
        cached: the slots already cached (their positions, where a window cuts).

    Returns:
        ``{window: (n, length + n) bool}``: key None is the pattern of full-attention layers and of sliding layers
        whose window reaches back to position 0 anyway; a window key is ``allowed`` cut to the slots whose position
        is within that window of the query's (positions count along the query's own path, as every visible slot is
        an ancestor). None when ``allowed`` is None and no window cuts.
    """
    cutting = sorted({w for w in windows if w is not None and w <= int(positions.max())})
    if allowed is None:
        if not cutting:
            return None
        allowed = causal_pattern(len(positions), cached.length)
    patterns: dict[int | None, np.ndarray] = {}
    if len(cutting) < len(set(windows)):  # some layer sees the whole path
        patterns[None] = allowed
    if cutting:
        key_positions = np.concatenate([cached.positions(), positions])  # (length + n,)
        distance = positions[:, None] - key_positions[None, :]  # query position - key position
        for w in cutting:
            patterns[w] = allowed & (distance < w)
    return patterns


def additive_mask(pattern: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(n, m)`` additive mask in ``dtype`` of a bool pattern (0 = attend, the dtype's min = blocked)."""
    blocked = torch.from_numpy(~pattern).to(device)
    return torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill_(blocked, torch.finfo(dtype).min)


def window_of(windows: list[int | None], layer: int, masks: dict[int | None, torch.Tensor]) -> torch.Tensor:
    """Layer ``layer``'s entry of a dict keyed like :func:`block_patterns`' (its window, else None)."""
    window = windows[layer]
    return masks[window if window in masks else None]


@dataclass(frozen=True)
class SequenceColumns:
    """One sequence's part of a pass over a shared cache (decode/models/shared_cache.py): its new tokens' ``rows``
    (a block's rows are contiguous), the key ``columns (m,)`` it may see, its own cached slots in cache order then
    its new tokens (None: every column, the cache holding this sequence alone), and its ``pattern (n, m)`` bool over
    them (None: a plain causal run after its ``start = m - n`` cached slots).

    Attention computed per sequence over these columns sees exactly what the same sequence alone in a cache sees, in
    the same order and through the same kernel call, so a request's rows are the same bits whoever shares the pass.
    """

    rows: slice
    columns: np.ndarray | None
    pattern: np.ndarray | None
    start: int


def sequence_columns(row_owners: np.ndarray, slot_owners: np.ndarray,
                     allowed: np.ndarray | None) -> list[SequenceColumns]:
    """Each sequence's columns of a pass: ``row_owners (n,)`` the sequence of each new token (each sequence's rows
    contiguous), ``slot_owners (length,)`` of each cached slot (-1 dead), ``allowed (n, length + n)`` as
    :func:`block_patterns` takes it (None: one sequence's linear run).

    Raises:
        ValueError: a sequence's rows are not contiguous, or a row sees a column of another sequence.
    """
    n, length = len(row_owners), len(slot_owners)
    cuts = np.flatnonzero(np.diff(row_owners)) + 1
    bounds = list(zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True))
    if len({int(row_owners[a]) for a, _ in bounds}) != len(bounds):
        raise ValueError("a sequence's new tokens must be one contiguous block")
    groups = []
    for a, b in bounds:
        cached = np.flatnonzero(slot_owners == row_owners[a])
        alone = len(cached) == length and b - a == n
        columns = None if alone else np.concatenate([cached, length + np.arange(a, b)])
        pattern = None
        if allowed is not None:
            pattern = allowed[a:b] if columns is None else allowed[a:b][:, columns]
            if int(pattern.sum()) != int(allowed[a:b].sum()):
                raise ValueError(f"rows {a}..{b - 1} see slots of another sequence")
            if np.array_equal(pattern, causal_pattern(b - a, len(cached))):
                pattern = None
        groups.append(SequenceColumns(slice(a, b), columns, pattern, len(cached)))
    return groups


def group_mask(group: SequenceColumns, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The additive ``(n, m)`` mask a sequence's attention runs with; None for one row that sees all its columns or
    a causal run from an empty cache (sdpa's own ``is_causal``). A function of the sequence's own columns only."""
    rows = group.rows.stop - group.rows.start
    if group.pattern is None and (rows == 1 or group.start == 0):
        return None
    pattern = causal_pattern(rows, group.start) if group.pattern is None else group.pattern
    return additive_mask(pattern, dtype, device)
