"""Union-tree labels: the fast top-down path equals each action tree's exact expectation, labels are unbiased,
bounded, and equal for equivalent actions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.synthetic_pair import SyntheticPair
from data_gen.labels import label_forest, tree_labels
from data_gen.union import grow_union_forest
from decode.drafting.actions import Action, action_grid
from decode.verifiers import get_verifier
from tests.decode.exact.harness import ToyPair, enumerate_runs, sample_delayed

ALL = ["nss", "naive", "specinfer", "spectr", "traversal", "gbv"]


def _prefix(forest, v: int) -> tuple[int, ...]:
    out = []
    while v > 0:
        out.append(forest.tokens[v])
        v = forest.parents[v]
    return tuple(reversed(out))


def _forest(pair, samples: int, k_max: int, l_max: int, seed: int):
    def expand(forest, nodes):
        return torch.stack([pair.dist(_prefix(forest, v), "q") for v in nodes])

    forest = grow_union_forest(pair.dist((), "q"), expand, samples, k_max, l_max, torch.Generator().manual_seed(seed))
    p = torch.stack([pair.dist(_prefix(forest, v), "p") for v in range(forest.num_nodes)])
    return forest, p, forest.q_matrix().to(p.dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_down_labels_equal_explicit_trees(seed):
    pair = SyntheticPair(vocab=10, seed=seed, scale=2.0)
    forest, p, q = _forest(pair, samples=2, k_max=3, l_max=3, seed=seed)
    actions = action_grid(3, 3)
    labels = label_forest(forest, p, q, [get_verifier(n) for n in ALL[:4]], actions)
    for name in ALL[:4]:
        explicit = tree_labels(get_verifier(name), forest, p, q, actions).mean(axis=0)
        np.testing.assert_allclose(labels.be[name], explicit, rtol=0, atol=1e-12)


def test_bounds_and_equivalent_actions_agree_exactly():
    pair = SyntheticPair(vocab=16, seed=5, scale=3.0)
    forest, p, q = _forest(pair, samples=3, k_max=4, l_max=4, seed=7)
    actions = action_grid(4, 4)
    labels = label_forest(forest, p, q, [get_verifier(n) for n in ALL], actions)
    index = {(a.k, a.l1, a.l2): i for i, a in enumerate(actions)}
    for name, be in labels.be.items():
        for a, value in zip(actions, be, strict=True):
            if math.isnan(value):
                assert name == "gbv" and a.k > 1 and a.l1 > 0 and a.l2 > 0
                continue
            assert 1.0 - 1e-12 <= value <= a.l1 + a.l2 + 1 + 1e-12, (name, a, value)
        for k in range(1, 5):
            assert be[index[(k, 0, 0)]] == 1.0
            for a in range(5):
                for b in range(5 - a):
                    # (1, a, b), (k, a + b, 0) and (1, a + b, 0) are the same single path in every union sample
                    assert be[index[(1, a, b)]] == be[index[(k, a + b, 0)]] == be[index[(1, a + b, 0)]]
    assert set(labels.accept) == {"nss", "naive", "specinfer", "spectr"}
    assert labels.l1_by_depth.shape == (8,)


def test_leaf_rows_are_never_read():
    pair = SyntheticPair(vocab=12, seed=3, scale=2.0)
    forest, p, q = _forest(pair, samples=2, k_max=3, l_max=3, seed=3)
    actions = action_grid(3, 3)
    verifiers = [get_verifier(n) for n in ALL]
    full = label_forest(forest, p, q, verifiers, actions)
    inner = forest.internal_nodes()
    leaves = torch.ones(forest.num_nodes, dtype=torch.bool)
    leaves[inner] = False
    p0, q0 = p.clone(), q.clone()
    p0[leaves], q0[leaves] = 0.0, 0.0
    cut = label_forest(forest, p0, q0, verifiers, actions)
    for name in full.be:
        np.testing.assert_array_equal(full.be[name], cut.be[name])


@pytest.mark.parametrize("name", ["specinfer", "traversal", "spectr"])
@pytest.mark.parametrize("action", [(2, 1, 1), (3, 0, 2), (1, 1, 1), (2, 2, 0)])
def test_labels_are_unbiased(name, action):
    """Mean label over many union trees vs the exact E[τ+1] (every tree of the action enumerated): within 4 SE."""
    pair = ToyPair(vocab=3, seed=11)
    verifier = get_verifier(name)
    k, l1, l2 = action

    def tree_value(rng):
        tree = sample_delayed(pair, k, l1, l2, rng)
        p, q = pair.tree_rows(tree)
        return verifier.expected_block_efficiency(tree, p, q)

    exact = sum(prob * value for prob, value in enumerate_runs(tree_value))
    draws = []
    for seed in range(300):
        forest, p, q = _forest(pair, samples=1, k_max=3, l_max=2, seed=seed)
        draws.append(float(label_forest(forest, p, q, [verifier], [Action(k, l1, l2)]).be[name][0]))
    mean, se = float(np.mean(draws)), float(np.std(draws, ddof=1) / np.sqrt(len(draws)))
    assert abs(mean - exact) <= 4 * se + 1e-12, (mean, exact, se)
    assert se > 0 or l1 + l2 == 0


def test_unbiasedness_check_catches_a_biased_sampler(monkeypatch):
    """Negative control: fresh branches that copy the trunk's tokens are not i.i.d.; the 4-SE check must fail."""
    import data_gen.union as labels_module

    pair = ToyPair(vocab=3, seed=11)
    verifier = get_verifier("specinfer")

    def tree_value(rng):
        tree = sample_delayed(pair, 3, 0, 2, rng)
        p, q = pair.tree_rows(tree)
        return verifier.expected_block_efficiency(tree, p, q)

    exact = sum(prob * value for prob, value in enumerate_runs(tree_value))
    real_draw = labels_module._draw_children

    def copying_draw(forest, heads, generator):
        children = real_draw(forest, heads, generator)
        # every head that is a trunk node reuses the trunk's next token instead of a fresh draw
        trunk_next = {s.trunk[j]: s.trunk[j + 1] for s in forest.samples for j in range(len(s.trunk) - 1)}
        return [trunk_next.get(h, c) for h, c in zip(heads, children, strict=True)]

    monkeypatch.setattr(labels_module, "_draw_children", copying_draw)
    draws = []
    for seed in range(300):
        forest, p, q = _forest(pair, samples=1, k_max=3, l_max=2, seed=seed)
        draws.append(float(label_forest(forest, p, q, [verifier], [Action(3, 0, 2)]).be["specinfer"][0]))
    mean, se = float(np.mean(draws)), float(np.std(draws, ddof=1) / np.sqrt(len(draws)))
    assert abs(mean - exact) > 4 * se


