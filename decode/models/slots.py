"""Bookkeeping of a KV cache that holds a tree of speculative slots above a committed prefix (no tensors here).

The cache holds ``length`` positions (*slots*), numbered ``0 .. length-1``:

* slots ``0 .. committed-1`` are the **committed** prefix, a linear sequence (slot ``s`` sits at position ``s``);
* slots ``committed .. length-1`` are **speculative**. Each has a parent slot with a smaller index (the committed
  tip ``committed-1``, another speculative slot, or, rarely, an earlier committed slot), so the speculative slots
  form a forest hanging off the committed prefix. A speculative slot attends to its own root-to-slot path only,
  and its rotary position is ``position(parent) + 1``.

A block of new tokens names its parents as **absolute slot indices** (any existing slot) or as ``-(j + 1)`` for
*token j of the same block*. :meth:`SlotForest.plan_block` turns that into positions and the attention pattern;
a block that merely continues a linear cache needs no mask. Any model wrapper (HF's or the fast draft's) keeps
its key/value tensors in step with this class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_EMPTY_I64 = np.zeros(0, dtype=np.int64)


class SlotLayout(Protocol):
    """What a model's forward reads of the slot bookkeeping of its cache, whichever keeps it: a plain cache's
    :class:`SlotForest`, or a batch's shared layout (decode/models/shared_cache.py ``SharedSlots``)."""

    @property
    def length(self) -> int: ...

    @property
    def committed(self) -> int: ...

    @property
    def num_speculative(self) -> int: ...

    def positions(self) -> np.ndarray:
        """``(length,)`` each cached slot's position (the masks' sliding windows read them)."""
        ...


@dataclass(frozen=True)
class BlockPlan:
    """Where a block of n new tokens goes.

    Attributes:
        parents: ``(n,)`` absolute parent slot of each token.
        positions: ``(n,)`` rotary position of each token.
        visible: ``(n,)`` committed columns each token sees (a prefix of the committed slots).
        ancestry: ``(m + n, m + n)`` bool, [a, b] = speculative slot b is slot a or one of its ancestors, for the m
            speculative slots already cached and the n new ones.
        allowed: ``(n, length + n)`` bool attention pattern over cached and new slots, or None for a block that
            continues a linear cache (the model's own causal mask then applies).
    """

    parents: np.ndarray
    positions: np.ndarray
    visible: np.ndarray
    ancestry: np.ndarray
    allowed: np.ndarray | None

    @property
    def linear(self) -> bool:
        return self.allowed is None


