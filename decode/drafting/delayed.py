"""Drafting (K, L1, L2)-delayed trees with a cached draft model.

The trunk is drafted token by token; then the K branches grow breadth-first, one draft call per level over the
level's distinct new nodes (branches that drew the same token share a node, so the call never repeats a
prefix). Only nodes that will have children are run through the draft: leaves need no q.

The q stored for a node is exactly the distribution its children were drawn from. For RSD the branching
node draws its K children without replacement, and each branch then continues as a single path. A draft with a
draft vocabulary hands over its ``(n, Vs)`` logits only: the laws are sampled at that width, and the rows the
verifier reads are widened to ``(n, V)`` with zeros at the ids the draft never proposes.

Expansion decided while drafting: given a ``halting`` callable, the trunk asks it at every node it reaches (depth 0,
the root, up to L1 − 1) whether to stop growing there; the K branches of L2 tokens (or nothing, for a single path)
are then drafted at the halting depth. The callable sees a :class:`TrunkNode`, the draft's own state at that node,
so the halting depth is a stopping time of the draft's draws and every verifier of delayed trees stays exact
(tests/decode/exact/test_expander_loop.py).

The rule is one generator, :func:`delayed_tree_steps`, that yields each draft call's nodes and leaves running them to
its caller: :func:`draft_delayed_tree` runs them on the draft's own cache, and a batch (decode/batch.py) runs the calls
of several requests' trees as one forward. Both draw the same tokens from the same laws.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from decode.drafting.actions import Action
from decode.drafting.rng import RandomSource
from decode.drafting.sampling import SamplingConfig, distributions
from decode.drafting.tree import ROOT, DraftTree, Regime, TreeBuilder
from decode.models.cached_lm import CachedLM, run_nodes
from decode.models.draft_vocab import support_ids


@dataclass(frozen=True)
class Draw:
    """A trunk token as drawn: its probability under the law it was drawn from, its rank there (0: that law's most
    likely token; ties share the better rank) and that law's top probability."""

    q: float
    rank: int
    top: float


def draw_of(law: torch.Tensor, index: int) -> Draw:
    """The :class:`Draw` of entry ``index`` of ``law`` ``(V,)`` (or over a draft's support ``(Vs,)``: entries off
    the support hold no mass, so both give the same draw)."""
    prob = law[index]
    return Draw(float(prob), int((law > prob).sum()), float(law.max()))


@dataclass
class TrunkNode:
    """What a per-node decision may see at a trunk node: its depth (0 = the root), the draft's law there (the one
    the next trunk token is drawn from) over the draft's support ``(Vs,)``, or ``(V,)`` for a draft without a
    draft vocabulary, the draft's final hidden state there ``(H,)`` (None when the draft was not asked for
    hidden states), and the trunk tokens drawn on the way to it (``draws[j]``: the token at depth j + 1, drawn from
    the law at depth j). The law is the one drawn from, so a signal of it (top probability, entropy) is the full
    law's: the rest of the vocabulary holds no mass. Nothing here is the token the node is about to draw."""

    depth: int
    q: torch.Tensor
    hidden: torch.Tensor | None
    draws: tuple[Draw, ...] = ()


@dataclass
class DraftedTree:
    """A drafted tree and what the loop needs from the draft pass.

    Attributes:
        tree: the tree (root = the context's last token).
        q: ``(n, V)`` draft distributions at every node (zero rows at leaves, which draw nothing).
        slots: draft-cache slot of each node, or -1 for nodes the draft never ran (leaves).
        draft_calls: draft forward calls made.
        hidden: final draft hidden state ``(H,)`` of each node the draft ran (root excluded), when asked for.
        trunk_depth: the trunk's length (below the action's L1 where drafting halted or stopped it early).
    """

    tree: DraftTree
    q: torch.Tensor
    slots: list[int]
    draft_calls: int
    hidden: dict[int, torch.Tensor] | None = None
    trunk_depth: int | None = None


