"""Several sequences in one KV cache: the cache of a batch (decode/batch.py), one sequence per request.

Every cached slot belongs to one sequence, or to none once its sequence has left (a *dead* slot, masked out and
dropped at the next compaction). A sequence's **settled** slots are its prompt and committed tokens: a chain at
positions 0, 1, ... of its own. Its **speculative** slots form a tree hanging off its settled tip (off nothing, at
position 0, for a sequence with no settled slot yet). Speculative slots always lie after every settled one: settled
runs are appended only when no speculative slot is cached, and a commit moves the chains it keeps right after the
settled region, as :meth:`~decode.models.cached_lm.CachedLM.commit` does for one sequence.

A new token attends to its own sequence's settled slots and to its speculative ancestors, nothing else: the mask is
block-diagonal by sequence, and each sequence's attention runs over its own slots alone
(:func:`~decode.models.masks.sequence_columns`, decode/models/attention.py), so its logits are the bits its own context
gives alone (linear layers' rows being their own from two rows on). Positions are the sequence's own, so the rotary
embedding never sees where in the shared cache a slot sits.

The model's own key/value store and forward run unchanged: :class:`SharedCache` installs its :class:`SharedSlots` as
the model's ``slots`` (which the forwards read for the cache length and, under sliding windows, the slots' positions)
and calls the store protocol every cached model implements (``_forward``, ``_move_slots``, ``_truncate``; HF's
``DynamicCache`` and the fast draft's tensors alike). Masks are :mod:`decode.models.masks`' additive masks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from decode.models.cached_lm import CachedLM
from decode.models.draft_vocab import support_logits
from decode.models.hooks import ForwardHook
from decode.models.masks import sequence_columns

__all__ = ["Block", "BlockOutput", "SharedCache", "SharedSlots"]

_NONE = -1  # parent of a sequence's first slot; owner of a dead slot


@dataclass(frozen=True)
class Block:
    """One sequence's part of a forward: its tokens and their parents, each ``None`` (the sequence's settled tip),
    an absolute slot ``>= 0`` of the same sequence, or ``-(j + 1)`` for token j of this part."""

    seq: int
    tokens: Sequence[int]
    parents: Sequence[int | None]


@dataclass(frozen=True)
class BlockOutput:
    """A block's rows of one forward: ``logits (n, V)`` float32 (``(n, Vs)`` on a draft's support), ``hidden (n, H)``
    or None, ``base``: the slot of its first token (token i sits in slot ``base + i``)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    base: int


