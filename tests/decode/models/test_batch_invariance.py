"""A sequence's rows of a pass over a shared cache are the same bits whoever shares the pass (decode.models.attention,
per sequence): each sequence attends over its own slots through one kernel call that depends only on its own rows
and columns, so a seeded request draws alone exactly what it draws in a batch.

Checked on HF's forward and the fast one, in float32 and bfloat16, on every kernel path this CPU runs: one sequence's
logits through a prompt, a branching tree, a commit, a linear run, and (on the paths whose rows do not depend on
the row count: ``int8-dynamic``) one-token passes, alone and beside two others with their own trees and commits. The
negative control is the attention over the whole cache with the others masked out (what ran before): the same law,
other bits, which the same comparison catches. A mask that would show a sequence another's slots is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM
from decode.models.kernels import kernel_path
from decode.models.masks import sequence_columns
from decode.models.shared_cache import Block, SharedCache
from tests.decode.architectures import arch_model

V = 96
ROW_COUNT_FREE = {"int8-dynamic"}  # paths whose row outputs do not depend on the rows beside them, one row included


def whole_cache(row_owners, slot_owners, allowed):
    """Wrong (the negative control): every sequence attends over the whole cache in one call, the others masked."""
    return None


class WholeCache(SharedCache):
    columns = staticmethod(whole_cache)


def _lm(wrapper, dtype: torch.dtype, kernel: str):
    lm = wrapper(arch_model("qwen2", seed=3, vocab=V, hidden=64, layers=2), dtype=dtype)
    reason = kernel_path(kernel).unavailable(dtype, lm.device)
    if reason is not None:
        pytest.skip(reason)
    lm.use_kernel(kernel)
    return lm


def _script(cache: SharedCache, company: int, one_rows: bool) -> list[torch.Tensor]:
    """Sequence ``me``'s logits through a fixed script, with ``company`` other sequences doing their own work."""
    me, others = cache.add(), [cache.add() for _ in range(company)]
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=g).tolist()

    seen = []
    prompts = {me: [5, 17, 3, 40, 8, 9], **{o: tokens(4 + 3 * i) for i, o in enumerate(others)}}
    seen.append(cache.settle(prompts)[0].logits)
    # a branching tree: a, b under a, c under a, d under b
    trees = [Block(me, [11, 12, 13, 14], [None, -1, -1, -2])]
    trees += [Block(o, tokens(3), [None, -1, -1]) for o in others]
    outs = cache.run(trees)
    seen.append(outs[0].logits)
    cache.commit({me: [outs[0].base, outs[0].base + 1, outs[0].base + 3],
                  **{o: [out.base] for o, out in zip(others, outs[1:], strict=True)}})
    seen.append(cache.settle({me: [21, 22, 23, 24], **{o: tokens(2) for o in others}})[0].logits)
    if one_rows:
        for t in (30, 31):
            seen.append(cache.run([Block(me, [t], [None])] + [Block(o, tokens(2), [None, -1]) for o in others])[0]
                        .logits)
            cache.commit({me: [], **{o: [] for o in others}})
    return seen


def _alone_and_beside(wrapper, dtype, kernel, cache_class=SharedCache):
    lm = _lm(wrapper, dtype, kernel)
    one_rows = kernel in ROW_COUNT_FREE
    alone = _script(cache_class(lm), 0, one_rows)
    beside = _script(cache_class(lm), 2, one_rows)
    return alone, beside


@pytest.mark.parametrize("kernel", ["default", "onednn", "int8-dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wrapper", [CachedLM, FastCachedLM], ids=["hf", "fast"])
def test_a_sequences_rows_are_the_same_bits_alone_and_beside_others(wrapper, dtype, kernel):
    alone, beside = _alone_and_beside(wrapper, dtype, kernel)
    for i, (a, b) in enumerate(zip(alone, beside, strict=True)):
        assert torch.equal(a, b), (i, (a - b).abs().max().item())


@pytest.mark.parametrize("wrapper", [CachedLM, FastCachedLM], ids=["hf", "fast"])
def test_attention_over_the_whole_cache_is_caught(wrapper):
    alone, beside = _alone_and_beside(wrapper, torch.float32, "int8-dynamic", WholeCache)
    assert all((a - b).abs().max() < 1e-3 for a, b in zip(alone, beside, strict=True))  # the same law...
    assert not all(torch.equal(a, b) for a, b in zip(alone, beside, strict=True))  # ...not the same bits


def test_a_mask_showing_another_sequences_slots_is_refused():
    owners, slots = np.array([1, 1]), np.array([0, 0, 1, 1])
    allowed = np.zeros((2, 6), dtype=bool)
    allowed[:, 2:4] = True
    allowed[0, 4], allowed[1, 4:6] = True, True
    assert sequence_columns(owners, slots, allowed)[0].pattern is None  # its own slots, causally: no mask needed
    allowed[1, 0] = True
    with pytest.raises(ValueError, match="another sequence"):
        sequence_columns(owners, slots, allowed)
    with pytest.raises(ValueError, match="contiguous"):
        sequence_columns(np.array([1, 0, 1]), slots, np.ones((3, 7), dtype=bool))
