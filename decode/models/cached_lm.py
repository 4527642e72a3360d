"""Model layer of the decoding engine: one HF causal LM plus a KV cache that holds a tree of speculative slots.

The slot layout (committed prefix, speculative forest, parents as absolute slots or ``-(j + 1)`` for token j of
the same block) is :mod:`decode.models.slots`; the masks a block attends through, sliding windows included, are
:mod:`decode.models.masks`; this class keeps HF's ``DynamicCache`` in step with the slots and runs the forward.
:meth:`CachedLM.extend_tree` appends a block of speculative tokens, :meth:`CachedLM.commit` keeps the committed
prefix plus one chain of speculative slots from the committed tip and drops every other speculative slot, and
:meth:`CachedLM.crop` is the linear rollback. :func:`run_nodes` runs nodes of a tree as one block and records their
slots. One outside object may act at the forwards, the model's :class:`~decode.models.hooks.ForwardHook` (steering's
two ends); a draft vocabulary lives on the draft's head (:mod:`decode.models.draft_vocab`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, NamedTuple, overload

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from decode.models.attention import ATTENTION, GROUPS, sequence_attention
from decode.models.draft_vocab import support_logits
from decode.models.hooks import ForwardHook, UpProjectionBias
from decode.models.loading import context_limit, default_dtype
from decode.models.masks import SequenceColumns, additive_mask, attention_windows, block_patterns, layer_windows
from decode.models.rows import kept_rows, select_rows
from decode.models.slots import SlotForest, SlotLayout, block_parents

__all__ = ["CachedLM", "run_nodes"]


class ForwardOutput(NamedTuple):
    """One forward's float32 results: ``logits (n, V)``, the final normed states ``hidden (n, H)`` when asked, and
    ``tapped (n, len(tap_layers), H)`` when the hook taps layers."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    tapped: torch.Tensor | None


