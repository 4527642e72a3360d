"""What one outside object may do at a model's forwards: the contract between a cached model and steering.

A :class:`~decode.models.cached_lm.CachedLM` runs with at most one :class:`ForwardHook` (``lm.hook``). At every forward
the hook may add a bias to the MLP up projections (a steered draft's δ) and read the hidden states entering chosen
layers (a target that steers a draft keeps them per cached slot, so it hears of commits, crops and resets). The two
ends of SD² steering are hooks (:mod:`decode.models.steering`); a model without one runs exactly as HF's.
"""

from __future__ import annotations

import torch


class ForwardHook:
    """A model's one outside hook; every method is a no-op here, so a hook overrides only what it uses.

    Attributes:
        tap_layers: HF ``hidden_states`` indices (0 = the embedding output, i = the input of layer i, L = the final
            normed state) whose rows :meth:`tapped` receives after each forward.
    """

    tap_layers: tuple[int, ...] = ()

    def up_bias(self, root: int | None) -> torch.Tensor | None:
        """``(L, d_ff)`` added to every layer's MLP up projection in a forward rooted at position ``root`` (None: a
        prefill); None adds nothing."""
        return None

    def tapped(self, states: torch.Tensor) -> None:
        """``(n, len(tap_layers), H)`` float32: the states of the forward's n new slots, in slot order."""

    def committed(self, first: int, keep: list[int]) -> None:
        """The cache committed speculative slots ``keep`` into slots ``first, first + 1, ...``; later slots dropped."""

    def cropped(self, length: int) -> None:
        """The cache dropped every slot at or after ``length``."""

    def reset(self) -> None:
        """The cache was emptied."""


class UpProjectionBias:
    """Adds a per-layer bias to HF draft MLPs' up projections through forward hooks (HF's forward, and training).

    ``delta`` is None (no steering) or ``(..., L, d_ff)``: ``(L, d_ff)`` for one step of decoding (every token
    alike), ``(B, n, L, d_ff)`` in training (a bias per position).
    """

    def __init__(self, model) -> None:
        self.delta: torch.Tensor | None = None
        self._handles = [layer.mlp.up_proj.register_forward_hook(self._hook(i))
                         for i, layer in enumerate(model.model.layers)]

    def _hook(self, layer: int):
        def add(_module, _inputs, output):
            if self.delta is None:
                return output
            return output + self.delta[..., layer, :].to(output.dtype)
        return add

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