def draft_delayed_tree(
    draft: CachedLM,
    q_root: torch.Tensor,
    action: Action,
    sampling: SamplingConfig,
    rng: RandomSource,
    without_replacement: bool = False,
    output_hidden: bool = False,
    halting: Callable[[TrunkNode], bool] | None = None,
    root_hidden: torch.Tensor | None = None,
) -> DraftedTree:
    """Draft one delayed tree from the draft model's committed tip.

    Args:
        draft: the draft model; its committed tip is the root token (already run).
        q_root: ``(V,)`` draft distribution after the root (already sampled through ``sampling``).
        action: the shape.
        sampling: the transform applied to the draft's logits (the same one the target's p goes through).
        rng: source of the draws.
        without_replacement: draw the K children of the branching node without replacement (RSD's regime).
        output_hidden: keep the draft's final hidden state of every node it runs (for root features).
        halting: asked at each trunk node before its child is drawn; True ends the trunk there and drafts the
            action's K branches of L2 (a single path when K = 1 or L2 = 0) from that node. ``action.l1`` caps it.
        root_hidden: ``(H,)`` the draft's hidden state at the root, for ``halting`` at depth 0.
    """
    state = TreeDrafting(draft, q_root, sampling, rng, output_hidden)
    steps = delayed_tree_steps(state, action, without_replacement, halting, root_hidden)
    try:
        nodes = next(steps)
        while True:
            state.expand(nodes)
            nodes = next(steps)
    except StopIteration as done:
        return done.value


def delayed_tree_steps(state: TreeDrafting, action: Action, without_replacement: bool = False,
                       halting: Callable[[TrunkNode], bool] | None = None,
                       root_hidden: torch.Tensor | None = None) -> Generator[list[int], None, DraftedTree]:
    """:func:`draft_delayed_tree`'s rule as a generator, so that a caller may run the draft calls of several trees
    as one forward (decode/batch.py). It yields the nodes each draft call runs (parents before children); before it
    is resumed, those nodes' laws must be in ``state`` (:meth:`TreeDrafting.expand` runs them on ``state.draft``,
    :meth:`TreeDrafting.absorb` takes logits run elsewhere). It returns the drafted tree. The draws, their order and
    the laws they come from are the same whoever runs the calls, so the q each draw was sampled from is the q
    handed on. Arguments as :func:`draft_delayed_tree`'s."""
    rng = state.rng
    tip, depth = ROOT, 0
    draws: tuple[Draw, ...] = ()
    for j in range(action.l1):
        if halting is not None and halting(TrunkNode(j, state.laws[tip], state.hidden.get(tip, root_hidden), draws)):
            break
        parent, (tip, index) = tip, state.draw_index(tip)
        depth = j + 1
        if halting is not None:  # the draw, for the next nodes' decisions (after it was made, never before)
            draws = (*draws, draw_of(state.laws[parent], index))
        if j < action.l1 - 1 or action.l2 > 0:
            yield [tip]
    if action.is_single_path and depth < action.l1:
        return state.finish(state.builder.build(Regime.IID, (1, depth, 0)), depth)
    heads = [tip] * (action.k if action.l2 > 0 else 0)
    for level in range(action.l2):
        if level == 0 and without_replacement:
            heads = _distinct_children(state.builder, tip, state.laws[tip], state.support, action.k, rng)
        else:
            heads = [state.draw(node) for node in heads]
        if level < action.l2 - 1:
            yield list(dict.fromkeys(v for v in heads if v not in state.laws))
    regime = Regime.WITHOUT_REPLACEMENT if without_replacement else Regime.IID
    return state.finish(state.builder.build(regime, None if without_replacement else (action.k, depth, action.l2)),
                        depth)


def expand_nodes(draft: CachedLM, nodes: list[int], tokens: Sequence[int], parent_of: Sequence[int],
                 slots: dict[int, int], sampling: SamplingConfig, hidden: dict[int, torch.Tensor] | None = None,
                 on_support: bool = False) -> torch.Tensor:
    """One draft call over tree nodes whose parents were run: the laws their children are drawn from.

    Args:
        draft: the draft; the tree hangs off its cache (``slots`` maps run nodes to cache slots, and gains these).
        nodes: the nodes to run, parents before children.
        tokens, parent_of: every node's token and parent node (by node index).
        sampling: the transform of the draft's logits.
        hidden: gains each node's final draft hidden state ``(H,)`` when given.
        on_support: laws over the draft's support ``(n, Vs)`` (:func:`~decode.models.draft_vocab.support_ids`).

    Returns:
        ``(n, V)`` laws (``(n, Vs)`` on the support), row i for ``nodes[i]``.
    """
    out = run_nodes(draft, nodes, tokens, parent_of, slots, output_hidden=hidden is not None, on_support=on_support)
    logits, states = out if hidden is not None else (out, None)
    return node_laws(nodes, logits, states, sampling, hidden)


