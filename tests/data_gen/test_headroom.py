"""Head-room figures: the cross-fitted oracle recovers a real per-root optimum, stays at 1 on pure noise (where the
same-tree oracle reads high), and a schema-1 data set says the cross-fitted figures are unavailable."""

from __future__ import annotations

import numpy as np
import pytest

from data_gen.headroom import head_room
from decode.cost.throughput import best_static, stream_throughput

ROOTS, TREES, ACTIONS = 600, 4, 30


def _noisy(mu: np.ndarray, noise: float, seed: int) -> np.ndarray:
    """``(N, s, A)`` per-tree labels: the true per-root Ê ``mu`` plus independent noise per tree."""
    rng = np.random.default_rng(seed)
    noisy = mu[:, None, :] + rng.normal(0.0, noise, (len(mu), TREES, mu.shape[1]))
    return np.maximum(noisy, 1.0)  # a tree's Ê = E[τ+1 | tree] is at least 1


def test_cross_fitted_oracle_recovers_a_learnable_per_root_optimum():
    rng = np.random.default_rng(0)
    step = np.ones((ROOTS, ACTIONS))
    mu = np.full((ROOTS, ACTIONS), 2.0)
    best = rng.integers(0, ACTIONS, ROOTS)
    mu[np.arange(ROOTS), best] = 3.0  # every root has its own clear best action, 50 % above the rest
    trees = _noisy(mu, 0.1, 1)
    room = head_room(trees, trees.mean(axis=1), step, np.arange(ROOTS) // 6)
    true_oracle = stream_throughput(mu, step, best) / stream_throughput(mu, step, np.full(ROOTS, best_static(mu, step)))
    assert room.cross_fitted_oracle == pytest.approx(true_oracle, rel=0.02)
    assert room.same_tree_oracle == pytest.approx(room.cross_fitted_oracle, rel=0.02)  # little noise: both agree
    assert room.cross_fitted_prompt_static < room.cross_fitted_oracle  # one action per prompt cannot follow each root


def test_on_pure_noise_only_the_same_tree_oracle_reads_high():
    """Every action of every root has the same true Ê: no choice can win or lose, whatever the noise suggests."""
    mu = np.full((ROOTS, ACTIONS), 2.0)
    trees = _noisy(mu, 0.4, 2)
    room = head_room(trees, trees.mean(axis=1), np.ones((ROOTS, ACTIONS)), np.arange(ROOTS) // 6)
    assert room.same_tree_oracle > 1.05
    assert room.cross_fitted_oracle == pytest.approx(1.0, abs=0.03)
    assert room.cross_fitted_prompt_static == pytest.approx(1.0, abs=0.03)


def test_a_noisy_choice_among_unequal_actions_reads_below_one():
    """Per-root choices on noisy labels pick worse actions than the best static one: the honest figure can say so."""
    mu = np.tile(np.linspace(2.0, 2.3, ACTIONS), (ROOTS, 1))
    trees = _noisy(mu, 0.4, 3)
    room = head_room(trees, trees.mean(axis=1), np.ones((ROOTS, ACTIONS)), np.arange(ROOTS) // 6)
    assert room.cross_fitted_oracle < 0.99 < 1.0 < room.same_tree_oracle


def test_means_only_leave_the_cross_fitted_figures_unavailable():
    mu = np.tile(np.linspace(2.0, 2.3, ACTIONS), (50, 1))
    room = head_room(None, mu, np.ones_like(mu), np.arange(50))
    assert room.trees == 1 and room.cross_fitted_oracle is None and room.cross_fitted_prompt_static is None
    assert room.same_tree_oracle == pytest.approx(1.0)


def test_actions_without_labels_are_never_static_or_chosen():
    mu = np.full((40, 3), 2.0)
    mu[:, 2] = np.nan  # e.g. GBV on a delayed tree
    mu[:20, 1] = 5.0
    trees = np.repeat(mu[:, None, :], 2, axis=1)
    room = head_room(trees, mu, np.ones_like(mu), np.arange(40))
    assert room.best_static == 1 and np.isfinite(room.cross_fitted_oracle)


def test_a_per_category_static_recovers_categories_with_their_own_best_tree():
    """Two categories whose best actions differ: one action per category wins what one action for all cannot; on
    categories that share their best action it wins nothing."""
    step = np.ones((ROOTS, ACTIONS))
    category = np.arange(ROOTS) % 2
    mu = np.full((ROOTS, ACTIONS), 2.0)
    mu[category == 0, 3] = 3.0
    mu[category == 1, 7] = 3.0
    trees = _noisy(mu, 0.1, 4)
    room = head_room(trees, trees.mean(axis=1), step, np.arange(ROOTS) // 6, groups=category)
    assert room.cross_fitted_group_static == pytest.approx(3.0 / 2.4, rel=0.03)  # vs 1.5 of the roots at 3.0
    shared = np.full((ROOTS, ACTIONS), 2.0)
    shared[:, 3] = 3.0
    trees = _noisy(shared, 0.1, 5)
    same = head_room(trees, trees.mean(axis=1), step, np.arange(ROOTS) // 6, groups=category)
    assert same.cross_fitted_group_static == pytest.approx(1.0, abs=0.01)
    assert head_room(trees, trees.mean(axis=1), step, np.arange(ROOTS) // 6).cross_fitted_group_static is None


def test_step_roots_are_read_as_steps():
    """Easy roots where a long tree makes 6 tokens in 4 ms (a 1-token step makes 2 in 1 ms) and hard roots that cost
    10 ms whatever is drafted. Read as a loop's steps (Σ Ê / Σ T̂) the long tree pays on the easy roots, though its
    Ê / T̂ there is lower, and the oracle takes it only there; read as positions nothing beats the short tree."""
    roots = 40
    easy = np.arange(roots) % 2 == 0
    mu = np.where(easy[:, None], [2.0, 6.0], [1.0, 1.0])
    step = np.where(easy[:, None], [1.0, 4.0], [10.0, 12.0])
    trees = np.repeat(mu[:, None, :], 2, axis=1)
    prompts = np.arange(roots) // 4
    steps = head_room(trees, mu, step, prompts, per_step=True)
    # static long tree: (6 + 1) / (4 + 12) = 7/16 per pair of roots; the oracle: (6 + 1) / (4 + 10) = 1/2
    assert steps.best_static == 1
    assert steps.same_tree_oracle == pytest.approx(8 / 7) and steps.cross_fitted_oracle == pytest.approx(8 / 7)
    positions = head_room(trees, mu, step, prompts)
    assert positions.best_static == 0 and positions.same_tree_oracle == pytest.approx(1.0)