class SlotForest:
    """Committed prefix and speculative forest of one cache; see the module docstring for the slot layout."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No slots at all."""
        self.length = 0
        self.committed = 0
        self._reset_speculative()

    def _reset_speculative(self) -> None:
        # per speculative slot committed+k: parent slot (absolute), rotary position, visible committed columns
        self._par = self._pos = self._vis = _EMPTY_I64
        self._anc = np.zeros((0, 0), dtype=bool)  # [a, b]: spec slot b is slot a or one of its ancestors
        self._linear = True  # speculative slots form one chain committed-1 -> ... -> length-1

    @property
    def num_speculative(self) -> int:
        return self.length - self.committed

    def parent_of(self, slot: int) -> int:
        """Parent slot of ``slot`` (``slot - 1`` for a committed slot; ``-1`` for slot 0)."""
        if not 0 <= slot < self.length:
            raise IndexError(f"slot {slot} is not cached (length {self.length})")
        return slot - 1 if slot < self.committed else int(self._par[slot - self.committed])

    def position_of(self, slot: int) -> int:
        """Rotary position (depth in the sequence) of ``slot``."""
        if not 0 <= slot < self.length:
            raise IndexError(f"slot {slot} is not cached (length {self.length})")
        return slot if slot < self.committed else int(self._pos[slot - self.committed])

    def positions(self) -> np.ndarray:
        """``(length,)`` int64 position of every cached slot (a committed slot sits at its own index)."""
        return np.concatenate([np.arange(self.committed, dtype=np.int64), self._pos])

    # --- growing -------------------------------------------------------------------------------------
    def append_committed(self, n: int) -> None:
        """Account for n tokens run straight onto the committed prefix (no speculative slot may be cached)."""
        if self.num_speculative:
            raise ValueError(f"cannot commit a run with {self.num_speculative} speculative slots cached; "
                             "commit or crop first")
        self.length += n
        self.committed = self.length

    def plan_block(self, parents: Sequence[int]) -> BlockPlan:
        """Positions and attention pattern of a block with these parents (see the module docstring)."""
        n = len(parents)
        length, committed = self.length, self.committed
        if length == 0:
            raise ValueError("a speculative block needs a non-empty cache: prefill first")
        m = length - committed
        par: list[int] = []
        linear = self._linear
        for i, p in enumerate(parents):
            p = int(p)
            if p < 0:
                j = -p - 1
                if j >= i:
                    raise ValueError(f"block token {i} has parent {p} = block token {j}; parents must precede it")
                p = length + j
            elif p >= length:
                raise ValueError(f"block token {i} has parent slot {p}, but only {length} slots are cached")
            par.append(p)
            linear = linear and p == length + i - 1
        par_array = np.array(par, dtype=np.int64)
        if linear:
            anc = np.zeros((m + n, m + n), dtype=bool)
            anc[:m, :m] = self._anc
            anc[m:, :] = np.tri(n + m, dtype=bool)[m:]
            return BlockPlan(par_array, np.arange(length, length + n, dtype=np.int64),
                             np.full(n, committed, dtype=np.int64), anc, None)
        pos, vis, anc = self._block_structure(par)
        allowed = np.concatenate([np.arange(committed)[None, :] < vis[:, None], anc[m:]], axis=1)
        return BlockPlan(par_array, pos, vis, anc, allowed)

    def append(self, plan: BlockPlan) -> None:
        """Record a planned block as cached (after the model ran it)."""
        self._par = np.concatenate([self._par, plan.parents])
        self._pos = np.concatenate([self._pos, plan.positions])
        self._vis = np.concatenate([self._vis, plan.visible])
        self._anc = plan.ancestry
        self._linear = self._linear and plan.linear
        self.length += len(plan.parents)

    def _block_structure(self, par: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions ``(n,)``, visible committed columns ``(n,)`` and the new speculative ancestry
        ``(m + n, m + n)`` for a block whose absolute parent slots are ``par`` (length n)."""
        committed, m, n = self.committed, self.num_speculative, len(par)
        anc = np.zeros((m + n, m + n), dtype=bool)
        anc[:m, :m] = self._anc
        pos_all = self._pos.tolist()
        vis_all = self._vis.tolist()
        for i, p in enumerate(par):
            row = m + i
            q = p - committed  # parent's speculative index, < 0 when the parent is committed
            if q >= 0:
                anc[row] = anc[q]
                pos_all.append(pos_all[q] + 1)
                vis_all.append(vis_all[q])
            else:
                pos_all.append(p + 1)
                vis_all.append(p + 1)
            anc[row, row] = True
        return np.array(pos_all[m:], dtype=np.int64), np.array(vis_all[m:], dtype=np.int64), anc

    # --- rollback ------------------------------------------------------------------------------------
    def check_chain(self, keep_slots: Sequence[int]) -> list[int]:
        """``keep_slots`` as ints if they are speculative and a chain from the committed tip; ValueError if not."""
        committed, length = self.committed, self.length
        prev = committed - 1
        keep = [int(s) for s in keep_slots]
        for s in keep:
            if not committed <= s < length:
                raise ValueError(f"slot {s} is not speculative (speculative slots are {committed}..{length - 1})")
            if self._par[s - committed] != prev:
                raise ValueError(
                    f"commit path {keep} is not a chain from the committed tip {committed - 1}: "
                    f"slot {s} has parent {int(self._par[s - committed])}, expected {prev}"
                )
            prev = s
        return keep

    def commit_moved(self, kept: int) -> None:
        """The cache now holds the committed prefix plus ``kept`` slots moved right after it, all committed."""
        self.length = self.committed = self.committed + kept
        self._reset_speculative()

    def crop(self, length: int) -> None:
        """Drop every slot at or after ``length`` (the caller drops the same slots of its tensors)."""
        if length >= self.length:
            return
        self.length = length
        if length <= self.committed:
            self.committed = length
            self._reset_speculative()
            return
        k = length - self.committed
        self._par, self._pos, self._vis = self._par[:k], self._pos[:k], self._vis[:k]
        self._anc = self._anc[:k, :k]
        if not self._linear:  # a prefix of a chain is a chain; otherwise check the kept part
            self._linear = bool(np.array_equal(self._par, np.arange(self.committed - 1, length - 1)))


def block_parents(nodes: Sequence[int], parent_of: Sequence[int], slots: Mapping[int, int]) -> list[int]:
    """The parents of a block of tree nodes in :meth:`SlotForest.plan_block`'s convention.

    Args:
        nodes: the block's nodes in order, parents before children.
        parent_of: each node's parent node, by node index (a tree's ``parents``).
        slots: the cache slot of each node already cached; every parent outside the block must be there (a tree's
            root is usually the committed tip: ``{root: committed - 1}``).

    Returns:
        per node, ``-(j + 1)`` where its parent is token j of the block, else the parent's absolute slot.
    """
    in_block = {v: j for j, v in enumerate(nodes)}
    return [-(in_block[u] + 1) if u in in_block else slots[u] for u in (parent_of[v] for v in nodes)]
