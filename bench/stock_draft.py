"""The draft of the ``hf-assisted`` baseline: the pair's draft in the dtype that runs fastest *stock* on this machine.

A user of HF assisted generation loads the draft as HF ships it (every linear layer on ``F.linear``) in whichever
dtype runs fastest on their machine. On a CPU without native bf16 (no AVX-512 BF16 or AMX,
:func:`ddte_core.machine.native_bf16_cpu`) bf16 products are emulated and slow, so running the pair's bf16 draft there
would flatter ddte against the baseline. ``hf-assisted`` therefore times a few one-token and short passes of the stock
draft in its own dtype and in float32, once per bench, and runs float32 only where it is measurably faster
(:data:`FASTER`); ties keep the draft's own dtype, so the choice is deterministic given the timings. The float32
draft is a separate copy: the pair's draft, which every other method runs, is not touched.
``hf-assisted-own`` runs the draft as the pair loads it, whatever its dtype; every assisted row records its draft's
dtype (``draft_dtype``), and ``hf-assisted``'s row also the timings it chose on (``draft_dtype_choice``).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from decode.models.kernels import stock_kernels, use_kernel

FASTER = 1.05  # float32 replaces the draft's own dtype only when its passes take under 1 / FASTER of the time
SHORT = 8  # tokens of the short pass (HF's assistant re-reads a few tokens after a rejection); the other is one token
REPEATS = 3  # timed passes of each length per dtype (the median), after one untimed warm-up


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of a model's first floating-point parameter."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


@dataclass(frozen=True)
class BaselineDraft:
    """The draft ``hf-assisted`` runs and why.

    Attributes:
        model: the pair's own draft module, or a float32 copy of it on plain ``nn.Linear`` layers.
        own: the dtype the pair loaded its draft in.
        ms: milliseconds of one one-token pass plus one short pass of the stock draft, per dtype name (empty where
            nothing was measured: a float32 draft, or a GPU).
        native_bf16: whether this CPU runs bf16 products natively (None on a GPU).
    """

    model: nn.Module
    own: torch.dtype
    ms: dict[str, float] = field(default_factory=dict)
    native_bf16: bool | None = None

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.model)

    def record(self) -> dict:
        """What ``hf-assisted``'s row says of its draft."""
        return {"draft_dtype": dtype_name(self.dtype),
                "draft_dtype_choice": {"own_dtype": dtype_name(self.own), "stock_pass_ms": dict(self.ms),
                                       "float32_when_faster_by": FASTER, "native_bf16": self.native_bf16}}

    def line(self) -> str:
        """One line for the bench's notes."""
        chosen, own = dtype_name(self.dtype), dtype_name(self.own)
        if not self.ms:
            why = f"as the pair loads it (not timed: {'a GPU' if self.native_bf16 is None else 'already float32'})"
        else:
            timings = ", ".join(f"{name} {ms:.1f} ms" for name, ms in self.ms.items())
            cpu = "with" if self.native_bf16 else "without"
            why = (f"the faster stock dtype here ({cpu} native bf16; a 1-token plus a {SHORT}-token pass: {timings}; "
                   f"float32 only when over {FASTER - 1:.0%} faster)")
        return f"hf-assisted runs its draft in {chosen}, {why}; hf-assisted-own in {own}, as the pair loads it"


def float32_copy(model: nn.Module) -> nn.Module:
    """A float32 copy of ``model`` on plain ``nn.Linear`` layers (the stock model), sharing no tensor with it; each
    floating-point tensor is converted as it is copied (tied weights stay tied), never held twice in its own dtype."""
    memo: dict[int, object] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            data = tensor.detach().float() if tensor.is_floating_point() else tensor.detach().clone()
            memo[id(tensor)] = nn.Parameter(data, requires_grad=False) if isinstance(tensor, nn.Parameter) else data
    for module in model.modules():  # a kernel path's prepacked copy is not the stock model's: left out, not copied
        if getattr(module, "prepared", None) is not None:
            memo[id(module.prepared)] = None
    duplicate = copy.deepcopy(model, memo)
    use_kernel(duplicate, "default")
    if hasattr(duplicate, "config"):
        duplicate.config.dtype = torch.float32
    return duplicate.eval()


def stock_pass_ms(model: nn.Module, timer: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds of one one-token pass plus one :data:`SHORT`-token pass of ``model`` on ``F.linear`` (medians of
    :data:`REPEATS` after a warm-up), on fixed token ids, without a cache."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    device = next(model.parameters()).device
    ids = (torch.arange(1, SHORT + 1, device=device) % vocab).unsqueeze(0)
    total = 0.0
    with stock_kernels(model), torch.inference_mode():
        for length in (1, SHORT):
            times = []
            for repeat in range(REPEATS + 1):
                start = timer()
                model(input_ids=ids[:, :length], use_cache=False)
                if repeat:
                    times.append(timer() - start)
            total += statistics.median(times)
    return 1000 * total


def fastest_stock_draft(model: nn.Module, device: torch.device,
                        measure: Callable[[nn.Module], float] | None = None) -> BaselineDraft:
    """The draft ``hf-assisted`` runs: ``model`` itself, or its float32 copy where that runs faster stock on this CPU
    (:data:`FASTER`). ``measure``: milliseconds of a model's stock passes (default :func:`stock_pass_ms`). A float32
    draft, or one on a GPU, is kept as it is, unmeasured."""
    own = model_dtype(model)
    if device.type != "cpu":
        return BaselineDraft(model, own)
    from ddte_core.machine import native_bf16_cpu

    native = native_bf16_cpu()
    if own == torch.float32:
        return BaselineDraft(model, own, native_bf16=native)
    measure = measure or stock_pass_ms
    candidate = float32_copy(model)
    ms = {dtype_name(own): measure(model), "float32": measure(candidate)}
    faster = ms["float32"] * FASTER < ms[dtype_name(own)]
    return BaselineDraft(candidate if faster else model, own, ms, native)


def draft_dtypes_note(rows: list[dict]) -> str:
    """``assisted drafts: hf-assisted float32, hf-assisted-own bfloat16`` from bench rows (each method once); empty
    without an assisted row."""
    dtypes = {row["method"]: row["draft_dtype"] for row in rows if row.get("draft_dtype")}
    return ("assisted drafts: " + ", ".join(f"{method} {dtype}" for method, dtype in dtypes.items())) if dtypes else ""