def node_laws(nodes: list[int], logits: torch.Tensor, states: torch.Tensor | None, sampling: SamplingConfig,
              hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The laws ``(n, V)`` (``(n, Vs)`` from logits on a draft's support) of ``nodes`` from their draft logits; with
    ``hidden`` and ``states`` ``(n, H)`` given, ``hidden`` gains each node's state."""
    if hidden is not None and states is not None:
        hidden.update(zip(nodes, states, strict=True))
    return distributions(logits, sampling)


class TreeDrafting:
    """One tree's drafting state: the growing tree, each run node's law over the draft's support ``(Vs,)`` (or
    ``(V,)``), slot and hidden state, and the draft calls made.

    ``root_slot``: the root's slot in the draft's cache (None: its last slot, the committed tip of a cache that
    holds one sequence; a cache shared by several sequences names it)."""

    def __init__(self, draft: CachedLM, q_root: torch.Tensor, sampling: SamplingConfig, rng: RandomSource,
                 output_hidden: bool, root_slot: int | None = None) -> None:
        self.draft, self.q_root, self.sampling, self.rng = draft, q_root, sampling, rng
        self.builder = TreeBuilder()
        # Laws are kept over the draft's support (its draft vocabulary's ids, None: all V): the draft's softmax and
        # every draw then run over Vs entries, not V. q_root is zero off the support, so its cut is the same law.
        self.support = support_ids(draft.model)
        self.laws = {ROOT: q_root if self.support is None else q_root.index_select(0, self.support)}
        self.slots = {ROOT: draft.length - 1 if root_slot is None else root_slot}
        self.hidden: dict[int, torch.Tensor] = {}
        self.output_hidden, self.calls = output_hidden, 0

    def expand(self, nodes: list[int]) -> None:
        """One draft call over ``nodes`` (children of already-run nodes): their laws, slots and hidden states."""
        out = run_nodes(self.draft, nodes, self.builder.tokens, self.builder.parents, self.slots,
                        output_hidden=self.output_hidden, on_support=self.support is not None)
        self.absorb(nodes, *(out if self.output_hidden else (out, None)))

    def absorb(self, nodes: list[int], logits: torch.Tensor, states: torch.Tensor | None = None) -> None:
        """The laws of ``nodes`` from one draft call run elsewhere (their slots already in ``slots``): logits
        ``(n, Vs)`` on the draft's support where it has one, else ``(n, V)``; final states ``(n, H)`` or None."""
        laws = node_laws(nodes, logits, states, self.sampling, self.hidden if self.output_hidden else None)
        self.laws.update(zip(nodes, laws, strict=True))
        self.calls += 1

    def draw(self, node: int) -> int:
        """A child of ``node`` drawn from its law: the child's node index."""
        return self.draw_index(node)[0]

    def draw_index(self, node: int) -> tuple[int, int]:
        """A child of ``node`` drawn from its law: (the child's node index, the drawn entry of the law)."""
        index = self.rng.categorical(self.laws[node])
        return self.builder.draw(node, token_id(self.support, index)), index

    def finish(self, tree: DraftTree, depth: int) -> DraftedTree:
        return _finish(tree, self.q_root, self.laws, self.support, self.slots,
                       self.hidden if self.output_hidden else None, self.calls, depth)


def token_id(support: torch.Tensor | None, index: int) -> int:
    """The token id of entry ``index`` of a law over ``support`` ``(Vs,)`` (None: the full vocabulary, ids as is)."""
    return index if support is None else int(support[index])


def _finish(tree: DraftTree, q_root: torch.Tensor, laws: dict[int, torch.Tensor], support: torch.Tensor | None,
            slots: dict[int, int], hidden: dict[int, torch.Tensor] | None, calls: int, depth: int) -> DraftedTree:
    """The drafted tree with its q ``(n, V)``: the root's q_root as given, each run node's law widened to V (zeros
    off the support), zero rows at leaves."""
    q = torch.zeros(tree.num_nodes, q_root.numel(), dtype=q_root.dtype, device=q_root.device)
    q[ROOT] = q_root
    rows = [v for v in laws if v != ROOT]
    if rows:
        stacked = torch.stack([laws[v] for v in rows])  # (r, Vs) or (r, V)
        index = torch.tensor(rows, device=q.device)
        if support is None:
            q[index] = stacked
        else:
            q[index.unsqueeze(1), support.unsqueeze(0)] = stacked
    slot_list = [slots.get(v, -1) for v in range(tree.num_nodes)]
    return DraftedTree(tree, q, slot_list, calls, hidden, depth)


def _distinct_children(builder: TreeBuilder, node: int, law: torch.Tensor, support: torch.Tensor | None, k: int,
                       rng: RandomSource) -> list[int]:
    """Draw up to k distinct children of ``node`` sequentially without replacement from its law (over
    ``support``)."""
    weights = law.clone()
    children = []
    for _ in range(min(k, int((weights > 0).sum()))):
        index = rng.categorical(weights)
        weights[index] = 0.0
        children.append(builder.draw(node, token_id(support, index)))
    return children
