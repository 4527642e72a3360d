"""Giving the stock weights back (decode/models/release.py): after a model's kernels are made with ``release``, no
tensor it holds is a stock weight the kernels replaced, the file it was loaded from holds in memory only the pages of
its embedding tables, and its logits are the same bits as the same path's without a release. The negative control:
without a release the stock weights are held, and the packing read every page of them.

The models are tiny random ones (tests/decode/architectures.py) saved as safetensors and loaded back as ddte loads a
model (mapped, decode/models/loading.py), each from a folder of its own so that each has its own mapping.
"""

from __future__ import annotations

import gc
import types
from pathlib import Path

import pytest
import torch

from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM, cached_lm
from decode.models.kernel_choice import KernelRequest, choose_kernels
from decode.models.kernels import KERNEL_PATHS, KernelLinear, linear_modules
from decode.models.loading import load_causal_lm
from decode.models.release import ReleasedLinear
from tests.decode.architectures import arch_model

VOCAB, HIDDEN = 512, 128  # every matrix spans whole pages (a 128 x 128 fp32 one is 16), so pages given back show
SEQ = [5, 9, 3, 17, 22, 40, 2, 11, 300, 7]
LINUX = Path("/proc/self/smaps").exists()


def _available(name: str, dtype: torch.dtype) -> bool:
    return KERNEL_PATHS[name].unavailable(dtype, torch.device("cpu")) is None


