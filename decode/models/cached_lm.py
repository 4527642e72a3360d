"""Model layer of the decoding engine: one HF causal LM plus a KV cache that holds a tree of speculative slots.

The slot layout (committed prefix, speculative forest, parents as absolute slots or ``-(j + 1)`` for token j of
the same block) is :mod:`decode.models.slots`; this class keeps HF's ``DynamicCache`` in step with it.
:meth:`CachedLM.extend_tree` appends a block of speculative tokens, :meth:`CachedLM.commit` keeps the committed
prefix plus one chain of speculative slots from the committed tip and drops every other speculative slot, and
:meth:`CachedLM.crop` is the linear rollback.

Tree attention uses an additive float mask of shape ``(1, 1, q_len, length + q_len)`` in the model dtype
(``0`` = attend, ``torch.finfo(dtype).min`` = blocked) and explicit ``position_ids``; a block that merely
continues a linear cache runs without a mask (the model's own causal path). Works with sdpa and eager attention
(eager where a model has no sdpa, e.g. Gemma2's softcapped scores); never use flex_attention with these masks on
CPU (with torch 2.13 a custom 4-D mask there aborts the process).

Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``, the sliding layers of Gemma2/Gemma3) is
applied by this mask too: a token attends to the ancestors on its own path whose position is within the window
(``position(query) - position(key) < window``, HF's convention). The cache keeps every slot in **full** layers
(never HF's ``DynamicSlidingWindowLayer``, which drops old entries and could not be rolled back slot by slot).
Hybrid models (``config.layer_types`` mixing full and sliding layers) get a dict of masks keyed by layer type,
which their forward takes in place of the masks it would build.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from decode.models.draft_vocab import support_logits
from decode.models.slots import SlotForest

__all__ = ["CachedLM", "attention_windows", "check_same_vocab", "context_limit", "load_causal_lm"]

# the layer types of config.layer_types this wrapper can run; any other (chunked, linear or recurrent attention,
# layers sharing another's cache) needs a mask or a cache this module does not build
_LAYER_TYPES = ("full_attention", "sliding_attention")

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

    ``forward_name`` is ``"hf"`` (HF's forward; :class:`~decode.models.fast_llama.FastCachedLM` says ``"fast"``), and
    ``fast_fallback`` why :func:`~decode.models.fast_llama.cached_lm` did not take the fast forward (None if not asked).

    Raises:
        ValueError: the model has neither sdpa nor eager attention, or attention this class's masks cannot express
            (see :func:`attention_windows`).
    """

    forward_name = "hf"
    fast_fallback: str | None = None
    kernel = "default"  # the linear layers' path (decode.models.kernels)
    # Steering (decode.models.steering). A target whose states steer a draft records, at every forward, the hidden
    # states entering the layers ``taps`` (HF hidden_states indices): ``tapped`` ``(n, len(taps), H)`` float32 of the
    # last forward, and one row per cached slot, kept through commits (:meth:`taps_at`). A steered draft holds its
    # link in ``steering``; every forward but a prefill adds the δ the link gives for its root (``steer``).
    taps: tuple[int, ...] = ()
    tapped: torch.Tensor | None = None
    steering = None
    _steer: torch.Tensor | None = None
    _up_bias = None
    _steerable = False
    _tap_rows: list[torch.Tensor] | None = None

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
        # per layer: its sliding window, None for full attention; and the window of each layer type of a hybrid model
        self._type_windows = attention_windows(self.config)
        layer_types = _layer_types(self.config.get_text_config(decoder=True))
        self._layer_windows: list[int | None] = [self._type_windows[t] for t in layer_types]
        self.reset()

    def use_kernel(self, name: str) -> int:
        """Run the model's linear layers through kernel path ``name`` (:mod:`decode.models.kernels`); the bytes of
        the copies it made.

        Raises:
            ValueError: an unknown path, or one that cannot run this model's weights here.
        """
        from decode.models.kernels import use_kernel

        nbytes = use_kernel(self.model, name)
        self.kernel = name
        return nbytes

    # --- steering -------------------------------------------------------------------------------------
    def attach_steering(self, steering, target: CachedLM | None = None) -> None:
        """Make this draft steerable by ``steering`` (a :class:`~decode.models.steering.SteeringMap`).

        With ``target`` (how a pair loads a steered draft) the draft is linked to it
        (:class:`~decode.models.steering.SteeringLink`): every forward but a prefill adds the δ of the target's states
        at the token before that forward's root, so whatever runs the pair (the decoding loop, the collector) does
        nothing for it. Without ``target``, forwards add whatever :attr:`steer` holds (the plumbing's tests)."""
        from decode.models.steering import SteeringLink

        self.steering = None if target is None else SteeringLink(steering.to(self.device).eval(), target)
        self._steerable = True
        self._enable_steer()

    def _enable_steer(self) -> None:
        """Let :attr:`steer` reach the forward: HF's forward takes it through hooks on the up projections."""
        from decode.models.steering import UpProjectionBias

        if self._up_bias is None:
            self._up_bias = UpProjectionBias(self.model)

    def _forward_at(self, ids: Sequence[int], allowed: np.ndarray | None, pos: np.ndarray | None,
                    output_hidden: bool, root: int | None):
        """:meth:`_forward` under the δ a linked draft takes for a forward whose root is position ``root`` (None: a
        prefill, unsteered); a target that taps keeps this forward's rows per slot."""
        if self.steering is None:
            out = self._forward(ids, allowed, pos, output_hidden)
        else:
            self.steer = None if root is None else self.steering.delta_before(root)
            try:
                out = self._forward(ids, allowed, pos, output_hidden)
            finally:
                self.steer = None  # whatever runs this model outside the pair (HF's assisted generation) runs unsteered
        if self.taps:
            if self._tap_rows is None:
                self._tap_rows = []
            self._tap_rows.extend(self.tapped)  # views of the forward's rows, one per new slot
        return out

    def taps_at(self, position: int) -> torch.Tensor | None:
        """``(len(taps), H)`` the states this target tapped at committed position ``position``; None where it has
        not committed that position (or taps nothing)."""
        if self._tap_rows is None or not 0 <= position < self.committed:
            return None
        return self._tap_rows[position]

    @property
    def steer(self) -> torch.Tensor | None:
        """The δ ``(L, d_ff)`` (model dtype) every forward adds to the draft's up projections; None: unsteered."""
        return self._steer

    @steer.setter
    def steer(self, delta: torch.Tensor | None) -> None:
        if delta is not None and not self._steerable:
            raise ValueError("steer set on a model without a steering map (attach_steering first)")
        self._steer = None if delta is None else delta.to(self.device, self.dtype)
        if self._up_bias is not None:
            self._up_bias.delta = self._steer

    @property
    def support(self) -> torch.Tensor | None:
        """The token ids ``(Vs,)`` where this model's logits can be finite (a draft vocabulary's,
        :class:`~decode.models.draft_vocab.SubsetHead`), or None: every id."""
        return getattr(self.model.get_output_embeddings(), "token_ids", None)

    # --- state ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the cache (no committed or speculative slots)."""
        self._new_cache()
        self.slots = SlotForest()
        self._tap_rows = None

    def _new_cache(self) -> None:
        """An empty key/value store (HF's DynamicCache here; a subclass may keep its own tensors).

        Built without the config, so every layer is a full ``DynamicLayer`` (created on its first update), sliding
        layers included: their window is the attention mask's business (:meth:`_block_patterns`), and a full layer
        rolls back slot by slot."""
        self._cache = DynamicCache()

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

    def parent_of(self, slot: int) -> int:
        """Parent slot of ``slot`` (``slot - 1`` for a committed slot; ``-1`` for slot 0)."""
        return self.slots.parent_of(slot)

    def position_of(self, slot: int) -> int:
        """Rotary position (depth in the sequence) of ``slot``."""
        return self.slots.position_of(slot)

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
        out = self._forward_at(ids, None, None, output_hidden, root=None)
        self.slots.append_committed(len(ids))
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
            out = self._forward_at(ids, None, None, output_hidden, root=self.length + n - 1)  # the last token
            self.slots.append_committed(n)
            return out
        if self.length == 0:
            raise ValueError("extend on an empty cache: use prefill or extend(commit=True)")
        return self.extend_tree(ids, [self.length - 1] + [-(j + 1) for j in range(n - 1)], output_hidden)

    def extend_tree(
        self, ids: Sequence[int], parents: Sequence[int], output_hidden: bool = False, on_support: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append a block of speculative tokens arranged as a tree.

        Args:
            ids: the n new tokens; token i goes to slot ``length + i`` (block order).
            parents: for each token, its parent: ``p >= 0`` is an **absolute slot** already in the cache (the
                committed tip ``committed - 1``, any speculative slot, or an earlier committed slot), and
                ``p = -(j + 1)`` (so ``-1, -2, ...``) is **token j of this block**, with ``j < i``. To hang a
                :class:`~decode.drafting.tree.DraftTree` (local parents, root = last cached slot) use
                :func:`block_parents`. The cache must not be empty (prefill first).
            output_hidden: also return the final hidden states.
            on_support: return logits ``(n, Vs)`` over :attr:`support` only (column i is token ``support[i]``),
                where the model has a draft vocabulary; without one, ``(n, V)`` as always.

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
        plan = self.slots.plan_block(parents)
        with support_logits(self.model) if on_support else nullcontext():
            # speculative tokens grow from the committed tip, the root of the step
            out = self._forward_at(ids, plan.allowed, plan.positions, output_hidden, root=self.committed - 1)
        self.slots.append(plan)
        return out

    def _forward(
        self, ids: Sequence[int], allowed: np.ndarray | None, pos: np.ndarray | None, output_hidden: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids`` after the cache. ``allowed (n, length + n)`` bool: which cached/new columns each new
        token sees (None = causal); ``pos (n,)``: position ids (None = ``length .. length + n - 1``)."""
        with torch.inference_mode():
            input_ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1).to(self.device)
            kwargs = {}
            if pos is None:
                pos = np.arange(self.length, self.length + len(ids), dtype=np.int64)
            patterns = self._block_patterns(allowed, pos)
            if patterns is not None:
                masks = {w: self._additive_mask(p)[None, None] for w, p in patterns.items()}
                if len(masks) == 1:  # one pattern serves every layer (HF passes a 4-D mask through unchanged)
                    kwargs["attention_mask"] = next(iter(masks.values()))
                else:  # a hybrid model: its forward picks each layer's mask by the layer's type
                    kwargs["attention_mask"] = {t: masks[w if w in masks else None]
                                                for t, w in self._type_windows.items()}
            kwargs["position_ids"] = torch.from_numpy(pos).view(1, -1).to(self.device)
            out = self.model(
                input_ids=input_ids,
                cache=self._cache,
                use_cache=True,
                output_hidden_states=output_hidden or bool(self.taps),
                **kwargs,
            )
            if self.taps:
                self.tapped = torch.stack([out.hidden_states[i][0] for i in self.taps], dim=1).float()
            logits = out.logits[0].float()
            if output_hidden:
                return logits, out.hidden_states[-1][0].float()
            return logits

    def _block_patterns(self, allowed: np.ndarray | None, pos: np.ndarray) -> dict[int | None, np.ndarray] | None:
        """Attention pattern of a block per window, or None where every layer may run its model's causal mask.

        Args:
            allowed: ``(n, length + n)`` bool, which cached and new slots each new token sees (its path), or None
                for a block that continues a linear cache.
            pos: ``(n,)`` the new tokens' positions.

        Returns:
            ``{window: (n, length + n) bool}``: key None is the pattern of full-attention layers and of sliding
            layers whose window reaches back to position 0 anyway; a window key is ``allowed`` cut to the slots
            whose position is within that window of the query's (positions count along the query's own path, as
            every visible slot is an ancestor). None when ``allowed`` is None and no window cuts.
        """
        cutting = sorted({w for w in self._layer_windows if w is not None and w <= int(pos.max())})
        if allowed is None:
            if not cutting:
                return None
            allowed = self._causal_pattern(len(pos), self.length)
        patterns: dict[int | None, np.ndarray] = {}
        if len(cutting) < len(set(self._layer_windows)):  # some layer sees the whole path
            patterns[None] = allowed
        if cutting:
            key_pos = np.concatenate([self.slots.positions(), pos])  # (length + n,)
            distance = pos[:, None] - key_pos[None, :]  # query position - key position
            for w in cutting:
                patterns[w] = allowed & (distance < w)
        return patterns

    def _layer_mask(self, layer: int, masks: dict[int | None, torch.Tensor]) -> torch.Tensor:
        """Layer ``layer``'s entry of a dict keyed like :meth:`_block_patterns`' (its window, else None)."""
        window = self._layer_windows[layer]
        return masks[window if window in masks else None]

    @staticmethod
    def _causal_pattern(n: int, start: int) -> np.ndarray:
        """``(n, start + n)`` bool: n tokens after ``start`` linear slots, each seeing every earlier slot and itself."""
        return np.concatenate([np.ones((n, start), dtype=bool), np.tri(n, dtype=bool)], axis=1)

    def _additive_mask(self, pattern: np.ndarray) -> torch.Tensor:
        """``(n, length + n)`` additive mask in the model dtype of a bool pattern (0 = attend, dtype min = blocked)."""
        blocked = torch.from_numpy(~pattern).to(self.device)
        return torch.zeros(blocked.shape, dtype=self.dtype, device=self.device).masked_fill_(blocked, self._mask_min)

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
        keep = self.slots.check_chain(keep_slots)
        k = len(keep)
        if keep != list(range(committed, committed + k)):
            with torch.inference_mode():
                self._move_slots(torch.tensor(keep, dtype=torch.long, device=self.device), committed)
        if self._tap_rows is not None:
            self._tap_rows[committed:] = [self._tap_rows[s] for s in keep]
        self._truncate(committed + k)
        self.slots.commit_moved(k)

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
        if self._tap_rows is not None:
            del self._tap_rows[length:]
        self._truncate(length)
        self.slots.crop(length)

    def _truncate(self, length: int) -> None:
        """Drop the key/value rows of slots at or after ``length`` (the slot bookkeeping is the caller's)."""
        remove = self.length - length
        if remove > 0:
            if length == 0:
                self._new_cache()
            else:
                self._cache.crop(-remove)


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
            a model that attends bidirectionally; :class:`CachedLM` would get these wrong.
    """
    text = config.get_text_config(decoder=True)
    if getattr(text, "use_bidirectional_attention", False) or not getattr(text, "is_causal", True):
        raise ValueError(f"{text.model_type} attends bidirectionally; CachedLM needs a causal LM")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise ValueError(f"{text.model_type} uses chunked attention, which CachedLM's masks do not implement")
    windows: dict[str, int | None] = {}
    for layer_type in _layer_types(text):
        if layer_type not in _LAYER_TYPES:
            raise ValueError(f"{text.model_type} has a {layer_type!r} layer; CachedLM runs only {_LAYER_TYPES}")
        window = text.sliding_window if layer_type == "sliding_attention" else None
        if layer_type == "sliding_attention" and (window is None or int(window) < 1):
            raise ValueError(f"{text.model_type} has sliding layers but sliding_window={window!r}")
        windows[layer_type] = None if window is None else int(window)
    return windows


def context_limit(config: PretrainedConfig) -> int:
    """Positions a model attends over: ``max_position_embeddings`` (unbounded if the config has none)."""
    return int(getattr(config, "max_position_embeddings", 1 << 30))


def block_parents(local_parents: Sequence[int], root_slot: int) -> list[int]:
    """Convert block-local parents (``-1`` = the root ``root_slot``, ``j >= 0`` = token j of the block) into the
    convention of :meth:`CachedLM.extend_tree` (absolute slot, or ``-(j + 1)`` for token j of the block).

    For a :class:`~decode.drafting.tree.DraftTree` ``t`` rooted at the last cached slot, the block is ``t.tokens[1:]``
    with ``block_parents([p - 1 for p in t.parents[1:]], cached.length - 1)``.
    """
    return [root_slot if p < 0 else -(p + 1) for p in local_parents]


def load_causal_lm(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Load a local causal LM directory (``config.json`` + safetensors weights) or a ``.gguf`` file, offline, with
    sdpa attention (eager where the model has no sdpa path, as Gemma2 for its softcapped attention scores).

    ``dtype`` defaults to fp32 on CPU and bf16 on CUDA. Remote code is never trusted.

    Raises:
        ValueError: the directory is missing, or has no ``config.json`` or no ``*.safetensors`` file, or a file in it
            cannot be read (a corrupt header, a config transformers does not know); a GGUF file transformers cannot
            read as a causal LM.
    """
    p = Path(path)
    dev = torch.device(device)
    if p.suffix.lower() == ".gguf":
        from decode.models.gguf import load_gguf_model

        return load_gguf_model(p, _default_dtype(dev, dtype)).to(dev)
    if p.exists() and not p.is_dir():
        raise ValueError(f"model {str(p)!r} is a file, not a model directory (an HF folder, or a .gguf file)")
    if not p.is_dir():
        raise ValueError(f"model directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise ValueError(f"model directory {str(p)!r} has no config.json")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model directory {str(p)!r} has no *.safetensors weights (only safetensors are loaded)")
    from safetensors import SafetensorError

    from ddte_core.quiet import quiet_transformers

    try:
        with quiet_transformers():  # a "Loading weights" bar per model is noise in every command's output
            model = AutoModelForCausalLM.from_pretrained(
                str(p),
                attn_implementation=None,  # transformers' default: sdpa, else eager (asking for "sdpa" refuses Gemma2)
                use_safetensors=True,
                local_files_only=True,
                trust_remote_code=False,
                dtype=_default_dtype(dev, dtype),
            )
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # a corrupt file, a config it cannot read
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model directory {str(p)!r} could not be loaded: {first}") from err
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
            "shared vocabulary (a draft of the target's own family and tokenizer)"
        )
    usable = min(vt, vd)
    if tokenizer_sizes is not None and tokenizer_sizes[0] > usable:
        raise ValueError(
            f"tokenizer size {tokenizer_sizes[0]} exceeds the smaller vocab_size {usable} (target {vt}, draft {vd})"
        )
    return usable
