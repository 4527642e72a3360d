"""Linear-layer kernels: the one owner of how a model's matrices are multiplied on this machine.

A decoder pass is its linear layers. On a CPU the kernel behind them decides whether a pass over a tree of 8 tokens
costs 1.2× or 3× a one-token pass (docs/pairs.md has the figures per CPU): MKL's sgemm behind ``F.linear`` has a slow
band at M = 4–8 rows; the same weights prepacked once for oneDNN are nearly flat; a dynamically quantized int8 product
reads a quarter of fp32's bytes. Which pays is the machine's business, so :mod:`decode.models.kernel_choice` measures
the paths offered here on the passes the loop runs and picks one per model role.

Whether a path runs at all is the machine's business too: oneDNN prepacks bf16 only where the CPU has AVX-512 (BW,
VL, DQ) or AVX-NE-CONVERT, and says so by raising. :meth:`KernelPath.unavailable` therefore tries each path once per
process on a tiny matrix of the dtype asked (:func:`trial_failure`), never trusting the dtype alone.

A :class:`KernelPath` turns one ``(weight (N, K), bias (N,) | None)`` into a :class:`PreparedLinear`, a callable
``x (M, K) -> (M, N)`` in the weight's dtype. Both forwards take them: HF's through :func:`use_kernel` (each
``nn.Linear`` of the model swapped for a :class:`KernelLinear`), the draft's fast forward
(:class:`~decode.models.fast_llama.FastCachedLM`) by preparing its fused matrices.

Exact paths (``exact=True``) compute the same product from the same weights in the same dtype: their results differ
from ``F.linear``'s by float rounding only, so a target may take them and keep its own law. The int8 paths change
the product (another q): only a draft takes them, and the drafting loop samples from the q they give and hands that
q to the verifier, so decoding stays exactly lossless (``tests/decode/exact/test_int8_draft.py``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decode.models.release import ReleasedLinear, drop_weight, own_mapped, shared_weights

__all__ = ["KERNEL_PATHS", "KernelLinear", "KernelPath", "PreparedLinear", "kernel_path", "linear_modules",
           "stock_kernels", "use_kernel"]

DEFAULT = "default"
_TINY = torch.finfo(torch.float32).tiny  # a zero row's scale: its output is the bias


class PreparedLinear:
    """One matrix ready for a kernel: ``self(x (M, K)) -> (M, N)``, in the input's float dtype.

    Attributes:
        path: the :class:`KernelPath`'s name.
        nbytes: bytes of the copies this path made (0 where it reads the weight as it is).
        out_features: N.
        reads_weight: whether ``run`` also reads the stock weight (then it may not be released).
    """

    def __init__(self, path: str, run: Callable[[torch.Tensor], torch.Tensor], out_features: int,
                 nbytes: int = 0, reads_weight: bool = False) -> None:
        self.path, self._run, self.out_features, self.nbytes = path, run, out_features, nbytes
        self.reads_weight = reads_weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)


@dataclass(frozen=True)
class KernelPath:
    """A way to multiply by a weight matrix.

    Attributes:
        name: how configs and ``--kernels`` name it.
        exact: the same product from the same weights in the same dtype (float rounding aside): a target may take it.
        summary: one line for ``--help`` and the pair card.
        dtypes: the weight dtypes it runs (others are refused by :meth:`unavailable`).
        prepare_fn: ``(weight, bias) -> (run, nbytes)``.
        probe: what must exist in this torch build (None: always there).
        reads_weight: ``run`` reads the stock weight besides its own copy.
    """

    name: str
    exact: bool
    summary: str
    dtypes: tuple[torch.dtype, ...]
    prepare_fn: Callable[[torch.Tensor, torch.Tensor | None], tuple[Callable, int]]
    probe: Callable[[], bool] | None = None
    reads_weight: bool = False

    def unavailable(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why this path cannot run weights of ``dtype`` on ``device`` (None when it can): the dtypes it takes, the
        torch build, then one trial on this machine (:func:`trial_failure`, once per process)."""
        if self.name != DEFAULT and device.type != "cpu":
            return f"{self.name} is a CPU kernel"
        if dtype not in self.dtypes:
            return f"{self.name} runs {', '.join(str(d).removeprefix('torch.') for d in self.dtypes)} weights"
        if self.probe is not None and not self.probe():
            return f"this torch build has no {self.name} kernel"
        if self.name == DEFAULT:
            return None
        failure = trial_failure(self, dtype)
        return None if failure is None else f"{self.name} cannot run {str(dtype).removeprefix('torch.')} on this " \
            f"CPU ({failure})"

    @property
    def owns_copy(self) -> bool:
        """Its prepared copy is all it reads: the stock weight may be given back (decode/models/release.py)."""
        return self.name != DEFAULT and not self.reads_weight

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PreparedLinear:
        """``weight (N, K)`` and ``bias (N,)`` (or None) ready for this path. The caller checks :meth:`unavailable`.
        A path that owns its copy holds a copy of the bias too, never a view: its stock tensors may then be given
        back whole (decode/models/release.py)."""
        with torch.no_grad():
            if bias is not None:
                bias = bias.detach().clone() if self.owns_copy else bias.detach()
            run, nbytes = self.prepare_fn(weight.detach(), bias)
        return PreparedLinear(self.name, run, weight.shape[0], nbytes, self.reads_weight)


