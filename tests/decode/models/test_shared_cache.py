"""decode.models.shared_cache: several sequences in one KV cache, each token seeing its own sequence only.

Every row a shared cache returns (settled runs, trees of several sequences in one block, a block grown from a
speculative slot, after commits and after a compaction) equals a plain recompute of that row's own context, on HF's
forward and the fast one, with full attention and with sliding windows shorter than the contexts (where the slots'
positions in their own sequences decide what a window cuts). The layout refuses what would mix sequences."""

from __future__ import annotations

import random

import pytest

from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM
from decode.models.hooks import ForwardHook
from decode.models.shared_cache import Block, SharedCache
from tests.decode.architectures import arch_model
from tests.decode.models.test_models import TOL, _check_cache, _diff, _ref

V = 64
CASES = [("llama", CachedLM), ("llama", FastCachedLM), ("mistral", CachedLM), ("mistral", FastCachedLM),
         ("qwen2-window", CachedLM)]  # mistral: every layer slides (window 5); qwen2-window: a hybrid


@pytest.fixture(params=CASES, ids=[f"{m}-{w.__name__}" for m, w in CASES])
def cache(request) -> SharedCache:
    name, wrapper = request.param
    return SharedCache(wrapper(arch_model(name, seed=0, vocab=V, hidden=32, layers=2)))


def _check(cache: SharedCache, outs, contexts: list[list[list[int]]]) -> None:
    """Each block's row i against a recompute of ``contexts[block][i]``."""
    for out, rows in zip(outs, contexts, strict=True):
        assert out.logits.shape[0] == len(rows)
        for logits, context in zip(out.logits, rows, strict=True):
            assert _diff(logits, _ref(cache.lm, context)[-1]) < TOL
    _check_cache(cache.lm)


def test_every_row_is_its_own_contexts_through_trees_commits_and_compaction(cache: SharedCache) -> None:
    rng = random.Random(0)

    def draw(n: int) -> list[int]:
        return [rng.randrange(V) for _ in range(n)]

    a, b, c = cache.add(), cache.add(), cache.add()
    pa, pb = draw(8), draw(1)
    _check(cache, cache.settle({a: pa, b: pb}), [[pa[: i + 1] for i in range(8)], [pb]])
    ta, tb, tc = draw(3), draw(2), draw(2)
    # a: x with children y and z; b: a chain; c: a sequence with nothing settled yet starts at position 0
    outs = cache.run([Block(a, ta, [None, -1, -1]), Block(b, tb, [None, -1]), Block(c, tc, [None, -1])])
    _check(cache, outs, [[pa + ta[:1], pa + ta[:2], pa + [ta[0], ta[2]]], [pb + tb[:1], pb + tb], [tc[:1], tc]])
    w = draw(1)
    grown = cache.run([Block(a, w, [outs[0].base + 2])])  # a child of z, in a later block
    _check(cache, grown, [[pa + [ta[0], ta[2]] + w]])
    cache.commit({a: [outs[0].base, outs[0].base + 2, grown[0].base], b: [], c: [outs[2].base]})
    sa, sb, sc = pa + [ta[0], ta[2]] + w, pb, tc[:1]
    assert cache.slots.num_speculative == 0 and cache.slots.length == len(sa) + len(sb) + len(sc)
    ra, rb, rc = draw(2), draw(3), draw(6)
    outs = cache.settle({a: ra, b: rb, c: rc})
    _check(cache, outs, [[s + r[: i + 1] for i in range(len(r))] for s, r in ((sa, ra), (sb, rb), (sc, rc))])
    sa, sb, sc = sa + ra, sb + rb, sc + rc
    cache.drop(b)
    assert cache.slots.dead == len(sb)  # fewer dead than live: kept until more leave
    cache.drop(a)
    assert cache.slots.dead == 0 and cache.slots.length == len(sc)  # compacted
    tail = draw(2)
    _check(cache, cache.run([Block(c, tail, [None, -1])]), [[sc + tail[:1], sc + tail]])
    cache.commit({c: []})
    cache.drop(c)
    assert cache.slots.length == 0 and cache.lm.length == 0


def test_the_layout_refuses_what_would_mix_sequences() -> None:
    cache = SharedCache(CachedLM(arch_model("llama", seed=0, vocab=V, hidden=32, layers=1)))
    a, b = cache.add(), cache.add()
    cache.settle({a: [1, 2, 3], b: [4, 5]})
    tip_a, tip_b = cache.tip(a), cache.tip(b)
    with pytest.raises(ValueError, match="not one of its own"):
        cache.run([Block(a, [7], [tip_b])])
    with pytest.raises(ValueError, match="not its tip"):
        cache.run([Block(a, [7], [tip_a - 1])])
    with pytest.raises(ValueError, match="same sequence"):
        cache.run([Block(a, [7], [None]), Block(b, [8], [-2])])  # b's token naming a's as its parent
    with pytest.raises(ValueError, match="linear run"):
        cache.run([Block(a, [7, 8], [None, None])], settle=True)
    outs = cache.run([Block(a, [7, 8], [None, None]), Block(b, [9], [None])])
    with pytest.raises(ValueError, match="speculative slots cached"):
        cache.settle({a: [1]})
    with pytest.raises(ValueError, match="not a chain"):
        cache.commit({a: [outs[0].base + 1, outs[0].base]})
    with pytest.raises(ValueError, match="not a chain"):
        cache.commit({a: [outs[1].base]})  # b's slot in a's chain
    with pytest.raises(ValueError, match="between steps"):
        cache.drop(b)
    cache.commit({a: [outs[0].base + 1], b: [outs[1].base]})
    with pytest.raises(ValueError, match="not in the cache"):
        cache.run([Block(7, [1], [None])])
    lm = CachedLM(arch_model("llama", seed=0, vocab=V, hidden=32, layers=1))
    lm.hook = ForwardHook()
    hooked = SharedCache(lm)
    first = hooked.add()
    with pytest.raises(ValueError, match="one request at a time"):  # a steered pair's hook reads one sequence
        hooked.add()
    hooked.drop(first)
    hooked.add()