def _saved(folder: Path, name: str = "qwen2", tied: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """A random 2-layer model of case ``name`` saved as safetensors in ``folder``."""
    model = arch_model(name, 3, VOCAB, HIDDEN, 2)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True
    model.to(dtype).save_pretrained(folder)
    return folder


def _target(folder: Path, dtype: torch.dtype = torch.float32) -> CachedLM:
    return CachedLM(load_causal_lm(folder, "cpu", dtype), "cpu", dtype)


def _draft(folder: Path, dtype: torch.dtype = torch.float32) -> CachedLM:
    return cached_lm(load_causal_lm(folder, "cpu", dtype), "cpu", dtype)


def _logits(lm: CachedLM) -> torch.Tensor:
    """A prefill's logits and a tree block's after it, ``(len(SEQ) + 3, V)``."""
    first = lm.prefill(SEQ)
    tree = lm.extend_tree([4, 8, 15], [lm.length - 1, lm.length - 1, -1])  # the third under the first
    return torch.cat([first, tree])


def _held_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, containers and the closures of functions (a prepared
    kernel's copies and biases live there), not through modules' or functions' globals."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            todo += list(obj)
        elif isinstance(obj, types.FunctionType):
            todo += [cell.cell_contents for cell in obj.__closure__ or () if cell.cell_contents is not None]
        elif hasattr(obj, "__dict__"):
            todo += list(vars(obj).values())
    return found


def _file_rss(folder: Path) -> int:
    """Bytes of ``folder``'s safetensors file resident in this process (its mappings' Rss in /proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) == 6 and fields[5].startswith(str(folder))
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
    return rss


def _in_file(tensors: list[torch.Tensor], folder: Path) -> list[torch.Tensor]:
    """Those of ``tensors`` whose bytes lie in a mapping of ``folder``'s file."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder)):
            ranges.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return [t for t in tensors if t.numel() and t.layout == torch.strided and t.device.type == "cpu"
            and not t.is_mkldnn and any(lo <= t.data_ptr() < hi for lo, hi in ranges)]


def _storages(tensors) -> set[int]:
    """The storage addresses of ``tensors`` (an opaque one, oneDNN's prepacked copy, has its own memory: left out)."""
    found = set()
    for tensor in tensors:
        try:
            found.add(tensor.untyped_storage().data_ptr())
        except NotImplementedError:
            continue
    return found


def _stock(model) -> set[int]:
    """Storage addresses of ``model``'s linear weights."""
    return _storages(module.weight for _, _, module in linear_modules(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_released_target_holds_no_stock_weight_and_keeps_its_logits(tmp_path, dtype, tied) -> None:
    if not _available("onednn", dtype):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    kept = _target(_saved(tmp_path / "kept", "llama", tied, dtype), dtype)
    released = _target(_saved(tmp_path / "released", "llama", tied, dtype), dtype)
    stock, kept_stock = _stock(released.model), _stock(kept.model)
    kept.use_kernel("onednn")
    released.use_kernel("onednn", release=True)
    gc.collect()
    if LINUX:  # every page of the file given back; the negative control: the packing read every stock weight's
        assert _file_rss(tmp_path / "released") == 0
        assert _file_rss(tmp_path / "kept") >= sum(m.in_features * m.out_features * dtype.itemsize
                                                   for m in kept.model.modules() if isinstance(m, KernelLinear))
    assert torch.equal(_logits(released), _logits(kept))  # the same copies: the same bits
    held = _held_tensors(released)
    embedding = released.model.get_input_embeddings().weight
    replaced = stock - {embedding.untyped_storage().data_ptr()}  # a tied head's weight is the table: it stays
    assert not _storages(held) & replaced
    assert all(m.weight.numel() == 0 or m.weight is embedding for m in released.model.modules()
               if isinstance(m, KernelLinear))
    # the negative control: without a release the stock weights are held, each of them a view of the file
    assert kept_stock <= _storages(_held_tensors(kept))
    if LINUX:  # the embedding table, and only it, still reads the file: a lookup reads a few rows
        assert _storages(_in_file(held, tmp_path / "released")) == {embedding.untyped_storage().data_ptr()}


def test_a_released_fast_draft_keeps_its_q_and_its_hf_module_no_longer_runs(tmp_path) -> None:
    if not _available("int8-dynamic", torch.float32):
        pytest.skip("no fbgemm int8 on this torch build")
    kept = _draft(_saved(tmp_path / "kept"))
    released = _draft(_saved(tmp_path / "released"))
    assert isinstance(released, FastCachedLM)
    stock, kept_stock = _stock(released.model), _stock(kept.model)
    kept.use_kernel("int8-dynamic")
    released.use_kernel("int8-dynamic", release=True)
    gc.collect()
    if LINUX:
        assert _file_rss(tmp_path / "released") == 0 < _file_rss(tmp_path / "kept")
    assert torch.equal(_logits(released), _logits(kept))  # the same int8 copies: the same q
    held = _held_tensors(released)
    assert not _storages(held) & stock
    layer = released.model.model.layers[0]
    gone = (released.model.lm_head, layer.mlp.up_proj, layer.self_attn.v_proj)
    assert all(isinstance(m, ReleasedLinear) for m in gone)
    with pytest.raises(ValueError, match="given back"):
        released.model(input_ids=torch.tensor([SEQ]))
    with pytest.raises(ValueError, match="given back"):
        released.use_kernel("default")
    assert kept_stock <= _storages(_held_tensors(kept))  # the negative control
    if LINUX:
        table = released.model.get_input_embeddings().weight.untyped_storage().data_ptr()
        assert _storages(_in_file(held, tmp_path / "released")) == {table}


@pytest.mark.parametrize("request_text", ["onednn", "auto"])
def test_a_pair_released_on_its_chosen_paths_decodes_the_same(tmp_path, request_text) -> None:
    if not (_available("onednn", torch.float32) and _available("int8-dynamic", torch.float32)):
        pytest.skip("no oneDNN fp32 or fbgemm int8 here")
    request = KernelRequest(request_text, "int8-dynamic" if request_text != "auto" else "auto")
    out = {}
    for release in (True, False):  # auto: the release measures and prepares its choice again; the other reads it
        folder = tmp_path / str(release)
        target = _target(_saved(folder / "target"))
        draft = _draft(_saved(folder / "draft"))
        choice = choose_kernels(target, draft, request, "pair", tmp_path / "cache", release=release)
        out[release] = (choice.target, choice.draft, _logits(target), _logits(draft))
    assert out[True][:2] == out[False][:2]
    assert all(torch.equal(a, b) for a, b in zip(out[True][2:], out[False][2:], strict=True))