@functools.cache
def trial_failure(path: KernelPath, dtype: torch.dtype) -> str | None:
    """Why ``path`` failed one tiny product of ``dtype`` on this CPU (its first line), None when the product ran and
    came out the right shape and finite. Cached per process: the answer is the machine's and the torch build's."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 32, generator=g).to(dtype)
    x = torch.randn(3, 32, generator=g).to(dtype)
    try:
        out = path.prepare(weight, torch.zeros(16, dtype=dtype))(x)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
        lines = str(err).strip().splitlines()
        return lines[0][:200] if lines else type(err).__name__
    if out.shape != (3, 16) or not bool(torch.isfinite(out).all()):
        return "its trial product came out wrong"
    return None


def _flat(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run`` over 2-D input, applied to ``x (..., K)`` (HF's modules pass ``(batch, M, K)``)."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return run(x)
        return run(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    return apply


def _prepare_default(weight, bias):
    return (lambda x: F.linear(x, weight, bias)), 0


def _prepare_onednn(weight, bias):
    # one reorder into oneDNN's blocked layout; every call then skips MKL's per-call packing and its slow small-M band
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    pointwise = torch.ops.mkldnn._linear_pointwise

    def run(x):
        return pointwise(x.contiguous(), packed, bias, "none", [], "")

    return _flat(run), packed.numel() * packed.element_size()


def _prepare_onednn_wide(weight, bias):
    # one-token passes on F.linear, wider ones on the oneDNN copy: both exact, and on some CPUs (fp32 without AVX-512)
    # each wins its own
    packed, nbytes = _prepare_onednn(weight, bias)

    def run(x):
        if x.numel() == x.shape[-1]:
            return F.linear(x, weight, bias)
        return packed(x)

    return run, nbytes


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight (N, K)``: ``(q (N, K) int8, scale (N,) float32)``,
    ``weight ≈ scale[:, None] · q``."""
    scale = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def _prepare_int8_dynamic(weight, bias):
    # fbgemm's dynamic W8A8 product (what torch.ao's quantize_dynamic runs), reached through its ops: the activations
    # are quantized per call, so the product differs from the float one (a draft's path only). fbgemm picks one
    # activation scale for the whole input; a row's q must not depend on the rows beside it (another request's in a
    # batch: a seeded request would draw otherwise than alone), so each row is scaled to max |x| = 1 and carries two
    # more columns, +1 and -1, against zero weights: every input then spans exactly [-1, 1], one scale for every
    # batch, and the row's own scale multiplies its output back. The integer product is exact, so a row's output is
    # the same bits alone or beside any others (tests/decode/models/test_kernels.py). Building the quantized weight
    # goes through a quantized tensor, whose creation warns that it is deprecated; nothing else here is.
    q, scale = _int8_rows(weight)
    k = q.shape[1]
    padded = torch.cat([q, q.new_zeros(q.shape[0], 2)], dim=1).contiguous()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        zero = torch.zeros_like(scale, dtype=torch.long)
        quantized = torch._make_per_channel_quantized_tensor(padded, scale.double(), zero, 0)
        packed = torch.ops.quantized.linear_prepack(quantized, None)
    dynamic = torch.ops.quantized.linear_dynamic
    dtype = weight.dtype
    shift = None if bias is None else bias.float()
    ends = torch.tensor([[1.0, -1.0]])

    def run(x):
        x = x.float()
        top = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(_TINY)
        rows = x.new_empty(x.shape[0], k + 2)
        torch.div(x, top, out=rows[:, :k])
        rows[:, k:] = ends
        out = dynamic(rows, packed, True).mul_(top)  # reduce_range: 7-bit activations, exact on non-VNNI CPUs
        if shift is not None:
            out.add_(shift)
        return out if dtype == torch.float32 else out.to(dtype)

    return _flat(run), padded.numel() + scale.numel() * 4


