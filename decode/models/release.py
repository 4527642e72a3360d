"""Giving a model's stock weights back once its kernels hold their own copies.

A model loaded from safetensors maps its file (copy-on-write, :func:`decode.models.loading.load_causal_lm`): every
parameter views that one mapping, and every page a pass or a kernel's preparation read stays in the process's
resident memory for as long as any tensor views the file. Once a layer runs on a kernel path that reads only its own
copy (:attr:`decode.models.kernels.KernelPath.owns_copy`), the stock weight is read by nothing. A process that never
runs the stock model (``ddte serve``, a bench without HF rows) gives it back:

* :func:`drop_weight`: a layer's stock weight dropped as soon as its copy is made, and the pages the mapping read for
  it given back at once (``madvise(MADV_DONTNEED)``): the mapping itself lives until its last tensor goes, so
  without this a model's kernels would cost a second copy of the model at their peak, not one matrix;
* :func:`own_mapped`: every other tensor that views the mapping (norms, biases) replaced by a copy in the process's
  own memory, made slice by slice with each slice's pages given back, except the embedding tables. A lookup reads a
  few rows of a table: left in the file, with the pages a kernel's preparation read of it (a tied head) given back,
  it costs the rows read, where a copy would cost all of it (0.7 GB of the Qwen2.5-Coder pair's two tables). The
  tables are then the only tensors that view the file.

Only pages of a private mapping of a ``*.safetensors`` file are ever given back: those wholly inside a tensor's bytes
as it is dropped or copied (:func:`give_back`), then, once only the tables view the file, every page of the mapping
(:func:`_sweep`) unless one is the process's own (a copy-on-write copy of a page something wrote; no ddte code writes
a loaded weight). A page given back that is read again is read from the file, which holds the same bytes: nothing is
lost but the memory. Memory of the process's own is never touched. Where ``/proc/self/maps`` does not exist (not
Linux), nothing is given back and nothing copied; the weights are still dropped.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch
from torch import nn

__all__ = ["ReleasedLinear", "drop_weight", "give_back", "mapped_ranges", "own_mapped", "shared_weights"]

SLICE_BYTES = 64 << 20  # an owned copy is made this much at a time: its source's pages go back as it grows
_PAGE = mmap.PAGESIZE


def mapped_ranges() -> list[tuple[int, int]]:
    """``[start, end)`` address ranges of this process's private mappings of ``*.safetensors`` files (empty where
    ``/proc/self/maps`` is not there). Read afresh by every caller: a mapping goes when its last tensor does."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        if len(fields) == 6 and fields[5].endswith(".safetensors") and fields[1].endswith("p"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def is_mapped(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether ``tensor``'s first byte lies in one of ``ranges`` (:func:`mapped_ranges`)."""
    ptr = tensor.data_ptr()
    return tensor.device.type == "cpu" and tensor.numel() > 0 and any(lo <= ptr < hi for lo, hi in ranges)


