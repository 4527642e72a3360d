"""Draft-tree structure: multiplicity, draw order, depths, ancestry, builders and refusal of bad trees."""

from __future__ import annotations

import pytest
import torch

from decode.drafting.tree import (
    InvalidTreeError,
    Regime,
    delayed_tree,
    delayed_tree_size,
    nested_tree,
    root_paths,
    single_path,
)


def test_duplicate_draws_share_a_node_and_keep_multiplicity():
    tree = root_paths([[5, 7], [5, 8], [6, 7]])
    root_draws = tree.draw_tokens(0)
    assert root_draws == [5, 5, 6]  # draw order with repeats
    node5 = tree.child_with_token(0, 5)
    assert tree.draw_tokens(node5) == [7, 8]
    assert len(tree.children[0]) == 2
    assert tree.shape == (3, 0, 2) and tree.is_root_paths and not tree.is_single_path


def test_delayed_tree_structure():
    tree = delayed_tree([1, 2], [[3, 4], [3, 5]])
    assert tree.shape == (2, 2, 2)
    assert tree.depths == (0, 1, 2, 3, 4, 4)
    assert tree.draw_tokens(tree.child_with_token(0, 1)) == [2]  # trunk nodes have exactly one draw
    tip = tree.path_to(2)[-1]
    assert tree.draw_tokens(tip) == [3, 3]
    assert tree.max_depth == 4
    assert not tree.is_root_paths
    assert delayed_tree_size(2, 2, 2) == 6


def test_ancestry_mask():
    tree = delayed_tree([1], [[2], [3]])
    anc = tree.ancestry
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(anc, expected)


def test_first_path_and_single_path():
    tree = delayed_tree([1], [[2, 3], [4, 5]])
    first = tree.first_path()
    assert first.tokens[1:] == (1, 2, 3)
    assert first.is_single_path and first.shape == (1, 3, 0)
    assert single_path([]).num_nodes == 1


def test_nested_without_replacement_tree():
    tree = nested_tree({(): [2, 0], (2,): [1], (0,): [1, 2]}, Regime.WITHOUT_REPLACEMENT)
    assert tree.draw_tokens(0) == [2, 0]
    assert tree.num_nodes == 6
    with pytest.raises(InvalidTreeError, match="cannot draw the same child twice"):
        nested_tree({(): [1, 1]}, Regime.WITHOUT_REPLACEMENT)
    with pytest.raises(InvalidTreeError, match="not in the tree"):
        nested_tree({(3,): [1]}, Regime.DETERMINISTIC)


@pytest.mark.parametrize(
    ("tokens", "parents", "draws", "message"),
    [
        ((0,), (-1,), ((),), "must be the root"),
        ((-1, 1), (-1, 1), ((1,), ()), "must precede"),
        ((-1, 1), (-1, 0), ((), ()), "never drawn"),
        ((-1, 1), (-1, 0), ((1,), (1,)), "not its child"),
        ((-1, 1), (-1, 0), ((1,),), "same non-zero length"),
    ],
)
def test_inconsistent_trees_are_refused(tokens, parents, draws, message):
    from decode.drafting.tree import DraftTree

    with pytest.raises(InvalidTreeError, match=message):
        DraftTree(tokens, parents, draws, Regime.IID)


def test_branches_must_share_a_length():
    with pytest.raises(InvalidTreeError):
        delayed_tree([], [[1, 2], [3]])
    with pytest.raises(InvalidTreeError):
        delayed_tree([], [])
