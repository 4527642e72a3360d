"""Measuring the latency model (decode/cost/table.py) on the running machine: the pass times of both models, and
what a pass costs through a batch's shared cache.

Passes are timed the way the decoding loop runs them (see :func:`measure_latency`): a pass includes turning its
logits into distributions, and a draft pass the draws from them. c(l) is what the loop pays once per step on top:
its first draft pass runs right after the target pass has pushed the small draft's weights out of the CPU caches,
so it costs more than a warm one. Without c(l), T̂ left that much of every step out, and without the sampling work
part of each draft pass; both made the model favour other trees than the loop does.

The running machine's table and batch cost are measured once per machine and cached
(:mod:`decode.models.machine_cache`): :func:`machine_table`, :func:`machine_batch_cost`; :func:`loop_table` measures
the loop's own, uncached.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from decode.cost.table import BatchCost, LatencyTable
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig, distributions
from decode.models.cached_lm import CachedLM
from decode.models.machine_cache import cached_measurement, machine_identity


def every_size(max_size: int) -> list[int]:
    """Block sizes 1..max_size: the grid :func:`measure_latency` uses unless told otherwise.

    A CPU pass is not linear in the block size (a one-row GEMV against small GEMMs whose kernels favour multiples
    of 4): a 4-token pass may cost less than a 3-token one. Interpolating between 1 and 4 made 2- and 3-token blocks
    look cheaper than they are, and a throughput rule then prefers them wrongly, so every size up to the largest tree
    is measured.
    """
    return list(range(1, max_size + 1))


def measure_latency(
    target: CachedLM,
    draft: CachedLM,
    lengths: Sequence[int] = (32, 128, 256, 480),
    sizes: list[int] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    max_size: int = 41,
    pair: str = "",
    tick: Callable[[], None] | None = None,
) -> LatencyTable:
    """Time the passes of both models per (context length, block size), as the decoding loop runs them. ``tick`` is
    called after each sweep of the sizes at one length (``(warmup + repeats) · len(lengths)`` in all).

    ``sizes`` defaults to :func:`every_size` of ``max_size`` (1 + 8 + 4·8 = 41 tokens: the largest default tree).
    At each length both caches hold ``length`` committed random tokens, and every repeat sweeps the sizes with one
    simulated step per size, in the loop's order: the target pass of the block; a one-token draft pass (the step's
    first, cache-cold); the same pass again (warm); the draft pass of the block. A pass appends a speculative block
    (a K-wide level for the draft, a tree block for the target), turns its logits into distributions, draws one token
    per row (the draft) and is rolled back, so every repeat sees the same caches.

    The table holds medians over ``repeats``; c(l) is the median of cold minus warm one-token time (never below 0).
    Repeats are the outer loop, then the lengths (each re-prefilled), then the sizes: a slow phase of the machine
    (another process, a frequency drop) then lands on one repeat of every length and size, which the median drops,
    instead of on every repeat of a few lengths, which bends the table. With the lengths as the outer loop, a phase of
    a few seconds once read small passes at one length much slower, enough to make K-wide trees look cheaper against
    chains than the loop found them.
    """
    sizes = sorted(set(every_size(max_size) if sizes is None else (int(n) for n in sizes)))
    limit = min(target.context_limit, draft.context_limit)
    lengths = sorted({min(int(x), limit - max(sizes) - 1) for x in lengths})
    vocab = min(target.vocab_size, draft.vocab_size)
    g, rng = torch.Generator().manual_seed(0), TorchRandom(0)
    contexts = [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]
    blocks = [torch.randint(0, vocab, (size,), generator=g).tolist() for size in sizes]
    first = torch.randint(0, vocab, (1,), generator=g).tolist()
    # times[name][length index][size index]: one entry per repeat
    times: dict[str, list[list[list[float]]]] = {name: [[[] for _ in sizes] for _ in lengths]
                                                 for name in ("draft", "target")}
    cold_minus_warm: list[list[float]] = [[] for _ in lengths]
    for i in range(warmup + repeats):
        for li, context in enumerate(contexts):
            for model in (target, draft):
                model.prefill(context)
            for j, tokens in enumerate(blocks):
                target_ms = _timed_pass(target, tokens, None)
                cold_ms, warm_ms = _timed_pass(draft, first, rng), _timed_pass(draft, first, rng)
                draft_ms = _timed_pass(draft, tokens, rng)
                if i >= warmup:
                    times["target"][li][j].append(target_ms)
                    times["draft"][li][j].append(draft_ms)
                    cold_minus_warm[li].append(cold_ms - warm_ms)
            if tick is not None:
                tick()
    for model in (target, draft):
        model.reset()
    grids = {name: [[statistics.median(t) for t in row] for row in times[name]] for name in times}
    extra = [max(0.0, statistics.median(d)) for d in cold_minus_warm]
    return LatencyTable(list(lengths), list(sizes), grids["draft"], grids["target"], str(target.device), extra,
                        pair, machine_identity(target, draft))


# The table of a decoder whose policy reads root features but was given no table to pick its fallbacks with
# (``--latency fitted``, another draft beside the pair's): every block size up to the largest default tree
# (1 + 8 + 4·8) at a short and a long context; beyond them the table holds its edge. Not cached: its pass times are
# those of the models as they run now, another draft's included.
LOOP_LENGTHS = (32, 256)


def loop_table(target: CachedLM, draft: CachedLM) -> LatencyTable:
    """The pass times root features read (decode/policies/features.py), measured now on ``target`` and ``draft``
    (on the kernel paths they run: measure after moving them); :data:`LOOP_LENGTHS`, three repeats."""
    return measure_latency(target, draft, lengths=list(LOOP_LENGTHS), repeats=3)


# The running machine's table (decode/policies/files/guard.py): one-token passes and every small block, then a sparser
# grid up to the largest default tree (1 + 8 + 4·8), at a short and a long context. Measured once per machine and
# cached.
MACHINE_LENGTHS = (64, 512)
MACHINE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 25, 32, 41)


def machine_table(target: CachedLM, draft: CachedLM, fingerprint: str, cache: Path,
                  announce: Callable[[str], None] | None = None, progress: bool = False) -> tuple[LatencyTable, Path]:
    """The latency table of this pair on the running machine: read from ``cache`` or measured once, under the cache's
    lock, and written there whole (:mod:`decode.models.machine_cache`). ``announce`` hears one line before a
    measurement (it takes minutes for a 1.5B target on a CPU), during which ``progress`` shows a bar on stderr. A
    cached file that does not read as a table of this pair and machine is measured again."""
    def measure() -> LatencyTable:
        from tqdm import tqdm

        repeats, warmup = 3, 1
        with tqdm(total=(repeats + warmup) * len(MACHINE_LENGTHS), desc="latency table", unit="sweep",
                  disable=not progress, delay=3.0, file=sys.stderr, leave=False) as bar:
            return measure_latency(target, draft, lengths=list(MACHINE_LENGTHS), sizes=list(MACHINE_SIZES),
                                   repeats=repeats, warmup=warmup, pair=fingerprint, tick=bar.update)

    table, path = cached_measurement(cache, "latency table", fingerprint, machine_identity(target, draft),
                                     LatencyTable.from_json, measure, LatencyTable.to_json, announce)
    assert path is not None  # a cache folder was given
    return table, path


# The batch passes a server runs (ddte serve --max-batch): up to 8 requests, a short and a longer context each, and
# every pass size up to four requests' chains of 8 (larger passes hold the edge ratio). Measured once per machine.
BATCH_SEQUENCES = (1, 2, 4, 8)
BATCH_LENGTHS = (64, 256)
BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def measure_batch_cost(target: CachedLM, draft: CachedLM, sequences: Sequence[int] = BATCH_SEQUENCES,
                       lengths: Sequence[int] = BATCH_LENGTHS, sizes: Sequence[int] = BATCH_SIZES, repeats: int = 3,
                       warmup: int = 1, pair: str = "", tick: Callable[[], None] | None = None) -> BatchCost:
    """Time both models' passes through a batch's cache (:class:`BatchCost`); ``tick`` after each model's sweep at one
    length (``2 · (warmup + repeats) · len(lengths)`` in all).

    Per repeat and length, each model's cache is filled with ``max(sequences)`` requests of that many random tokens
    (one settled run each, through :class:`~decode.models.shared_cache.SharedCache`), and requests leave down the
    ``sequences`` grid (the cache compacts as a batch's does); at each count every size's pass runs once: its tokens
    spread over the requests as chains from their tips, the logits turned into distributions and, for the draft, one
    draw per row, then dropped. A repeat's ratio divides by the one-request pass of the same repeat, so a slow phase
    of the machine cancels out where it lasts a repeat. The models' caches are empty after.
    """
    from decode.models.shared_cache import SharedCache

    sequences = sorted(set(int(r) for r in sequences) | {1})
    sizes = sorted(set(int(n) for n in sizes))
    limit = min(target.context_limit, draft.context_limit)
    lengths = sorted({min(int(x), (limit - max(sizes) - 1)) for x in lengths})
    vocab = min(target.vocab_size, draft.vocab_size)
    g, rng = torch.Generator().manual_seed(0), TorchRandom(0)
    contexts = [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]
    new = torch.randint(0, vocab, (max(sizes),), generator=g).tolist()
    # ratios[name][r][i][j]: one per repeat
    ratios: dict[str, list[list[list[list[float]]]]] = {
        name: [[[[] for _ in sizes] for _ in lengths] for _ in sequences] for name in ("draft", "target")}
    for repeat in range(warmup + repeats):
        for i, context in enumerate(contexts):
            for name, model in (("target", target), ("draft", draft)):
                cache = SharedCache(model)
                live = [cache.add() for _ in range(max(sequences))]
                for seq in live:
                    cache.settle({seq: context}, last=1)
                ms: dict[int, list[float]] = {}
                for r in reversed(sequences):
                    while len(live) > r:
                        cache.drop(live.pop())
                    ms[r] = [_timed_shared_pass(cache, live, new[:n], rng if model is draft else None)
                             for n in sizes]
                model.reset()
                if repeat >= warmup:
                    for ri, r in enumerate(sequences):
                        for j in range(len(sizes)):
                            ratios[name][ri][i][j].append(ms[r][j] / ms[1][j])
                if tick is not None:
                    tick()
    grids = {name: [[[statistics.median(v) for v in row] for row in plane] for plane in ratios[name]]
             for name in ratios}
    return BatchCost(sequences, lengths, sizes, grids["draft"], grids["target"], pair,
                     machine_identity(target, draft))


def _timed_shared_pass(cache, seqs: Sequence[int], tokens: list[int], rng: TorchRandom | None) -> float:
    """Milliseconds of one pass of ``tokens`` spread over the sequences ``seqs`` of a shared cache (each a chain from
    its tip; the first ones take one more where they do not divide), as :func:`_timed_pass` times a pass; dropped
    after."""
    from decode.models.shared_cache import Block

    n, r = len(tokens), len(seqs)
    counts = [n // r + (i < n % r) for i in range(r)]
    blocks, at = [], 0
    for seq, count in zip(seqs, counts, strict=True):
        if count:
            blocks.append(Block(seq, tokens[at:at + count], [None] + [-(j + 1) for j in range(count - 1)]))
            at += count
    start = time.perf_counter()
    outs = cache.run(blocks, on_support=rng is not None)
    laws = distributions(torch.cat([out.logits for out in outs]), _TIMING_LAW)
    if rng is not None:
        for row in laws:
            rng.categorical(row)
    if cache.lm.device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    cache.commit({})
    return ms


def machine_batch_cost(target: CachedLM, draft: CachedLM, fingerprint: str, cache: Path,
                       announce: Callable[[str], None] | None = None,
                       progress: bool = False) -> tuple[BatchCost, Path]:
    """This pair's :class:`BatchCost` on the running machine: read from ``cache`` or measured once (minutes for a 1.5B
    target on one thread, mostly filling 8 requests' caches), as :func:`machine_table` does, in a file of its own
    beside the table's (a table cached before batch costs existed still serves)."""
    def measure() -> BatchCost:
        from tqdm import tqdm

        repeats, warmup = 3, 1
        with tqdm(total=2 * (repeats + warmup) * len(BATCH_LENGTHS), desc="batch passes", unit="sweep",
                  disable=not progress, delay=3.0, file=sys.stderr, leave=False) as bar:
            return measure_batch_cost(target, draft, repeats=repeats, warmup=warmup, pair=fingerprint,
                                      tick=bar.update)

    cost, path = cached_measurement(cache, "batch cost", fingerprint, machine_identity(target, draft),
                                    BatchCost.from_json, measure, BatchCost.to_json, announce)
    assert path is not None  # a cache folder was given
    return cost, path


_TIMING_LAW = SamplingConfig(temperature=1.0)  # the temperature only rescales logits: the cost is the same at any T


def _timed_pass(model: CachedLM, tokens: list[int], rng: TorchRandom | None) -> float:
    """Milliseconds of one pass over ``tokens`` as siblings after the cache's last token, rolled back after: the
    forward, the distributions of its logits and, given ``rng``, one draw per row: the draft's work, which, as in
    the drafting loop, runs over its draft vocabulary's ``(n, Vs)`` logits where it has one.

    A level of siblings has the attention cost of a tree block of the same size.
    """
    parents = [model.length - 1] * len(tokens)
    start = time.perf_counter()
    laws = distributions(model.extend_tree(tokens, parents, on_support=rng is not None), _TIMING_LAW)
    if rng is not None:
        for row in laws:
            rng.categorical(row)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    model.commit([])
    return ms
