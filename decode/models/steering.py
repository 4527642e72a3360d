"""A draft steered by its target's state (SD², algorithms.md §9): one file contract, the map, and the injection.

After each verification the target's hidden states entering a few of its layers (``target_layers``, HF's
``hidden_states`` indices: 0 is the embedding output, i the input of layer i) are read at the last accepted token,
the token whose output gave the bonus or correction token. They come out of the verification pass that already
ran. :class:`SteeringMap` turns them into one bias per draft layer,

    δ = out(LayerNorm(in(concat(states))))      in: (n_taps · d_T → rank), out: (rank → L · d_ff), zero-initialised

and every token the draft runs in the next step adds δ_l to its MLP's up projection:
``down(SiLU(gate·x) ⊙ (up·x + δ_l))``. The map is a low-rank bottleneck (SD²'s full-rank map, d_T → L·d_ff through
d_T, would outweigh a 1–10 M draft). ``out`` starts at zero, so a steered draft starts equal to its parent.

Lossless by construction: δ is known before the step drafts (it reads only the previous step's target pass), and
the verifier gets the q the draft sampled from, steered. Tests: exact enumeration through the real loop
(``tests/decode/exact/test_steering.py``) with a negative control that verifies under a stale δ.

The map lives beside the draft's weights as ``steering.safetensors``; :class:`SteeringSpec` owns its metadata,
among it the fingerprint of the target it was trained on: a steered draft is refused beside any other target.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ddte_core.paths import staged_file
from ddte_core.tensor_files import read_tensor_file
from decode.models.hooks import ForwardHook

FILE = "steering.safetensors"
FORMAT = "ddte-steering/1"


@dataclass(frozen=True)
class SteeringSpec:
    """What a steering map reads and writes.

    Attributes:
        target_layers: HF ``hidden_states`` indices of the target read at the last accepted token (layer inputs).
        target_hidden: the target's hidden size d_T.
        rank: the bottleneck's width.
        draft_layers: L, the draft's decoder layers (one bias each).
        draft_ffn: d_ff, the width of the draft's MLP up projection.
        target_fingerprint: :func:`decode.pair.model_fingerprint` of the target it was trained with ("" = unchecked).
        max_offset: the largest step offset k trained (token t steered by the state at t − k, k in 1..max_offset).
    """

    target_layers: tuple[int, ...]
    target_hidden: int
    rank: int
    draft_layers: int
    draft_ffn: int
    target_fingerprint: str = ""
    max_offset: int = 8

    def __post_init__(self) -> None:
        if not self.target_layers or min(self.target_layers) < 0:
            raise ValueError("steering needs at least one target layer index >= 0")
        if min(self.target_hidden, self.rank, self.draft_layers, self.draft_ffn, self.max_offset) < 1:
            raise ValueError("steering sizes (target_hidden, rank, draft_layers, draft_ffn, max_offset) must be >= 1")

    def check_target(self, fingerprint: str) -> None:
        """ValueError unless ``fingerprint`` is the target this map was trained with."""
        if self.target_fingerprint and fingerprint != self.target_fingerprint:
            raise ValueError(f"this steered draft was trained with another target (fingerprint "
                             f"{self.target_fingerprint[:12]}, the pair's is {fingerprint[:12]}); pair it with its "
                             "own target, or delete steering.safetensors to use the draft unsteered")


class SteeringMap(nn.Module):
    """Target states ``(..., n_taps, d_T)`` -> per-layer draft biases δ ``(..., L, d_ff)``."""

    def __init__(self, spec: SteeringSpec) -> None:
        super().__init__()
        self.spec = spec
        taps = len(spec.target_layers)
        self.inp = nn.Linear(taps * spec.target_hidden, spec.rank)
        self.norm = nn.LayerNorm(spec.rank)
        self.out = nn.Linear(spec.rank, spec.draft_layers * spec.draft_ffn, bias=False)
        nn.init.zeros_(self.out.weight)  # δ = 0: the steered draft starts as its parent

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        flat = states.reshape(*states.shape[:-2], -1).to(self.inp.weight.dtype)  # (..., n_taps · d_T)
        delta = self.out(self.norm(self.inp(flat)))  # (..., L · d_ff)
        return delta.view(*delta.shape[:-1], spec.draft_layers, spec.draft_ffn)

    def step_delta(self, states: torch.Tensor) -> torch.Tensor:
        """δ ``(L, d_ff)`` for one decoding step, from the target's states ``(n_taps, d_T)`` at one token."""
        with torch.inference_mode():
            return self(states)

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/steering.safetensors`` atomically (weights in float32, the spec as metadata)."""
        from safetensors.torch import save_file

        path = Path(folder) / FILE
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        spec = asdict(self.spec)
        spec["target_layers"] = list(spec["target_layers"])
        with staged_file(path) as tmp:
            save_file(tensors, tmp, metadata={"format": FORMAT, "spec": json.dumps(spec)})
        return path

    @classmethod
    def load(cls, folder: str | Path) -> SteeringMap | None:
        """The map saved in ``folder`` (float32, CPU), or None when it has none; ValueError for a bad file."""
        path = Path(folder) / FILE
        if not path.is_file():
            return None
        tensors, meta = read_tensor_file(path, FORMAT, "steering map")
        raw = json.loads(meta["spec"])
        raw["target_layers"] = tuple(raw["target_layers"])
        steering = cls(SteeringSpec(**raw))
        try:
            steering.load_state_dict(tensors)
        except RuntimeError as error:
            raise ValueError(f"{path}: weights do not match its spec ({error})") from error
        return steering.eval()


class TargetTaps(ForwardHook):
    """The target's end of steering: the states entering layers ``layers`` (HF ``hidden_states`` indices) at every
    cached slot, kept through commits and crops, so a draft can read the target's state at any committed position."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.tap_layers = tuple(layers)
        self._rows: list[torch.Tensor] = []  # (len(layers), H) per cached slot, views of each forward's states

    def tapped(self, states: torch.Tensor) -> None:
        self._rows.extend(states)

    def committed(self, first: int, keep: list[int]) -> None:
        self._rows[first:] = [self._rows[s] for s in keep]

    def cropped(self, length: int) -> None:
        del self._rows[length:]

    def reset(self) -> None:
        self._rows = []

    def row(self, slot: int) -> torch.Tensor:
        """``(len(layers), H)`` the states tapped at cached slot ``slot``."""
        return self._rows[slot]


