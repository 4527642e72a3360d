"""Model layer of the decoding engine: one HF causal LM plus a KV cache that holds a tree of speculative slots.

Cache layout
------------
The cache holds ``length`` positions (*slots*), numbered ``0 .. length-1``:

* slots ``0 .. committed-1`` are the **committed** prefix, a linear sequence (slot ``s`` sits at position ``s``);
* slots ``committed .. length-1`` are **speculative**. Each has a parent slot with a smaller index (the committed
  tip ``committed-1``, another speculative slot, or, rarely, an earlier committed slot), so the speculative slots
  form a forest hanging off the committed prefix. A speculative slot attends to its own root-to-slot path only,
  and its rotary position is ``position(parent) + 1``.

:meth:`CachedLM.extend_tree` appends a block of speculative tokens whose parents are given as **absolute slot
indices** (any existing slot) or as ``-(j + 1)`` for *token j of the same block*. This lets a draft model grow
K branches breadth-first, one call per level, each level's parents being the previous level's slots.
:meth:`CachedLM.commit` keeps the committed prefix plus one chain of speculative slots starting at the committed
tip and drops every other speculative slot; :meth:`CachedLM.crop` is the linear rollback.

Tree attention uses an additive float mask of shape ``(1, 1, q_len, length + q_len)`` in the model dtype
(``0`` = attend, ``torch.finfo(dtype).min`` = blocked) and explicit ``position_ids``; a block that merely
continues a linear cache runs without a mask (the model's own causal path). Works with sdpa and eager attention;
never use flex_attention with these masks on CPU (see docs/stack-notes.md §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

__all__ = ["CachedLM", "check_same_vocab", "load_causal_lm"]

_EMPTY_I64 = np.zeros(0, dtype=np.int64)


def _default_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class CachedLM:
    """One causal LM (target or draft) plus its KV cache with committed and speculative slots.

    Attributes:
        model: the wrapped model, in eval mode, on ``device`` in ``dtype``.
        device: where the model and its cache live.
        dtype: the model's parameter dtype (fp32 on CPU and bf16 on CUDA unless given).
        vocab_size: ``model.config.vocab_size`` (the logits' last dimension ``V``).

    All returned logits and hidden states are float32 tensors on ``device``. The constructor switches the model
    to sdpa attention (eager is kept if sdpa is unavailable), moves it to ``device``/``dtype`` and sets eval
    mode, all in place.
    """

    def __init__(
        self, model: PreTrainedModel, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        self.device = torch.device(device)
        self.dtype = _default_dtype(self.device, dtype)
        attn = getattr(model.config, "_attn_implementation", None)
        if attn != "sdpa":
            try:
                model.set_attn_implementation("sdpa")
            except (ValueError, ImportError, AttributeError) as err:
                # eager also takes the additive float mask; flex_attention aborts on CPU with custom masks
                if attn != "eager":
                    raise ValueError(
                        f"{type(model).__name__} supports neither sdpa nor eager attention (has {attn!r})"
                    ) from err
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.config = model.config
        self.vocab_size: int = int(model.config.get_text_config().vocab_size)
        self._mask_min = torch.finfo(self.dtype).min
        self.reset()

    # --- state ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the cache (no committed or speculative slots)."""
        self._cache = DynamicCache(config=self.config)
        for layer in self._cache.layers:
            if type(layer) is not DynamicLayer:
                raise ValueError(
                    f"unsupported cache layer {type(layer).__name__} (sliding-window or hybrid caches cannot be "
                    "rolled back slot by slot); CachedLM needs plain DynamicLayer caches"
                )
        self._length = 0
        self._committed = 0
        # per speculative slot committed+k: parent slot (absolute), rotary position, visible committed columns
        self._par = _EMPTY_I64
        self._pos = _EMPTY_I64
        self._vis = _EMPTY_I64
        self._anc = np.zeros((0, 0), dtype=bool)  # [a, b]: spec slot b is slot a or one of its ancestors
        self._linear = True  # speculative slots form one chain committed-1 -> ... -> length-1

    @property
    def length(self) -> int:
        """Number of cached positions (committed + speculative slots)."""
        return self._length

    @property
    def committed(self) -> int:
        """Length of the committed linear prefix (slots ``0 .. committed-1``)."""
        return self._committed

    @property
    def num_speculative(self) -> int:
        """Number of speculative slots (``length - committed``)."""
        return self._length - self._committed

    def parent_of(self, slot: int) -> int:
        """Parent slot of ``slot`` (``slot - 1`` for a committed slot; ``-1`` for slot 0)."""
        if not 0 <= slot < self._length:
            raise IndexError(f"slot {slot} is not cached (length {self._length})")
        return slot - 1 if slot < self._committed else int(self._par[slot - self._committed])

    def position_of(self, slot: int) -> int:
        """Rotary position (depth in the sequence) of ``slot``."""
        if not 0 <= slot < self._length:
            raise IndexError(f"slot {slot} is not cached (length {self._length})")
        return slot if slot < self._committed else int(self._pos[slot - self._committed])

    # --- forward passes -------------------------------------------------------------------------------
    def prefill(
        self, ids: Sequence[int], output_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Reset the cache, run ``ids`` and commit them.

        Returns:
            logits ``(len(ids), V)`` float32 (row i predicts the token after ``ids[i]``), or
            ``(logits, hidden)`` with ``hidden`` the final-layer hidden state after the final norm,
            ``(len(ids), hidden_size)`` float32, when ``output_hidden``.
        """
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self.reset()
        out = self._forward(ids, None, None, output_hidden)
        self._length = self._committed = len(ids)
        return out

    def extend(
        self, ids: Sequence[int], commit: bool = False, output_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append a linear run of tokens, ``ids[0]`` a child of the last cached slot ``length - 1``.

        Args:
            ids: the tokens, length n >= 1.
            commit: commit the run at once (only allowed when no speculative slot is cached). Otherwise the new
                slots are speculative, like the blocks of :meth:`extend_tree`.
            output_hidden: also return the final hidden states.

        Returns:
            logits ``(n, V)`` float32, or ``(logits, hidden (n, hidden_size))`` when ``output_hidden``.
        """
        n = len(ids)
        if n == 0:
            raise ValueError("extend needs at least one token")
        if commit:
            if self.num_speculative:
                raise ValueError(
                    f"extend(commit=True) with {self.num_speculative} speculative slots cached; commit or crop first"
                )
            out = self._forward(ids, None, None, output_hidden)
            self._length += n
            self._committed = self._length
            return out
        if self._length == 0:
            raise ValueError("extend on an empty cache: use prefill or extend(commit=True)")
        return self.extend_tree(ids, [self._length - 1] + [-(j + 1) for j in range(n - 1)], output_hidden)

    def extend_tree(
        self, ids: Sequence[int], parents: Sequence[int], output_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append a block of speculative tokens arranged as a tree.

        Args:
            ids: the n new tokens; token i goes to slot ``length + i`` (block order).
            parents: for each token, its parent: ``p >= 0`` is an **absolute slot** already in the cache (the
                committed tip ``committed - 1``, any speculative slot, or an earlier committed slot), and
                ``p = -(j + 1)`` (so ``-1, -2, ...``) is **token j of this block**, with ``j < i``. To hang a
                :class:`~decode.tree.DraftTree` (local parents, root = last cached slot) use
                :func:`block_parents`. The cache must not be empty (prefill first).
            output_hidden: also return the final hidden states.

        Each token attends to its parent's root-to-slot path and itself, at position ``position(parent) + 1``.

        Returns:
            logits ``(n, V)`` float32 (row i predicts the child of token i), or ``(logits, hidden)`` with
            ``hidden (n, hidden_size)`` float32 when ``output_hidden``.
        """
        n = len(ids)
        if n == 0:
            raise ValueError("extend_tree needs at least one token")
        if len(parents) != n:
            raise ValueError(f"{n} tokens but {len(parents)} parents")
        length, committed = self._length, self._committed
        if length == 0:
            raise ValueError("extend_tree on an empty cache: prefill first")
        m = length - committed
        par: list[int] = []
        linear = self._linear
        for i, p in enumerate(parents):
            p = int(p)
            if p < 0:
                j = -p - 1
                if j >= i:
                    raise ValueError(f"block token {i} has parent {p} = block token {j}; parents must precede it")
                p = length + j
            elif p >= length:
                raise ValueError(f"block token {i} has parent slot {p}, but only {length} slots are cached")
            par.append(p)
            linear = linear and p == length + i - 1
        if linear:
            pos = np.arange(length, length + n, dtype=np.int64)
            vis = np.full(n, committed, dtype=np.int64)
            anc = np.zeros((m + n, m + n), dtype=bool)
            anc[:m, :m] = self._anc
            anc[m:, :] = np.tri(n + m, dtype=bool)[m:]
            out = self._forward(ids, None, pos, output_hidden)
        else:
            pos, vis, anc = self._block_structure(par)
            allowed = np.concatenate([np.arange(committed)[None, :] < vis[:, None], anc[m:]], axis=1)
            out = self._forward(ids, allowed, pos, output_hidden)
        self._par = np.concatenate([self._par, np.array(par, dtype=np.int64)])
        self._pos = np.concatenate([self._pos, pos])
        self._vis = np.concatenate([self._vis, vis])
        self._anc = anc
        self._linear = linear
        self._length = length + n
        return out

    def _block_structure(self, par: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions ``(n,)``, visible committed columns ``(n,)`` and the new speculative ancestry
        ``(m + n, m + n)`` for a block whose absolute parent slots are ``par`` (length n)."""
        committed, m, n = self._committed, self.num_speculative, len(par)
        anc = np.zeros((m + n, m + n), dtype=bool)
        anc[:m, :m] = self._anc
        pos_all = self._pos.tolist()
        vis_all = self._vis.tolist()
        for i, p in enumerate(par):
            row = m + i
            q = p - committed  # parent's speculative index, < 0 when the parent is committed
            if q >= 0:
                anc[row] = anc[q]
                pos_all.append(pos_all[q] + 1)
                vis_all.append(vis_all[q])
            else:
                pos_all.append(p + 1)
                vis_all.append(p + 1)
            anc[row, row] = True
        return np.array(pos_all[m:], dtype=np.int64), np.array(vis_all[m:], dtype=np.int64), anc

    def _forward(
        self, ids: Sequence[int], allowed: np.ndarray | None, pos: np.ndarray | None, output_hidden: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids`` after the cache. ``allowed (n, length + n)`` bool: which cached/new columns each new
        token sees (None = causal); ``pos (n,)``: position ids (None = ``length .. length + n - 1``)."""
        with torch.inference_mode():
            input_ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1).to(self.device)
            kwargs = {}
            if allowed is not None:
                blocked = torch.from_numpy(~allowed).to(self.device)
                mask = torch.zeros(blocked.shape, dtype=self.dtype, device=self.device)
                kwargs["attention_mask"] = mask.masked_fill_(blocked, self._mask_min)[None, None]
            if pos is None:
                pos = np.arange(self._length, self._length + len(ids), dtype=np.int64)
            kwargs["position_ids"] = torch.from_numpy(pos).view(1, -1).to(self.device)
            out = self.model(
                input_ids=input_ids,
                past_key_values=self._cache,
                use_cache=True,
                output_hidden_states=output_hidden,
                **kwargs,
            )
            logits = out.logits[0].float()
            if output_hidden:
                return logits, out.hidden_states[-1][0].float()
            return logits

    # --- rollback -------------------------------------------------------------------------------------
    def commit(self, keep_slots: Sequence[int]) -> None:
        """Commit a chain of speculative slots and drop every other speculative slot.

        Args:
            keep_slots: absolute speculative slots, in order; ``keep_slots[0]``'s parent must be the committed tip
                ``committed - 1`` and each next slot a child of the previous one. May be empty (drop all).

        After the call the cache holds ``committed + len(keep_slots)`` slots, all committed, the kept slots
        moved to positions ``committed, committed + 1, ...`` (their rotary positions already equal these).

        Raises:
            ValueError: a slot is not speculative or the slots are not a chain from the committed tip.
        """
        committed, length = self._committed, self._length
        prev = committed - 1
        keep = [int(s) for s in keep_slots]
        for s in keep:
            if not committed <= s < length:
                raise ValueError(f"slot {s} is not speculative (speculative slots are {committed}..{length - 1})")
            if self._par[s - committed] != prev:
                raise ValueError(
                    f"commit path {keep} is not a chain from the committed tip {committed - 1}: "
                    f"slot {s} has parent {int(self._par[s - committed])}, expected {prev}"
                )
            prev = s
        k = len(keep)
        if keep != list(range(committed, committed + k)):
            with torch.inference_mode():
                src = torch.tensor(keep, dtype=torch.long, device=self.device)
                for layer in self._cache.layers:
                    # gather first (advanced indexing copies), then write into the slots right after the prefix
                    layer.keys[..., committed : committed + k, :] = layer.keys.index_select(-2, src)
                    layer.values[..., committed : committed + k, :] = layer.values.index_select(-2, src)
        self._truncate(committed + k)
        self._committed = committed + k
        self._reset_speculative()

    def crop(self, length: int) -> None:
        """Drop every slot at or after ``length`` (linear rollback). The committed length becomes
        ``min(committed, length)``; speculative slots below ``length`` stay speculative."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        if length >= self._length:
            return
        self._truncate(length)
        if length <= self._committed:
            self._committed = length
            self._reset_speculative()
        else:
            k = length - self._committed
            self._par, self._pos, self._vis = self._par[:k], self._pos[:k], self._vis[:k]
            self._anc = self._anc[:k, :k]
            # a prefix of a chain is a chain; otherwise check the kept part
            if not self._linear:
                self._linear = bool(np.array_equal(self._par, np.arange(self._committed - 1, length - 1)))

    def _truncate(self, length: int) -> None:
        remove = self._length - length
        if remove > 0:
            if length == 0:
                self._cache = DynamicCache(config=self.config)
            else:
                self._cache.crop(-remove)
        self._length = length

    def _reset_speculative(self) -> None:
        self._par = self._pos = self._vis = _EMPTY_I64
        self._anc = np.zeros((0, 0), dtype=bool)
        self._linear = True


def block_parents(local_parents: Sequence[int], root_slot: int) -> list[int]:
    """Convert block-local parents (``-1`` = the root ``root_slot``, ``j >= 0`` = token j of the block) into the
    convention of :meth:`CachedLM.extend_tree` (absolute slot, or ``-(j + 1)`` for token j of the block).

    For a :class:`~decode.tree.DraftTree` ``t`` rooted at the last cached slot, the block is ``t.tokens[1:]`` with
    ``block_parents([p - 1 for p in t.parents[1:]], cached.length - 1)``.
    """
    return [root_slot if p < 0 else -(p + 1) for p in local_parents]


def load_causal_lm(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Load a local causal LM directory (``config.json`` + safetensors weights), offline, with sdpa attention.

    ``dtype`` defaults to fp32 on CPU and bf16 on CUDA. Remote code is never trusted.

    Raises:
        ValueError: the directory is missing, or has no ``config.json`` or no ``*.safetensors`` file.
    """
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise ValueError(f"model directory {str(p)!r} has no config.json")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model directory {str(p)!r} has no *.safetensors weights (only safetensors are loaded)")
    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(
        str(p),
        attn_implementation="sdpa",
        use_safetensors=True,
        local_files_only=True,
        trust_remote_code=False,
        dtype=_default_dtype(dev, dtype),
    )
    return model.to(dev).eval()


def check_same_vocab(
    target_config: PretrainedConfig,
    draft_config: PretrainedConfig,
    allow_padded_tail: bool = False,
    tokenizer_sizes: tuple[int, int] | None = None,
) -> int:
    """Check that a target and a draft model share one vocabulary; return its size.

    Args:
        target_config, draft_config: the models' configs (their text configs' ``vocab_size`` are compared).
        allow_padded_tail: accept different ``vocab_size`` values, as when one model pads its embedding matrix
            past the tokenizer's size. The **smaller** ``vocab_size`` is then the usable vocabulary (returned);
            callers must slice both models' logits to it (the padded tail ids are never produced by the
            tokenizer). If ``tokenizer_sizes`` is given, the two tokenizers must have the same size and it must
            fit in the usable vocabulary.
        tokenizer_sizes: ``(len(target_tokenizer), len(draft_tokenizer))``, optional.

    Raises:
        ValueError: the sizes differ (and ``allow_padded_tail`` is off, or the tokenizers differ).
    """
    vt = int(target_config.get_text_config().vocab_size)
    vd = int(draft_config.get_text_config().vocab_size)
    if tokenizer_sizes is not None:
        st, sd = (int(s) for s in tokenizer_sizes)
        if st != sd:
            raise ValueError(f"target and draft tokenizers differ in size: {st} vs {sd}")
    if vt == vd:
        return vt
    if not allow_padded_tail:
        raise ValueError(
            f"vocabulary mismatch: target vocab_size={vt}, draft vocab_size={vd}; speculative decoding needs one "
            "shared vocabulary (pass allow_padded_tail=True if one embedding matrix is only padded)"
        )
    usable = min(vt, vd)
    if tokenizer_sizes is not None and tokenizer_sizes[0] > usable:
        raise ValueError(
            f"tokenizer size {tokenizer_sizes[0]} exceeds the smaller vocab_size {usable} (target {vt}, draft {vd})"
        )
    return usable
