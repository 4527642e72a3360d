"""Exact block-efficiency labels of every (K, L1, L2) action at a root, from shared "union" trees.

One sampled union tree holds a valid sample of every action's delayed tree (algorithms.md §3.4, §3.7):

* a trunk of ``2·L_max`` tokens drawn one by one from q;
* at every trunk depth d = 0..L_max, ``K_max`` branches of ``L_max`` tokens: branch 0 is the trunk's own
  continuation (trunk tokens d+1..d+L_max) and branches 1..K_max-1 are fresh i.i.d. draws from the trunk node.

The (K, L1, L2) tree is the trunk cut at L1 plus the first K branches at depth L1 cut at L2. Prefixes of i.i.d.
samples are i.i.d., so this is a sample of the action's tree law. Because branch 0 continues the trunk,
equivalent actions ((1, a, b), (K, a + b, 0), ...) get the *same* tree and hence the same label.

Several union trees share one :class:`UnionForest`, a prefix tree of distinct prefixes: each prefix is run once
through each model. For top-down (OT) verifiers the labels come from reach probabilities with the solvers'
exact branching, memoised per (node, draws); the reach of a branch node does not depend on L2, so one pass
per (L1, K) gives every L2 by prefix sums. Any other verifier gets its exact expectation on each distinct
action tree, built explicitly; actions whose trees it does not support get NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from decode.drafting import Action
from decode.label_traversal import NodeRows, UnionTraversal
from decode.tree import ROOT, delayed_tree
from decode.verifiers import Verifier
from decode.verifiers.gbv import GreedyBlockVerifier, PathNode
from decode.verifiers.ot import OTVerifier
from decode.verifiers.otlp import NaiveSolver, NSSSolver, SpecInferSolver, SpecTrSolver, accept_prob
from decode.verifiers.traversal import TraversalVerifier

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


# --- labels -----------------------------------------------------------------------------------------------------
@dataclass
class RootLabels:
    """Labels of one root, averaged over the forest's union trees.

    Attributes:
        be: verifier -> ``(A,)`` Ê[τ+1] per action (NaN where the verifier does not support the action's trees).
        accept: OT verifier -> ``(L_max + 1,)`` P(a draw is accepted at trunk depth d with K_max draws).
        l1_by_depth: ``(2·L_max,)`` ‖p − q‖₁ at trunk depth d.
    """

    be: dict[str, np.ndarray]
    accept: dict[str, np.ndarray]
    l1_by_depth: np.ndarray


def label_forest(
    forest: UnionForest, p: torch.Tensor, q: torch.Tensor, verifiers: Sequence[Verifier], actions: Sequence[Action]
) -> RootLabels:
    """Ê[τ+1] of every action for every verifier, averaged over the forest's samples.

    Args:
        p, q: ``(n, V)`` target and draft rows of every forest node (q rows of leaves are never read).
        actions: each with K <= k_max and L1, L2 <= l_max of the forest.
    """
    be, accept = {}, {}
    for verifier in verifiers:
        if is_top_down(verifier):
            tables = [_ot_tables(verifier, forest, s, p, q) for s in range(len(forest.samples))]
            grid = np.mean([t[0] for t in tables], axis=0)
            be[verifier.name] = np.array([grid[a.k - 1, a.l1, a.l2] for a in actions])
            accept[verifier.name] = np.mean([t[1] for t in tables], axis=0)
        else:
            be[verifier.name] = _explicit_labels(verifier, forest, p, q, actions)
    trunks = torch.tensor([s.trunk[: 2 * forest.l_max] for s in forest.samples])
    l1 = (p[trunks] - q[trunks]).abs().sum(-1).mean(0)
    return RootLabels(be, accept, l1.double().numpy())


def is_top_down(verifier: Verifier) -> bool:
    """Top-down verifiers on i.i.d. trees: labels from reach probabilities (RSD drafts another regime)."""
    return isinstance(verifier, OTVerifier) and verifier.name != "rsd"


def _ot_tables(verifier: OTVerifier, forest: UnionForest, index: int, p, q) -> tuple[np.ndarray, np.ndarray]:
    """``be[K-1, L1, L2]`` and the per-depth acceptance of one union tree, from reach probabilities."""
    solver, tokens = verifier.solver, forest.tokens
    sample, k_max, l_max = forest.samples[index], forest.k_max, forest.l_max
    memo: dict[tuple[int, tuple[int, ...]], dict[int, float]] = {}
    single = _SINGLE_DRAW.get(type(solver))
    p_np, q_np = p.numpy(), q.numpy()

    def branching(node: int, draws: tuple[int, ...]) -> dict[int, float]:
        key = (node, draws)
        if key not in memo:
            if single is not None and len(draws) == 1:  # most nodes of a delayed tree have one child
                t = draws[0]
                memo[key] = {t: single(float(p_np[node, t]), float(q_np[node, t]))}
            else:
                memo[key] = solver.branching(p[node], q[node], list(draws))
        return memo[key]

    trunk = sample.trunk
    reach = [1.0]
    for j in range(2 * l_max):
        t = tokens[trunk[j + 1]]
        reach.append(reach[-1] * branching(trunk[j], (t,))[t])
    cum = np.cumsum(reach)
    be = np.empty((k_max, l_max + 1, l_max + 1))
    accept = np.empty(l_max + 1)
    for d in range(l_max + 1):
        be[:, d, 0] = cum[d]
        be[0, d, :] = cum[d : d + l_max + 1]
        branches = sample.branches[d]
        accept[d] = sum(branching(trunk[d], tuple(tokens[b[0]] for b in branches)).values())
        for k in range(2, k_max + 1):
            levels = _branch_level_sums(branching, tokens, trunk[d], branches[:k])
            be[k - 1, d, 1:] = cum[d] + reach[d] * np.cumsum(levels)
    return be, accept


# P(output = t | the single draw is t) in closed form, for the built-in solvers only (a subclass, such as a test's
# negative control, keeps its own ``branching``): every rule but NSS reduces to standard speculative sampling.
_SINGLE_DRAW: dict[type, Callable[[float, float], float]] = {
    NSSSolver: lambda p_t, q_t: p_t,
    NaiveSolver: accept_prob,
    SpecInferSolver: accept_prob,
    SpecTrSolver: accept_prob,
}


def _branch_level_sums(branching, tokens: list[int], tip: int, branches: list[list[int]]) -> list[float]:
    """Σ over distinct nodes at each branch level m = 1..L of P(reach | at the tip)."""
    reach = {tip: 1.0}
    sums = []
    for m in range(len(branches[0])):
        parents = [tip if m == 0 else b[m - 1] for b in branches]
        draws: dict[int, list[int]] = {}
        for parent, branch in zip(parents, branches, strict=True):
            draws.setdefault(parent, []).append(tokens[branch[m]])
        total = 0.0
        for parent, branch in zip(parents, branches, strict=True):
            v = branch[m]
            if v not in reach:
                reach[v] = reach[parent] * branching(parent, tuple(draws[parent]))[tokens[v]]
                total += reach[v]
        sums.append(total)
    return sums


def _canonical(action: Action) -> tuple[int, int, int]:
    """Actions with the same tree in a union sample map to the same key."""
    if action.k == 1 or action.l2 == 0:
        return (1, action.l1 + action.l2, 0)
    return (action.k, action.l1, action.l2)


def _explicit_labels(verifier: Verifier, forest: UnionForest, p, q, actions: Sequence[Action]) -> np.ndarray:
    """Exact expectation on each distinct action tree of each sample (NaN where unsupported), averaged.

    Traversal and GBV themselves (not subclasses: the tests' negative controls override their hooks) share
    work across the trees of a root: Traversal takes the scalar walk of :mod:`decode.label_traversal`, GBV
    reuses its path nodes (order, q̃, BV sums). Any other verifier gets its own expectation on each tree.
    """
    keys = list(dict.fromkeys(_canonical(a) for a in actions))
    if type(verifier) is TraversalVerifier:
        rows = NodeRows(p.numpy(), q.numpy())
        walks = [UnionTraversal(s.trunk, s.branches, forest.tokens, rows) for s in forest.samples]
        values = {key: float(np.mean([w.expected(*key) for w in walks])) for key in keys}
        return np.array([values[_canonical(a)] for a in actions])
    steps: dict[tuple[int, float, float, int], PathNode] = {}
    values = {}
    for key in keys:
        total = 0.0
        for s in range(len(forest.samples)):
            tree, nodes = forest.action_tree(s, Action(*key))
            if not verifier.supports(tree):
                total = float("nan")
                break
            index = torch.tensor(nodes)
            if type(verifier) is GreedyBlockVerifier:
                total += verifier.expected_with_steps(tree, p[index], q[index], _step_cache(steps, nodes))
            else:
                total += verifier.expected_block_efficiency(tree, p[index], q[index])
        values[key] = total / len(forest.samples)
    return np.array([values[_canonical(a)] for a in actions])


def _step_cache(steps: dict, nodes: list[int]):
    """A GBV step factory that reuses path nodes by (forest node, masses, K) across trees."""

    def make_step(u: int, p_u, q_u, mass_below: float, mass_here: float, k: int) -> PathNode:
        key = (nodes[u], mass_below, mass_here, k)
        if key not in steps:
            steps[key] = PathNode(p_u, q_u, mass_below, mass_here, k)
        return steps[key]

    return make_step