class SteeringLink(ForwardHook):
    """The draft's end of steering: the δ of each draft forward, from the target's taps.

    A forward whose root is position r (the token the step drafts from: the last token of a committed run, the
    committed tip under a speculative block) adds δ(target's states at r − 1). In the decoding loop r − 1 is the
    previous step's last accepted token, which the target committed when it verified that step; in the collector it is
    the trajectory token before the root. A prefill, and a root with no committed target state before it (a one-token
    prompt's first step), run unsteered. δ is kept for the last state it was computed from, so every forward of one
    step costs one map evaluation.

    Args:
        steering: the map.
        target: the target (a :class:`~decode.models.cached_lm.CachedLM`) whose hook is a :class:`TargetTaps` of the
            map's layers.
    """

    def __init__(self, steering: SteeringMap, target) -> None:
        self.map, self.target = steering, target
        self._state: torch.Tensor | None = None
        self._delta: torch.Tensor | None = None

    @property
    def spec(self) -> SteeringSpec:
        return self.map.spec

    def up_bias(self, root: int | None) -> torch.Tensor | None:
        """δ ``(L, d_ff)`` for a draft forward rooted at position ``root``; None: unsteered."""
        if root is None or not 0 <= root - 1 < self.target.committed:
            return None
        state = self.target.hook.row(root - 1)
        if state is not self._state:
            self._state, self._delta = state, self.map.step_delta(state)
        return self._delta


def link_steering(draft, target, steering: SteeringMap) -> SteeringLink:
    """Steer ``draft`` by ``steering`` from ``target``'s states (both :class:`~decode.models.cached_lm.CachedLM`):
    the target taps the map's layers (its hook), the draft adds the δ its link gives (its hook), so whatever runs the
    pair (the decoding loop, the collector) does nothing for it.

    Raises:
        ValueError: the target already taps other layers for another steered draft.
    """
    layers = tuple(steering.spec.target_layers)
    taps = target.hook
    if taps is None:
        target.hook = TargetTaps(layers)
    elif not isinstance(taps, TargetTaps) or taps.tap_layers != layers:
        raise ValueError(f"the target already has a hook ({type(taps).__name__}); a second steered draft must read "
                         "the same target layers")
    draft.hook = SteeringLink(steering.to(draft.device).eval(), target)
    return draft.hook


def draft_mlp_shape(model) -> tuple[int, int]:
    """``(L, d_ff)`` of a Llama-family draft: its decoder layers and the width of their MLP up projection."""
    layers = model.model.layers
    return len(layers), int(layers[0].mlp.up_proj.out_features)


def check_compatible(steering: SteeringMap, draft_model, target_config) -> None:
    """ValueError unless the map's sizes fit this draft and target (layers to read, widths)."""
    spec = steering.spec
    if draft_mlp_shape(draft_model) != (spec.draft_layers, spec.draft_ffn):
        raise ValueError(f"steering map made for a draft of {spec.draft_layers} layers × {spec.draft_ffn} MLP "
                         f"units, this draft has {draft_mlp_shape(draft_model)}")
    text = target_config.get_text_config(decoder=True)
    if int(text.hidden_size) != spec.target_hidden or max(spec.target_layers) > int(text.num_hidden_layers):
        raise ValueError(f"steering map reads target layers {list(spec.target_layers)} of width "
                         f"{spec.target_hidden}; the target has {text.num_hidden_layers} layers of width "
                         f"{text.hidden_size}")
