"""The action contract: a delayed-tree shape (K, L1, L2), its text form, its canonical form and the action grid.

Data sets, selectors, the decoder and the benches all name actions; this module is the one place that says what
an action is, how it is written (``"K,L1,L2"``), which actions draft the same tree, and in which order the grid
lists them (K outermost, then L1, then L2).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """A delayed-tree shape: a trunk of ``l1`` tokens, then ``k`` branches of ``l2`` tokens.

    ``(k, l, 0)`` and ``(1, l1, l2)`` are single paths; ``(k, 0, 0)`` drafts nothing. A policy that decides per
    node (decode/policies/base.py) may cut the trunk short while drafting; the action is then its widest tree.
    """

    k: int
    l1: int
    l2: int

    def __post_init__(self) -> None:
        if not (isinstance(self.k, int) and isinstance(self.l1, int) and isinstance(self.l2, int)):
            raise ValueError(f"an action is three integers K,L1,L2; got {self.k},{self.l1},{self.l2}")
        if self.k < 1 or self.l1 < 0 or self.l2 < 0:
            raise ValueError(f"an action needs K >= 1 and L1, L2 >= 0; got ({self.k}, {self.l1}, {self.l2})")

    @classmethod
    def parse(cls, text: str) -> Action:
        """From 'K,L1,L2'."""
        parts = text.replace(" ", "").split(",")
        try:
            k, l1, l2 = (int(x) for x in parts)
        except ValueError as err:
            raise ValueError(f"an action is 'K,L1,L2' (three integers), got '{text}'") from err
        return cls(k, l1, l2)

    @property
    def depth(self) -> int:
        """Longest drafted path: L1 + L2 (L1 when K branches are empty)."""
        return self.l1 + self.l2

    @property
    def size(self) -> int:
        """Drafted tokens, duplicates counted: L1 + K·L2."""
        return self.l1 + self.k * self.l2

    @property
    def is_single_path(self) -> bool:
        """K = 1 or L2 = 0: one path of ``depth`` tokens."""
        return self.k == 1 or self.l2 == 0

    def canonical(self) -> Action:
        """The one representative of the actions that draft the same tree law.

        (1, a, b), (K, a + b, 0) and (K, a, 0)-style single paths all draft one path of their depth, so they map to
        (1, depth, 0); a real tree (K > 1 and L2 > 0) is its own representative.
        """
        if self.is_single_path:
            return Action(1, self.depth, 0)
        return self

    def clipped(self, max_depth: int) -> Action:
        """The same shape with its depth cut to ``max_depth`` (trunk first), e.g. near the context limit."""
        l1 = min(self.l1, max_depth)
        return Action(self.k, l1, min(self.l2, max_depth - l1))

    @property
    def key(self) -> str:
        """'K,L1,L2', the form actions take in metadata and on the command line."""
        return f"{self.k},{self.l1},{self.l2}"

    def __str__(self) -> str:
        return f"({self.k},{self.l1},{self.l2})"


def action_grid(k_max: int = 4, l_max: int = 8) -> list[Action]:
    """Every (K, L1, L2) with K in 1..k_max and L1, L2 in 0..l_max, K outermost, then L1, then L2."""
    return [Action(k, l1, l2) for k in range(1, k_max + 1) for l1 in range(l_max + 1) for l2 in range(l_max + 1)]


GRID_K_MAX, GRID_L_MAX = 4, 8  # the default grid: what collect labels and a selector chooses from


def check_in_grid(action: Action, k_max: int = GRID_K_MAX, l_max: int = GRID_L_MAX) -> None:
    """ValueError for a shape outside the action grid (up to an equivalent form: a single path of depth up to
    2·l_max is (1, l_max, depth - l_max)). A tree far beyond it costs memory and time with nothing to gain."""
    inside = (action.depth <= 2 * l_max if action.is_single_path
              else action.k <= k_max and action.l1 <= l_max and action.l2 <= l_max)
    if not inside:
        raise ValueError(f"{action} is beyond the action grid (K <= {k_max}, L1 and L2 <= {l_max}): a bigger tree "
                         "only costs memory and time, and no data set or selector covers it")


def action_key(action: Action) -> str:
    """'K,L1,L2' (the same as ``action.key``)."""
    return action.key


def parse_actions(keys: list[str]) -> list[Action]:
    """Actions from their 'K,L1,L2' keys, in order."""
    return [Action.parse(k) for k in keys]


def distinct_trees(actions: Iterable[str], count: int) -> list[str]:
    """The first ``count`` distinct trees among ``actions`` ('K,L1,L2' keys, in order), as canonical keys: (1,0,3),
    (1,3,0) and (1,1,2) draft one tree and count once."""
    out: list[str] = []
    for key in actions:
        canonical = Action.parse(key).canonical().key
        if canonical not in out:
            out.append(canonical)
            if len(out) == count:
                break
    return out