def _prepare_int8_weight(weight, bias):
    # int8 weights, float activations: torch._weight_int8pack_mm streams half (bf16) or a quarter (fp32) of the bytes
    q, scale = _int8_rows(weight)
    scale = scale.to(weight.dtype)

    def run(x):
        out = torch._weight_int8pack_mm(x.contiguous(), q, scale)
        return out if bias is None else out + bias

    return _flat(run), q.numel() + scale.numel() * scale.element_size()


def _has_dynamic_int8() -> bool:
    engines = torch.backends.quantized.supported_engines
    return hasattr(torch.ops.quantized, "linear_dynamic") and ("fbgemm" in engines or "x86" in engines)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

KERNEL_PATHS: dict[str, KernelPath] = {
    path.name: path
    for path in (
        KernelPath(DEFAULT, True, "F.linear as the model runs it (MKL sgemm for fp32 on CPU)", _FLOATS,
                   _prepare_default),
        KernelPath("onednn", True, "the same weights prepacked once for oneDNN (fp32, or bf16 where the CPU has it)",
                   (torch.float32, torch.bfloat16), _prepare_onednn, lambda: torch.backends.mkldnn.is_available()),
        KernelPath("onednn-wide", True, "F.linear for one-token passes, the oneDNN copy for wider ones (keeps "
                   "both)", (torch.float32, torch.bfloat16), _prepare_onednn_wide,
                   lambda: torch.backends.mkldnn.is_available(), reads_weight=True),
        KernelPath("int8-dynamic", False, "dynamic int8 (weights per channel, activations per row; fbgemm)",
                   (torch.float32, torch.bfloat16), _prepare_int8_dynamic, _has_dynamic_int8),
        KernelPath("int8-weight", False, "int8 weights, float activations (torch._weight_int8pack_mm)",
                   (torch.float32, torch.bfloat16), _prepare_int8_weight),
    )
}


def kernel_path(name: str) -> KernelPath:
    """The path called ``name``; ValueError listing the known ones."""
    if name not in KERNEL_PATHS:
        raise ValueError(f"unknown kernel path {name!r} (one of: {', '.join(KERNEL_PATHS)})")
    return KERNEL_PATHS[name]