def give_back(tensor: torch.Tensor) -> int:
    """Give back the pages wholly inside contiguous ``tensor``'s bytes where they lie in a mapped safetensors file
    (:func:`mapped_ranges`); the bytes given back (0 for a tensor of the process's own memory). The caller reads
    ``tensor`` no more; were it read, its pages would be read from the file again."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    first = -(-start // _PAGE) * _PAGE
    last = (start + tensor.numel() * tensor.element_size()) // _PAGE * _PAGE
    if last <= first or not any(lo <= first and last <= hi for lo, hi in mapped_ranges()):
        return 0
    return _advise(first, last)


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def owned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous ``tensor`` in the process's own memory, made :data:`SLICE_BYTES` at a time, each slice's
    source pages given back once copied: the copy costs one slice beyond itself, not its source's size."""
    copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    source, target = tensor.reshape(-1), copy.view(-1)
    step = max(1, SLICE_BYTES // tensor.element_size())
    for start in range(0, source.numel(), step):
        target[start : start + step].copy_(source[start : start + step])
        give_back(source[start : start + step])
    return copy


def own_mapped(model: nn.Module) -> int:
    """Replace every parameter and buffer of ``model`` that views a mapped safetensors file by an owned copy
    (:func:`owned_copy`), but an embedding table (the module docstring says why), then give back every page of the
    mapping but the tables' (:func:`_sweep`); the bytes copied. A parameter keeps its identity (its ``data``
    changes), so tied weights stay tied and every module holding it sees the copy."""
    ranges = mapped_ranges()
    tables = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    copied = 0
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if is_mapped(param, ranges) and param.is_contiguous() and id(param) not in tables:
                    param.data = owned_copy(param.data)
                    copied += param.numel() * param.element_size()
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None and is_mapped(buffer, ranges) and buffer.is_contiguous():
                    module._buffers[name] = owned_copy(buffer)
                    copied += buffer.numel() * buffer.element_size()
    _sweep([table.detach() for table in tables.values() if is_mapped(table, ranges)])
    return copied


def _sweep(tables: list[torch.Tensor]) -> int:
    """Give back every page of each safetensors mapping that holds one of ``tables`` ``(V, H)``, the tables' own pages
    included, but those a lookup then reads (none until it does); the bytes given back. Why not only the pages of the
    tensors dropped: a fault maps the pages around it too (the kernel's fault-around, a whole large folio of the page
    cache), so copying a norm or packing a matrix maps back pages of its neighbours already given back. Where a mapping
    holds a page of the process's own (a copy-on-write copy: something wrote to a loaded tensor), nothing of it is
    given back, as that page would read the file again."""
    freed = 0
    for start, end, anonymous in _mappings():
        if anonymous or not any(start <= table.data_ptr() < end for table in tables):
            continue
        freed += _advise(start, end)
    return freed


def _mappings() -> list[tuple[int, int, int]]:
    """``(start, end, anonymous bytes)`` of each private mapping of a ``*.safetensors`` file (``/proc/self/smaps``;
    empty where it is not there)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[int, int, int]] = []
    inside = False
    for line in lines:
        fields = line.split(maxsplit=5)
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):  # a mapping's header
            inside = len(fields) == 6 and fields[5].endswith(".safetensors") and fields[1].endswith("p")
            if inside:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, 0))
        elif inside and fields[0] == "Anonymous:":
            found[-1] = (*found[-1][:2], int(fields[1]) * 1024)
    return found


def _advise(first: int, last: int) -> int:
    """``madvise(MADV_DONTNEED)`` over ``[first, last)`` (page-aligned); the bytes, 0 where it failed."""
    if last <= first or _madvise()(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED) != 0:
        return 0  # the pages stay until the mapping goes: nothing is lost but memory
    return last - first


class ReleasedLinear(nn.Module):
    """Where an ``nn.Linear`` was whose weights were given back (:func:`drop_weight`): it has no weights, and running
    it raises. The layer runs elsewhere now (the fast draft's kernels, decode/models/fast_llama.py)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("this layer's stock weights were given back (decode/models/release.py): its model runs on "
                         "its kernels only")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, released"


def _on_kernel(module: nn.Module) -> bool:
    """A :class:`~decode.models.kernels.KernelLinear` (it carries its prepared product; named by what it holds, so
    that this module, which kernels.py calls, does not import it back)."""
    return hasattr(module, "prepared") and hasattr(module, "weight")


def _linear(module: nn.Module) -> bool:
    """A linear layer: HF's ``nn.Linear`` or a kernel layer in its place."""
    return isinstance(module, nn.Linear) or _on_kernel(module)


def shared_weights(model: nn.Module) -> set[int]:
    """Ids of the linear weights of ``model`` that must stay: those a module other than a linear layer holds (a tied
    embedding) or that several linear layers share."""
    kept = {id(p) for m in model.modules() if not _linear(m) for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    for module in model.modules():
        if _linear(module):
            kept |= {id(module.weight)} & seen
            seen.add(id(module.weight))
    return kept


def drop_weight(parent: nn.Module, attribute: str, keep: set[int]) -> int:
    """Give back the stock weight of linear layer ``parent.attribute`` unless ``keep`` (:func:`shared_weights`) holds
    it; the bytes freed. A :class:`~decode.models.kernels.KernelLinear` keeps running its prepared copy (its stock
    mode then raises); an ``nn.Linear`` whose product runs elsewhere becomes a :class:`ReleasedLinear`."""
    module = getattr(parent, attribute)
    weight = getattr(module, "weight", None)
    if not _linear(module) or weight is None or id(weight) in keep or weight.numel() == 0:
        return 0
    give_back(weight.detach())
    if _on_kernel(module):
        module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
    else:
        released = ReleasedLinear(module)
        released._forward_hooks, released._forward_pre_hooks = module._forward_hooks, module._forward_pre_hooks
        setattr(parent, attribute, released)
    return weight.numel() * weight.element_size()