class CachedLM:
    """One causal LM (target or draft) plus its KV cache with committed and speculative slots.

    Attributes:
        model: the wrapped model, in eval mode, on ``device`` in ``dtype``.
        device: where the model and its cache live.
        dtype: the model's parameter dtype (fp32 on CPU and bf16 on CUDA unless given).
        vocab_size: ``model.config.vocab_size`` (the logits' last dimension ``V``).
        hook: the one :class:`~decode.models.hooks.ForwardHook` acting at this model's forwards, or None.
        layer_windows: each layer's sliding window (None: full attention); ``type_windows`` the same per layer type.

    All returned logits and hidden states are float32 tensors on ``device``. The constructor switches the model
    to sdpa attention as :mod:`decode.models.attention` runs it (config ``_attn_implementation`` ``ddte_sdpa``: a
    masked pass of several rows keeps grouped-query heads unrepeated on a CPU; eager is kept if sdpa is
    unavailable), moves it to ``device``/``dtype`` and sets eval mode, all in place.

    ``forward_name`` is ``"hf"`` (HF's forward; :class:`~decode.models.fast_llama.FastCachedLM` says ``"fast"``), and
    ``fast_fallback`` why :func:`~decode.models.fast_llama.cached_lm` did not take the fast forward (None if not asked).

    Raises:
        ValueError: the model has neither sdpa nor eager attention, or attention these masks cannot express
            (see :func:`~decode.models.masks.attention_windows`).
    """

    forward_name = "hf"
    fast_fallback: str | None = None
    kernel = "default"  # the linear layers' path (decode.models.kernels)
    hook: ForwardHook | None = None
    slots: SlotLayout  # its own SlotForest, or the layout of a batch's shared cache that owns it
    _up_bias = None  # HF's forward takes a hook's up-projection bias through module hooks, made on first use

    def __init__(
        self, model: PreTrainedModel, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        self.device = torch.device(device)
        self.dtype = default_dtype(self.device, dtype)
        attn = getattr(model.config, "_attn_implementation", None)
        if attn not in ("sdpa", ATTENTION):
            try:
                model.set_attn_implementation("sdpa")
            except (ValueError, ImportError, AttributeError) as err:
                # eager also takes the additive float mask; flex_attention aborts on CPU with custom masks
                if attn != "eager":
                    raise ValueError(
                        f"{type(model).__name__} supports neither sdpa nor eager attention (has {attn!r})"
                    ) from err
        if model.config._attn_implementation == "sdpa":  # sdpa with grouped-query heads unrepeated under our masks
            model.set_attn_implementation(ATTENTION)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.config = model.config
        self.vocab_size: int = int(model.config.get_text_config().vocab_size)
        self.type_windows = attention_windows(self.config)
        self.layer_windows = layer_windows(self.config)
        # attention per sequence of a shared cache: through decode.models.attention, where no window cuts
        self.per_sequence = model.config._attn_implementation == ATTENTION and set(self.layer_windows) == {None}
        self.reset()

    def use_kernel(self, name: str, release: bool = False) -> int:
        """Run the model's linear layers through kernel path ``name`` (:mod:`decode.models.kernels`), ``release``
        giving the stock weights back for good (:mod:`decode.models.release`); the bytes of the copies made.

        Raises:
            ValueError: an unknown path, one that cannot run this model's weights here, or weights given back.
        """
        from decode.models.kernels import use_kernel

        nbytes = use_kernel(self.model, name, release)
        self.kernel = name
        return nbytes

    # --- state ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the cache (no committed or speculative slots)."""
        self._new_cache()
        self.slots = SlotForest()
        if self.hook is not None:
            self.hook.reset()

    def _new_cache(self) -> None:
        """An empty key/value store (HF's DynamicCache here; a subclass may keep its own tensors).

        Built without the config, so every layer is a full ``DynamicLayer`` (created on its first update), sliding
        layers included: their window is the attention mask's business, and a full layer rolls back slot by slot."""
        self._cache = DynamicCache()

    @property
    def forest(self) -> SlotForest:
        """The cache's own slot forest, which the plain prefill, extend and rollback keep."""
        if not isinstance(self.slots, SlotForest):
            raise ValueError("a batch's shared cache owns this model: its layout has no slot forest")
        return self.slots

    @property
    def length(self) -> int:
        """Number of cached positions (committed + speculative slots)."""
        return self.slots.length

    @property
    def committed(self) -> int:
        """Length of the committed linear prefix (slots ``0 .. committed-1``)."""
        return self.slots.committed

    @property
    def num_speculative(self) -> int:
        """Number of speculative slots (``length - committed``)."""
        return self.slots.num_speculative

    @property
    def context_limit(self) -> int:
        """Positions the model can attend over (its ``max_position_embeddings``)."""
        return context_limit(self.config)

    # --- forward passes -------------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int], output_hidden: bool = False,
                last: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Reset the cache, run ``ids`` and commit them.

        ``last``: the rows to return, the last ones only (None: all). The output head then runs over those rows
        alone: for a 300-token prompt and a 151,936-token vocabulary the head over every row cost as much again as
        a third of the 1.5B target's prefill, for logits nobody read.

        Returns:
            logits ``(len(ids), V)`` float32 (row i predicts the token after ``ids[i]``; the last ``last`` rows
            given ``last``), or ``(logits, hidden)`` with ``hidden`` the final-layer hidden state after the final
            norm, ``(len(ids), hidden_size)`` float32 (the same rows), when ``output_hidden``.
        """
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        if last is not None and last < 1:
            raise ValueError(f"prefill's last must be at least 1, not {last}")
        self.reset()
        out = self._run(ids, None, None, output_hidden, root=None, last=last)
        self.forest.append_committed(len(ids))
        return out

    def extend(self, ids: Sequence[int], commit: bool = False,
               output_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append a linear run of tokens, ``ids[0]`` a child of the last cached slot ``length - 1``.

        Args:
            ids: the tokens, length n >= 1.
            commit: commit the run at once (only allowed when no speculative slot is cached). Otherwise the new
                slots are speculative, like the blocks of :meth:`extend_tree`.
            output_hidden: also return the final hidden states.

        Returns:
            logits ``(n, V)`` float32, or ``(logits, hidden (n, hidden_size))`` when ``output_hidden``.
        """
        if (n := len(ids)) == 0:
            raise ValueError("extend needs at least one token")
        if commit and self.num_speculative:
            raise ValueError(f"extend(commit=True) with {self.num_speculative} speculative slots cached; commit first")
        if commit:
            out = self._run(ids, None, None, output_hidden, root=self.length + n - 1)  # rooted at the last token
            self.forest.append_committed(n)
            return out
        if self.length == 0:
            raise ValueError("extend on an empty cache: use prefill or extend(commit=True)")
        return self.extend_tree(ids, [self.length - 1] + [-(j + 1) for j in range(n - 1)], output_hidden)

    @overload
    def extend_tree(self, ids: Sequence[int], parents: Sequence[int], output_hidden: Literal[False] = False,
                    on_support: bool = False) -> torch.Tensor: ...

    @overload
    def extend_tree(self, ids: Sequence[int], parents: Sequence[int], output_hidden: Literal[True],
                    on_support: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def extend_tree(self, ids: Sequence[int], parents: Sequence[int], output_hidden: bool,
                    on_support: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def extend_tree(
        self, ids: Sequence[int], parents: Sequence[int], output_hidden: bool = False, on_support: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append a block of speculative tokens arranged as a tree.

        Args:
            ids: the n new tokens; token i goes to slot ``length + i`` (block order).
            parents: for each token, its parent: ``p >= 0`` is an **absolute slot** already in the cache (the
                committed tip ``committed - 1``, any speculative slot, or an earlier committed slot), and
                ``p = -(j + 1)`` (so ``-1, -2, ...``) is **token j of this block**, with ``j < i``
                (:func:`~decode.models.slots.block_parents` writes them for nodes of a tree; :func:`run_nodes` runs
                them). The cache must not be empty (prefill first).
            output_hidden: also return the final hidden states.
            on_support: return logits ``(n, Vs)`` over the model's draft vocabulary only
                (:func:`~decode.models.draft_vocab.support_ids`: column i is token ``support[i]``); a model without
                one returns ``(n, V)`` as always.

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
        if self.length == 0:
            raise ValueError("extend_tree on an empty cache: prefill first")
        plan = self.forest.plan_block(parents)
        with support_logits(self.model) if on_support else nullcontext():
            # speculative tokens grow from the committed tip, the root of the step
            out = self._run(ids, plan.allowed, plan.positions, output_hidden, root=self.committed - 1)
        self.forest.append(plan)
        return out

    def _run(self, ids: Sequence[int], allowed: np.ndarray | None, pos: np.ndarray | None, output_hidden: bool,
             root: int | None, last: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_forward` with the hook's part: the up-projection bias it gives for a forward rooted at position
        ``root`` (None: a prefill), and the rows of the layers it taps. ``last``: logits and hidden states of the
        last rows only (None: every row; taps always read every row)."""
        hook = self.hook
        if pos is None:
            pos = np.arange(self.length, self.length + len(ids), dtype=np.int64)
        bias = None if hook is None else hook.up_bias(root)
        if bias is not None:
            bias = bias.to(self.device, self.dtype)
        out = self._forward(ids, allowed, pos, output_hidden, bias, () if hook is None else hook.tap_layers, last)
        if hook is not None and out.tapped is not None:
            hook.tapped(out.tapped)
        if not output_hidden:
            return out.logits
        assert out.hidden is not None  # the forward was asked for them
        return out.logits, out.hidden

    def _forward(self, ids: Sequence[int], allowed: np.ndarray | None, pos: np.ndarray, output_hidden: bool,
                 up_bias: torch.Tensor | None, tap_layers: tuple[int, ...],
                 last: int | np.ndarray | None = None, groups: list[SequenceColumns] | None = None) -> ForwardOutput:
        """Run ``ids`` after the cache. ``allowed (n, length + n)`` bool: which cached/new columns each new token
        sees (None = causal); ``pos (n,)``: position ids; ``up_bias (L, d_ff)``: added to each layer's MLP up
        projection (None: nothing); ``tap_layers``: hidden-state indices to return; ``last``: logits (through HF's
        ``logits_to_keep``) and the final hidden state of those rows only: an int k, the last k; an index array
        ``(k,)``, those rows in its order (:func:`kept_rows`); ``groups``: each sequence's columns of a shared cache,
        attended per sequence where the model runs :mod:`decode.models.attention` and no window cuts."""
        with torch.inference_mode():
            input_ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1).to(self.device)
            kwargs: dict[str, Any] = {}
            patterns = block_patterns(self.layer_windows, allowed, pos, self.slots)
            if patterns is not None:
                masks = {w: additive_mask(p, self.dtype, self.device)[None, None] for w, p in patterns.items()}
                if len(masks) == 1:  # one pattern serves every layer (HF passes a 4-D mask through unchanged)
                    kwargs["attention_mask"] = next(iter(masks.values()))
                else:  # a hybrid model: its forward picks each layer's mask by the layer's type
                    kwargs["attention_mask"] = {t: masks[w if w in masks else None]
                                                for t, w in self.type_windows.items()}
            if groups is not None and self.per_sequence:
                kwargs[GROUPS] = sequence_attention(groups, self.dtype, self.device)
            kwargs["position_ids"] = torch.from_numpy(pos).view(1, -1).to(self.device)
            if last is not None:
                kwargs["logits_to_keep"] = kept_rows(last, self.device)
            with self._up_projection_bias(up_bias):
                out = self.model(input_ids=input_ids, cache=self._cache, use_cache=True,
                                 output_hidden_states=output_hidden or bool(tap_layers), **kwargs)
            tapped = None
            if tap_layers:
                tapped = torch.stack([out.hidden_states[i][0] for i in tap_layers], dim=1).float()
            hidden = out.hidden_states[-1][0] if output_hidden else None
            if hidden is not None and last is not None:
                hidden = select_rows(hidden, last)
            hidden = None if hidden is None else hidden.float()
            return ForwardOutput(out.logits[0].float(), hidden, tapped)

    def _up_projection_bias(self, bias: torch.Tensor | None):
        """A context in which HF's forward adds ``bias`` ``(L, d_ff)`` to its up projections (nothing for None)."""
        if bias is None and self._up_bias is None:
            return nullcontext()
        if self._up_bias is None:
            self._up_bias = UpProjectionBias(self.model)
        return _bias_set(self._up_bias, bias)

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
        committed = self.committed
        keep = self.forest.check_chain(keep_slots)
        k = len(keep)
        if keep != list(range(committed, committed + k)):
            with torch.inference_mode():
                self._move_slots(torch.tensor(keep, dtype=torch.long, device=self.device), committed)
        if self.hook is not None:
            self.hook.committed(committed, keep)
        self._truncate(committed + k)
        self.forest.commit_moved(k)

    def _move_slots(self, source: torch.Tensor, first: int) -> None:
        """Copy the key/value rows of slots ``source`` ``(k,)`` into slots ``first .. first + k - 1``."""
        k = source.numel()
        for layer in self._cache.layers:
            # gather first (advanced indexing copies), then write into the slots right after the prefix
            layer.keys[..., first : first + k, :] = layer.keys.index_select(-2, source)
            layer.values[..., first : first + k, :] = layer.values.index_select(-2, source)

    def crop(self, length: int) -> None:
        """Drop every slot at or after ``length`` (linear rollback). The committed length becomes
        ``min(committed, length)``; speculative slots below ``length`` stay speculative."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        if length >= self.length:
            return
        if self.hook is not None:
            self.hook.cropped(length)
        self._truncate(length)
        self.forest.crop(length)

    def _truncate(self, length: int) -> None:
        """Drop the key/value rows of slots at or after ``length`` (the slot bookkeeping is the caller's)."""
        remove = self.length - length
        if remove > 0:
            if length == 0:
                self._new_cache()
            else:
                self._cache.crop(-remove)


@contextmanager
def _bias_set(up_bias, delta: torch.Tensor | None) -> Iterator[None]:
    """Sets an :class:`~decode.models.hooks.UpProjectionBias`'s δ for one forward, then clears it (whatever else runs
    the model, HF's assisted generation, runs unsteered)."""
    up_bias.delta = delta
    try:
        yield
    finally:
        up_bias.delta = None


def run_nodes(lm: CachedLM, nodes: Sequence[int], tokens: Sequence[int], parent_of: Sequence[int],
              slots: dict[int, int], output_hidden: bool = False, on_support: bool = False):
    """Run nodes of a tree as one speculative block of ``lm`` and record each one's cache slot in ``slots``.

    Args:
        nodes: the block's nodes, parents before children; a parent outside the block must be in ``slots``.
        tokens, parent_of: every node's token and parent node (by node index).
        slots: cache slot of each node already run; gains the block's.
        output_hidden, on_support: as :meth:`CachedLM.extend_tree`.

    Returns:
        what :meth:`CachedLM.extend_tree` returns, row i for ``nodes[i]``.
    """
    base = lm.length
    out = lm.extend_tree([tokens[v] for v in nodes], block_parents(nodes, parent_of, slots), output_hidden,
                         on_support)
    slots.update({v: base + i for i, v in enumerate(nodes)})
    return out