class KernelLinear(nn.Module):
    """An ``nn.Linear`` of an HF model, run through a :class:`PreparedLinear`.

    The module keeps the layer's ``weight`` and ``bias`` (tied weights, ``model.dtype`` and HF's generation utilities
    read them) unless they were given back (decode/models/release.py). :func:`stock_kernels` routes it back through
    ``F.linear`` for a baseline on the stock model.
    """

    def __init__(self, linear: nn.Linear, prepared: PreparedLinear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.prepared = prepared
        self.stock = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stock:
            if self.weight.shape[-1] != self.in_features:
                raise ValueError("this layer's stock weights were released (decode/models/release.py)")
            return F.linear(x, self.weight, self.bias)
        return self.prepared(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.prepared.path}"


def linear_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear | KernelLinear]]:
    """``(parent, attribute, module)`` of every ``nn.Linear`` (or :class:`KernelLinear`) in ``model``."""
    found: list[tuple[nn.Module, str, nn.Linear | KernelLinear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear | KernelLinear):
                found.append((parent, name, child))
    return found


def use_kernel(model: nn.Module, name: str, release: bool = False) -> int:
    """Run every linear layer of ``model`` through path ``name`` (in place; ``default`` restores plain ``nn.Linear``
    layers). Returns the bytes of the copies the path made.

    ``release`` (a path that :attr:`~KernelPath.owns_copy` only): each layer's stock weight is given back as soon as
    its copy is made, then every other tensor viewing the loaded file is copied (decode/models/release.py); the
    model then runs on ``name`` for good, never stock.

    Raises:
        ValueError: an unknown path, one that cannot run this model's weights here, or a model whose stock weights
            were given back.
    """
    path = kernel_path(name)
    modules = linear_modules(model)
    if any(module.weight.numel() == 0 for _, _, module in modules) or any(isinstance(module, ReleasedLinear)
                                                                         for module in model.modules()):
        raise ValueError("this model's stock weights were given back: it stays on the kernel path it runs")
    release = release and path.owns_copy
    if release:
        keep = shared_weights(model)
        # the largest first (an output head): its source and its copy are held together while little else is
        modules.sort(key=lambda found: -found[2].weight.numel())
    nbytes = 0
    for parent, attribute, module in modules:
        weight, bias = module.weight, module.bias
        reason = path.unavailable(weight.dtype, weight.device)
        if reason is not None:
            raise ValueError(reason)
        replacement: nn.Module
        if name == DEFAULT:
            replacement = _as_linear(module)
        else:
            prepared = path.prepare(weight, bias)
            nbytes += prepared.nbytes
            replacement = KernelLinear(module if isinstance(module, nn.Linear) else _as_linear(module), prepared)
        # hooks stay with the layer (a steered draft's up-projection bias is one): the same dicts, so their handles
        # still remove them
        replacement._forward_hooks, replacement._forward_pre_hooks = module._forward_hooks, module._forward_pre_hooks
        setattr(parent, attribute, replacement)
        if release:
            drop_weight(parent, attribute, keep)
    if release:
        own_mapped(model)
    return nbytes


def _as_linear(module: nn.Linear | KernelLinear) -> nn.Linear:
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta",
                       dtype=module.weight.dtype)
    linear.weight, linear.bias = module.weight, module.bias
    return linear


class stock_kernels:  # noqa: N801 - a context manager named as what it gives
    """Inside ``with stock_kernels(model):`` every :class:`KernelLinear` of ``model`` runs ``F.linear`` on its own
    weights: the stock model, for baselines such as HF ``generate`` (what users have)."""

    def __init__(self, model: nn.Module) -> None:
        self._modules = [m for _, _, m in linear_modules(model) if isinstance(m, KernelLinear)]

    def __enter__(self) -> stock_kernels:
        for module in self._modules:
            module.stock = True
        return self

    def __exit__(self, *exc) -> None:
        for module in self._modules:
            module.stock = False


def release_stock_weights(model: nn.Module) -> int:
    """Drop the stock weight of every :class:`KernelLinear` whose path runs on its own copy (decode/models/release.py
    :func:`drop_weight`; a weight :func:`shared_weights` keeps stays), then, where one went, own every other
    mapped tensor (:func:`own_mapped`); the bytes of stock weights freed. For a model already on its final path
    (a collection worker never runs the stock target; two hold a 1.5B fp32 target in 24 GiB only so)."""
    keep = shared_weights(model)
    freed = 0
    for parent, attribute, module in linear_modules(model):
        if isinstance(module, KernelLinear) and module.prepared.nbytes > 0 and not module.prepared.reads_weight:
            freed += drop_weight(parent, attribute, keep)
    if freed:
        own_mapped(model)
    return freed