class SharedSlots:
    """The slot layout of a cache shared by sequences (bookkeeping only; see the module docstring).

    Per slot (numpy, ``(length,)``): ``owner`` (sequence id, -1 dead), ``pos`` (position in its sequence),
    ``parent`` (slot, -1 for a sequence's first), ``settled``.
    """

    def __init__(self) -> None:
        self.owner = np.zeros(0, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)
        self.parent = np.zeros(0, dtype=np.int64)
        self.settled = np.zeros(0, dtype=bool)
        self.live: set[int] = set()
        self._next = 0

    @property
    def length(self) -> int:
        return len(self.owner)

    @property
    def num_speculative(self) -> int:
        return int((~self.settled).sum())

    @property
    def committed(self) -> int:
        """Settled slots: a sequence's committed length while the cache holds one sequence and no dead slot (what a
        forward hook reads, :class:`SharedCache`)."""
        return int(self.settled.sum())

    @property
    def dead(self) -> int:
        return int((self.owner == _NONE).sum())

    def positions(self) -> np.ndarray:
        """``(length,)`` each slot's position in its own sequence (the masks' sliding windows read them)."""
        return self.pos

    def add(self) -> int:
        """A new sequence with no slot yet; its id."""
        seq, self._next = self._next, self._next + 1
        self.live.add(seq)
        return seq

    def tip(self, seq: int) -> int:
        """The sequence's last settled slot, -1 if it has none."""
        mine = np.flatnonzero((self.owner == seq) & self.settled)
        return int(mine[-1]) if len(mine) else _NONE

    def _own_settled(self, seq: int) -> np.ndarray:
        """``(length,)`` bool: the sequence's settled slots (each of its new tokens sees them all)."""
        if seq not in self.live:
            raise ValueError(f"sequence {seq} is not in the cache")
        return (self.owner == seq) & self.settled

    def plan(self, owners: Sequence[int], parents: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where a forward's n new tokens go: ``(allowed (n, length + n) bool, positions (n,), parent slots (n,))``.

        ``parents[i]``: None (the sequence's settled tip), an absolute slot ``>= 0`` (of the same sequence: its
        settled tip or a speculative slot) or ``-(j + 1)`` for token j of this forward (j < i, same sequence).
        """
        n, length = len(owners), self.length
        allowed = np.zeros((n, length + n), dtype=bool)
        pos, par = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for i, (seq, p) in enumerate(zip(owners, parents, strict=True)):
            row = allowed[i]
            if p is not None and p < 0:
                j = -p - 1
                if j >= i or owners[j] != seq:
                    raise ValueError(f"token {i} has parent {p}: an earlier token of the same sequence is needed")
                row[:] = allowed[j]
                pos[i], par[i] = pos[j] + 1, length + j
            else:
                slot = self.tip(seq) if p is None else int(p)
                row[:length] = self._own_settled(seq)
                self._check_parent(seq, slot, i)
                for a in self._speculative_path(slot):
                    row[a] = True
                pos[i] = 0 if slot == _NONE else self.pos[slot] + 1
                par[i] = slot
            row[length + i] = True
        return allowed, pos, par

    def _check_parent(self, seq: int, slot: int, i: int) -> None:
        if slot == _NONE and self.tip(seq) == _NONE:
            return
        if not 0 <= slot < self.length or self.owner[slot] != seq:
            raise ValueError(f"token {i} of sequence {seq} has parent slot {slot}, not one of its own")
        if self.settled[slot] and slot != self.tip(seq):
            raise ValueError(f"token {i} of sequence {seq} grows from settled slot {slot}, not its tip")

    def _speculative_path(self, slot: int) -> list[int]:
        """The speculative slots from ``slot`` up to its sequence's settled tip (``slot`` first; none if settled)."""
        path = []
        while slot != _NONE and not self.settled[slot]:
            path.append(slot)
            slot = int(self.parent[slot])
        return path

    def append(self, owners: Sequence[int], positions: np.ndarray, parents: np.ndarray, settled: bool) -> None:
        """Record n tokens just run (settled only when no speculative slot is cached)."""
        if settled and self.num_speculative:
            raise ValueError(f"settled tokens with {self.num_speculative} speculative slots cached; commit first")
        self.owner = np.concatenate([self.owner, np.asarray(owners, dtype=np.int64)])
        self.pos = np.concatenate([self.pos, positions])
        self.parent = np.concatenate([self.parent, parents])
        self.settled = np.concatenate([self.settled, np.full(len(owners), settled)])

    def check_chains(self, chains: Mapping[int, Sequence[int]]) -> list[int]:
        """Every kept slot in order, after checking that each sequence's are a chain of its speculative slots from
        its settled tip (ValueError if not)."""
        keep: list[int] = []
        for seq, chain in chains.items():
            prev = self.tip(seq)
            for slot in chain:
                slot = int(slot)
                if not 0 <= slot < self.length or self.settled[slot] or self.owner[slot] != seq \
                        or self.parent[slot] != prev:
                    raise ValueError(f"slots {list(chain)} are not a chain of sequence {seq}'s speculative slots "
                                     f"from its tip {self.tip(seq)}")
                keep.append(slot)
                prev = slot
        return keep

    def keep(self, kept: Sequence[int], first: int) -> None:
        """The cache now holds slots ``0 .. first - 1`` as they were, then ``kept`` moved into ``first, first + 1,
        ...``, all settled; every other slot is gone."""
        rows = np.asarray(kept, dtype=np.int64)
        moved = {int(old): first + i for i, old in enumerate(rows)}
        parents = [p if p < first else moved[p] for p in self.parent[rows].tolist()]
        self.owner = np.concatenate([self.owner[:first], self.owner[rows]])
        self.pos = np.concatenate([self.pos[:first], self.pos[rows]])
        self.parent = np.concatenate([self.parent[:first], np.asarray(parents, dtype=np.int64)])
        self.settled = np.ones(len(self.owner), dtype=bool)

    def drop(self, seq: int) -> None:
        """The sequence left: its slots are dead (masked out until a compaction drops them)."""
        if self.num_speculative:
            raise ValueError("a sequence leaves between steps, with no speculative slot cached")
        self._own_settled(seq)  # raises for an unknown sequence
        self.owner[self.owner == seq] = _NONE
        self.live.discard(seq)


class SharedCache:
    """A :class:`~decode.models.cached_lm.CachedLM` whose cache holds several sequences (see the module docstring).

    The batch owns the model while it lives: the constructor empties its cache, and a plain ``prefill``/``extend``
    on it would ignore the layout. A model with a forward hook (a steered pair) holds one sequence at a time, its
    slots then the sequence's positions as in a plain cache: the hook hears each forward's root, taps and commits as
    :class:`~decode.models.cached_lm.CachedLM` tells it, and a sequence's first run (its prompt) runs as a prefill.
    """

    layout = SharedSlots  # the slot bookkeeping (a test's negative control swaps in a leaking one)
    columns = staticmethod(sequence_columns)  # each sequence's columns of a pass (likewise)

    def __init__(self, lm: CachedLM) -> None:
        lm.reset()
        self.lm, self.slots = lm, self.layout()
        lm.slots = self.slots  # the store and forward read the cache length and positions from here

    def add(self) -> int:
        """A new, empty sequence; its id. ValueError for a second one beside a model with a forward hook."""
        if self.lm.hook is not None and self.slots.live:
            raise ValueError("a steered pair decodes one request at a time (its draft's steering reads the target's "
                             "states slot by slot)")
        return self.slots.add()

    def tip(self, seq: int) -> int:
        return self.slots.tip(seq)

    def run(self, blocks: Sequence[Block], output_hidden: bool = False, on_support: bool = False,
            settle: bool = False, skip: Sequence[int] | None = None) -> list[BlockOutput]:
        """One forward over every block's tokens (blocks one after another in the cache).

        ``settle``: the tokens join their sequences' settled chains at once (each block a linear run from its tip,
        and no speculative slot cached), as a prompt or a committed token does. ``on_support``: logits over the
        draft's vocabulary (:func:`~decode.models.draft_vocab.support_logits`). ``skip``: per block, how many of its
        first rows nobody reads (a prompt's, run beside other requests' trees): the output head skips them (for a
        151,936-token vocabulary it costs a third of a 1.5B model's pass over the same rows), and the block's output
        starts at its row ``skip[i]`` (its ``base`` that row's slot).
        """
        self.check_owned()
        skip = [0] * len(blocks) if skip is None else [int(k) for k in skip]
        if len(skip) != len(blocks) or any(not 0 <= k < len(b.tokens) for k, b in zip(skip, blocks, strict=True)):
            raise ValueError(f"skip {skip}: one count per block, each below its block's length")
        owners: list[int] = []
        tokens: list[int] = []
        parents: list[int | None] = []
        offsets: list[int] = []
        for block in blocks:
            if settle and list(block.parents) != [None] + [-(j + 1) for j in range(len(block.tokens) - 1)]:
                raise ValueError(f"settled tokens of sequence {block.seq} must be a linear run from its tip")
            offsets.append(len(tokens))
            shift = len(tokens)
            owners += [block.seq] * len(block.tokens)
            tokens += [int(t) for t in block.tokens]
            parents += [p if p is None or p >= 0 else p - shift for p in block.parents]
        base = self.slots.length
        if self._alone_linear(blocks):  # a plain cache's causal run: no mask to build or apply
            pos = np.arange(len(tokens), dtype=np.int64) + (0 if base == 0 else int(self.slots.pos[base - 1]) + 1)
            allowed, par = None, np.arange(base - 1, base - 1 + len(tokens), dtype=np.int64)
        else:
            allowed, pos, par = self.slots.plan(owners, parents)
        ends = offsets[1:] + [len(tokens)]
        starts = [a + k for a, k in zip(offsets, skip, strict=True)]
        rows = None if not any(skip) else np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
        hook = self.lm.hook
        bias = None if hook is None else self._hook_bias(hook, blocks[0], base, settle)
        with support_logits(self.lm.model) if on_support else nullcontext():
            groups = self.columns(np.asarray(owners), self.slots.owner, allowed)
            out = self.lm._forward(tokens, allowed, pos, output_hidden, bias, () if hook is None else hook.tap_layers,
                                   rows, groups)
        if hook is not None and out.tapped is not None:
            hook.tapped(out.tapped)
        self.slots.append(owners, pos, par, settled=settle)
        kept = np.cumsum([0] + [b - a for a, b in zip(starts, ends, strict=True)])  # each block's first output row
        return [BlockOutput(out.logits[kept[i]:kept[i + 1]],
                            None if out.hidden is None else out.hidden[kept[i]:kept[i + 1]], base + starts[i])
                for i in range(len(blocks))]

    def _alone_linear(self, blocks: Sequence[Block]) -> bool:
        """Whether the forward is one linear run from the tip of the cache's only sequence, every cached slot its
        settled own: then it sees exactly what a plain cache's causal run sees (a lone request's prompt)."""
        if len(blocks) != 1 or self.slots.live != {blocks[0].seq}:
            return False
        slots, block = self.slots, blocks[0]
        linear = list(block.parents) == [None] + [-(j + 1) for j in range(len(block.tokens) - 1)]
        return linear and not slots.dead and not slots.num_speculative

    def _hook_bias(self, hook: ForwardHook, block: Block, base: int, settle: bool) -> torch.Tensor | None:
        """The hook's up-projection bias for a forward of the one sequence (slots are its positions): rooted at the
        last token of a settled run, at the tip under a speculative block, none for its first run (a prefill)."""
        tip = self.slots.tip(block.seq)
        if settle and tip == _NONE:
            return None
        bias = hook.up_bias(base + len(block.tokens) - 1 if settle else tip)
        return None if bias is None else bias.to(self.lm.device, self.lm.dtype)

    def settle(self, runs: Mapping[int, Sequence[int]], output_hidden: bool = False,
               last: int | None = None) -> list[BlockOutput]:
        """:meth:`run` of linear runs ``{seq: tokens}`` appended to their sequences' settled chains; ``last``: only
        each run's last ``last`` rows are returned."""
        blocks = [Block(seq, ids, [None] + [-(j + 1) for j in range(len(ids) - 1)]) for seq, ids in runs.items()]
        skip = None if last is None else [max(len(ids) - last, 0) for ids in runs.values()]
        return self.run(blocks, output_hidden, settle=True, skip=skip)

    def commit(self, chains: Mapping[int, Sequence[int]]) -> None:
        """Settle each sequence's chain of speculative slots (from its tip, in order; may be empty) and drop every
        other speculative slot."""
        keep = self.slots.check_chains(chains)
        first = self.slots.length - self.slots.num_speculative
        self._keep(keep, first)

    def drop(self, seq: int) -> None:
        """The sequence left. Its slots are dropped once the dead ones are as many as the live: the copy of the
        live cache that compaction costs is then paid at most once per live slot, and attention runs over at most
        twice the live slots."""
        self.slots.drop(seq)
        dead = self.slots.dead
        if dead and dead >= self.slots.length - dead:
            self._keep(np.flatnonzero(self.slots.owner != _NONE).tolist(), 0)

    def check_owned(self) -> None:
        """A plain prefill or extend on the model (another decoder sharing it) replaced the layout: the cache no
        longer holds the batch's sequences."""
        if self.lm.slots is not self.slots:
            raise ValueError("the model's cache was used outside the batch that owns it; its sequences are lost")

    def _keep(self, keep: list[int], first: int) -> None:
        """Move ``keep`` into the slots from ``first`` on and drop the rest (store, then layout)."""
        self.check_owned()
        if keep != list(range(first, first + len(keep))):
            with torch.inference_mode():
                self.lm._move_slots(torch.tensor(keep, dtype=torch.long, device=self.lm.device), first)
        if self.lm.hook is not None:
            self.lm.hook.committed(first, list(keep))
        self.lm._truncate(first + len(keep))  # reads the old length from the layout
        self.slots.keep(keep, first)
