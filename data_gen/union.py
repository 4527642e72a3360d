"""Union trees: one sampled union tree per draw holds a valid sample of every (K, L1, L2) action's delayed tree.

A union tree (algorithms.md §3.4, §3.7) is

* a trunk of ``2·L_max`` tokens drawn one by one from q;
* at every trunk depth d = 0..L_max, ``K_max`` branches of ``L_max`` tokens: branch 0 is the trunk's own
  continuation (trunk tokens d+1..d+L_max) and branches 1..K_max-1 are fresh i.i.d. draws from the trunk node.

The (K, L1, L2) tree is the trunk cut at L1 plus the first K branches at depth L1 cut at L2. Prefixes of i.i.d.
samples are i.i.d., so this is a sample of the action's tree law. Because branch 0 continues the trunk,
equivalent actions ((1, a, b), (K, a + b, 0), ...) get the *same* tree and hence the same label.

Several union trees share one :class:`UnionForest`, a prefix tree of distinct prefixes: each prefix is run once
through each model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decode.drafting.actions import Action
from decode.drafting.tree import ROOT, delayed_tree

# expand(nodes) -> (len(nodes), V) draft distributions after each node's prefix; the forest is passed too.
Expand = Callable[["UnionForest", list[int]], torch.Tensor]

@dataclass
class UnionSample:
    """One union tree inside a forest, as forest node ids.

    Attributes:
        trunk: nodes at trunk depth 0..2·L_max (``trunk[0]`` is the root).
        branches: ``branches[d][b]`` = the L_max nodes of branch b at trunk depth d (branch 0 = the trunk's).
    """

    trunk: list[int]
    branches: list[list[list[int]]] = field(default_factory=list)


@dataclass
class UnionForest:
    """Distinct prefixes of several union trees (node 0 = the root), with the draft rows of expanded nodes."""

    k_max: int
    l_max: int
    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    samples: list[UnionSample] = field(default_factory=list)
    q_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    _child: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int:
        """The node for prefix(node) + token, created if new."""
        key = (node, int(token))
        if key not in self._child:
            self._child[key] = len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(node)
        return self._child[key]

    def internal_nodes(self) -> list[int]:
        """Nodes with at least one child, in node order. Only their p and q rows enter any label: a leaf's
        rows would only serve the bonus token, which no expectation depends on."""
        has_child = set(self.parents[1:])
        return [v for v in range(self.num_nodes) if v in has_child]

    def sample_internal_nodes(self) -> list[list[int]]:
        """Per union sample, its internal nodes other than the root, in node order (a parent before its
        children, since nodes are numbered as they are created)."""
        internal = set(self.internal_nodes()) - {ROOT}
        out = []
        for sample in self.samples:
            nodes = set(sample.trunk)
            for branches in sample.branches:
                for branch in branches:
                    nodes.update(branch)
            out.append(sorted(nodes & internal))
        return out

    def q_matrix(self) -> torch.Tensor:
        """``(n, V)`` draft rows in node order (zero rows for nodes never expanded: leaves)."""
        first = next(iter(self.q_rows.values()))
        q = torch.zeros(self.num_nodes, first.numel(), dtype=first.dtype)
        for v, row in self.q_rows.items():
            q[v] = row
        return q

    def action_tree(self, sample: int, action: Action):
        """The action's delayed tree in this sample, and the forest node of each of its nodes."""
        union = self.samples[sample]
        k, l1, l2 = action.k, action.l1, action.l2
        if k == 1 or l2 == 0:  # a single path: the trunk, which branch 0 continues
            tree = delayed_tree([self.tokens[v] for v in union.trunk[1 : l1 + l2 + 1]], [[]])
        else:
            branches = union.branches[l1][:k]
            tree = delayed_tree(
                [self.tokens[v] for v in union.trunk[1 : l1 + 1]],
                [[self.tokens[v] for v in branch[:l2]] for branch in branches],
            )
        nodes = [ROOT] * tree.num_nodes
        for u in range(1, tree.num_nodes):
            nodes[u] = self._child[(nodes[tree.parents[u]], tree.tokens[u])]
        return tree, nodes


def sample_categorical(rows: torch.Tensor, generator: torch.Generator) -> list[int]:
    """One draw from each row of ``rows`` ``(n, V)`` (unnormalised, non-negative) by inverse CDF."""
    cdf = torch.cumsum(rows.double(), dim=1)
    total = cdf[:, -1]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from an all-zero draft distribution")
    u = torch.rand(rows.shape[0], dtype=torch.float64, generator=generator) * total
    index = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp_(max=rows.shape[1] - 1)
    out = index.tolist()
    for i, t in enumerate(out):  # rounding can land past the support's last token: step back onto it
        while float(rows[i, t]) <= 0.0:
            t -= 1
        out[i] = t
    return out


def grow_union_forest(
    q_root: torch.Tensor, expand: Expand, num_samples: int, k_max: int, l_max: int, generator: torch.Generator
) -> UnionForest:
    """Draw ``num_samples`` union trees from the root, one draft call per level for all of them.

    Args:
        q_root: ``(V,)`` draft distribution after the root.
        expand: runs the draft over new nodes (their parents already run) and returns their q rows.
        generator: the source of every draw (CPU).
    """
    forest = UnionForest(k_max, l_max)
    forest.q_rows[ROOT] = q_root.detach().float().cpu()
    forest.samples = [UnionSample([ROOT]) for _ in range(num_samples)]
    # Trunks: 2·L_max levels; nodes deeper than 2·L_max - 1 are leaves and need no draft pass.
    for level in range(2 * l_max):
        heads = [s.trunk[-1] for s in forest.samples]
        for sample, node in zip(forest.samples, _draw_children(forest, heads, generator), strict=True):
            sample.trunk.append(node)
        if level < 2 * l_max - 1:
            _expand_new(forest, [s.trunk[-1] for s in forest.samples], expand)
    # Fresh branches 1..K_max-1 at every trunk depth, grown level by level for all samples and depths at once.
    fresh = [[[[] for _ in range(k_max - 1)] for _ in range(l_max + 1)] for _ in forest.samples]
    for level in range(l_max):
        slots = [(i, d, b) for i in range(num_samples) for d in range(l_max + 1) for b in range(k_max - 1)]
        heads = [fresh[i][d][b][-1] if level else forest.samples[i].trunk[d] for i, d, b in slots]
        for (i, d, b), node in zip(slots, _draw_children(forest, heads, generator), strict=True):
            fresh[i][d][b].append(node)
        if level < l_max - 1:
            _expand_new(forest, [fresh[i][d][b][-1] for i, d, b in slots], expand)
    for i, sample in enumerate(forest.samples):
        sample.branches = [[sample.trunk[d + 1 : d + 1 + l_max]] + fresh[i][d] for d in range(l_max + 1)]
    return forest


def _draw_children(forest: UnionForest, heads: list[int], generator: torch.Generator) -> list[int]:
    rows = torch.stack([forest.q_rows[h] for h in heads])
    return [forest.child(h, t) for h, t in zip(heads, sample_categorical(rows, generator), strict=True)]


def _expand_new(forest: UnionForest, nodes: list[int], expand: Expand) -> None:
    new = list(dict.fromkeys(v for v in nodes if v not in forest.q_rows))
    if new:
        for v, row in zip(new, expand(forest, new), strict=True):
            forest.q_rows[v] = row.detach().float().cpu()