@pytest.mark.parametrize("name", ["traversal", "gbv"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_shared_work_labels_equal_the_verifiers_own_expectation(seed, sparse, name):
    """Traversal's scalar fold walk (data_gen/label_traversal.py) and GBV's shared path nodes give each tree's own
    expectation, also when the target gives drafted tokens probability 0 (weights of 0, early-outs)."""
    pair = SyntheticPair(vocab=6 + seed, seed=seed, scale=2.0 + seed)
    forest, p, q = _forest(pair, samples=3, k_max=4, l_max=4, seed=seed)
    if sparse:
        keep = torch.rand(p.shape, generator=torch.Generator().manual_seed(seed)) < 0.6
        keep[:, 0] = True
        p = p * keep
        p = p / p.sum(-1, keepdim=True)
    actions = action_grid(4, 4)
    verifier = get_verifier(name)
    reference = []
    for a in actions:
        per_sample = []
        for s in range(len(forest.samples)):
            tree, nodes = forest.action_tree(s, a)
            index = torch.tensor(nodes)
            ok = verifier.supports(tree)
            per_sample.append(verifier.expected_block_efficiency(tree, p[index], q[index]) if ok else math.nan)
        reference.append(np.mean(per_sample))
    labels = tree_labels(verifier, forest, p, q, actions).mean(axis=0)
    assert np.isfinite(labels).sum() > len(actions) // 3
    np.testing.assert_allclose(labels, reference, rtol=0, atol=1e-12)


def _walk_whole_tree(tree, p, q) -> float:
    """E[τ+1] of a whole tree by the collector's scalar Traversal walk (the root as the walk's top)."""
    from decode.verifiers.traversal import FoldState, NodeRows, expected_walk

    nodes = range(tree.num_nodes)
    children = {u: list(tree.children[u]) for u in nodes}
    parents = {u: tree.parents[u] for u in nodes if u > 0}
    state = FoldState(0, 1.0, children, parents, dict(enumerate(tree.depths)), tree.tokens,
                      NodeRows(p.numpy(), q.numpy()))
    total, alive = expected_walk(state)
    return total + alive


def test_scalar_traversal_walk_on_without_replacement_trees():
    """The walk on trees with merged prefixes and several children per node, beyond the union trees' shapes."""
    from decode.drafting.tree import Regime, nested_tree

    rng = np.random.default_rng(0)
    verifier = get_verifier("traversal")
    for _ in range(20):
        vocab = int(rng.integers(4, 9))
        children: dict[tuple[int, ...], list[int]] = {(): list(rng.choice(vocab, size=3, replace=False))}
        for prefix in [(int(t),) for t in children[()][:2]]:
            children[prefix] = [int(t) for t in rng.choice(vocab, size=int(rng.integers(1, 3)), replace=False)]
        tree = nested_tree(children, Regime.WITHOUT_REPLACEMENT)
        p = torch.tensor(rng.dirichlet(np.full(vocab, 0.5), size=tree.num_nodes))
        q = torch.tensor(rng.dirichlet(np.full(vocab, 0.5), size=tree.num_nodes))
        fast = _walk_whole_tree(tree, p, q)
        assert fast == pytest.approx(verifier.expected_block_efficiency(tree, p, q), abs=1e-12)


def test_per_tree_labels_and_trunk_acceptances():
    """Each union tree's own labels, whose mean is the stored label; the trunk acceptances by definition."""
    pair = SyntheticPair(vocab=10, seed=4, scale=2.0)
    forest, p, q = _forest(pair, samples=3, k_max=3, l_max=3, seed=4)
    actions = action_grid(3, 3)
    labels = label_forest(forest, p, q, [get_verifier(n) for n in ("specinfer", "traversal")], actions)
    for name, trees in labels.be_trees.items():
        assert trees.shape == (3, len(actions))
        np.testing.assert_allclose(trees.mean(axis=0), labels.be[name], rtol=0, atol=1e-12)
        for s in range(3):  # tree s's value is the verifier's exact expectation on tree s alone
            tree, nodes = forest.action_tree(s, Action(2, 1, 2))
            index = torch.tensor(nodes)
            want = get_verifier(name).expected_block_efficiency(tree, p[index], q[index])
            assert trees[s, actions.index(Action(2, 1, 2))] == pytest.approx(want, abs=1e-12)
    assert labels.trunk_accept.shape == labels.trunk_beta.shape == (3, 6)
    for s, sample in enumerate(forest.samples):
        for j in range(6):
            node, child = sample.trunk[j], sample.trunk[j + 1]
            token = forest.tokens[child]
            assert labels.trunk_accept[s, j] == pytest.approx(min(1.0, float(p[node, token] / q[node, token])))
            assert labels.trunk_beta[s, j] == pytest.approx(float(torch.minimum(p[node], q[node]).sum()))
