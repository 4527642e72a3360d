"""Expansion decided while drafting keeps every verifier of delayed trees exact: the trunk grows node by node and a
rule that sees only the draft's own law at the node (here its top probability) continues, stops, or branches into
K i.i.d. branches of L2 tokens there. The branching depth is then a stopping time of the draft's filtration. The
stream criterion on toy pairs, with thresholds placed so that every outcome happens on some path; and a rule that
looks at the branch draws before choosing K must be caught."""

from __future__ import annotations

import functools

import pytest

from decode.drafting.tree import ROOT, Regime, TreeBuilder
from tests.decode.exact.harness import ToyPair, emitted_law, stream_error

VERIFIERS = ["nss", "naive", "specinfer", "spectr", "traversal"]


def node_policy_tree(pair: ToyPair, low: float, high: float, k: int, l2: int, max_trunk: int, rng):
    """At each trunk node: top probability of q below ``low`` -> stop; above ``high`` -> go on with the trunk (up
    to ``max_trunk``); in between -> branch into ``k`` i.i.d. branches of ``l2`` tokens here."""
    builder, tip, prefix = TreeBuilder(), ROOT, ()
    depth, branch = 0, False
    while depth < max_trunk:
        q = pair.dist(prefix, "q")
        top = float(q.max())
        if top < low:
            break
        if top <= high:
            branch = True
            break
        token = rng.categorical(q)
        tip, prefix, depth = builder.draw(tip, token), prefix + (token,), depth + 1
    if branch:
        for _ in range(k):
            node, path = tip, prefix
            for _ in range(l2):
                token = rng.categorical(pair.dist(path, "q"))
                node, path = builder.draw(node, token), path + (token,)
        return builder.build(Regime.IID, (k, depth, l2))
    return builder.build(Regime.IID, (1, depth, 0))


def thresholds(pair: ToyPair) -> tuple[float, float] | None:
    """(low, high) so that the root goes on, and the next nodes stop, branch or go on depending on the first draw."""
    root = float(pair.dist((), "q").max())
    tops = sorted(float(pair.dist((a,), "q").max()) for a in range(pair.vocab))
    if not tops[0] < tops[1] < tops[2] or root <= tops[2]:
        return None
    low, high = (tops[0] + tops[1]) / 2, (tops[1] + tops[2]) / 2
    return low, high


SEEDS = [s for s in range(1, 200) if thresholds(ToyPair(vocab=3, seed=s)) is not None][:6]


def test_enough_seeds_exercise_every_decision():
    assert len(SEEDS) == 6


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", VERIFIERS)
def test_node_level_expansion_is_lossless(name, seed):
    from decode.verifiers import get_verifier

    pair = ToyPair(vocab=3, seed=seed)
    low, high = thresholds(pair)
    draft = functools.partial(node_policy_tree, pair, low, high, 2, 1, 2)
    law = emitted_law(pair, draft, get_verifier(name))
    assert stream_error(pair, law, 4) < 1e-9


def test_every_decision_happens_on_some_path():
    """The thresholds make the rule stop, branch and go on: the trees it drafts have several shapes."""
    from tests.decode.exact.harness import enumerate_runs

    pair = ToyPair(vocab=3, seed=SEEDS[0])
    low, high = thresholds(pair)
    shapes = {tree.shape for _, tree in enumerate_runs(functools.partial(node_policy_tree, pair, low, high, 2, 1, 2))}
    assert {s[0] for s in shapes} == {1, 2} and len({s[1] for s in shapes}) >= 2


def peeking_tree(pair: ToyPair, rng):
    """Wrong: draws branch tokens at the root and decides which to keep after looking at them (the first is dropped
    when it is the draft's favourite, and a fresh one kept instead): the kept draw is not a q-draw.

    Deciding to draw *more* after a draw is harmless for these verifiers (a later draw only acts after the earlier
    ones are rejected); choosing which drawn tokens count is not."""
    builder = TreeBuilder()
    q = pair.dist((), "q")
    first = rng.categorical(q)
    kept = rng.categorical(q) if first == int(q.argmax()) else first
    builder.draw(ROOT, kept)
    return builder.build(Regime.IID, (1, 0, 1))


@pytest.mark.parametrize("name", ["specinfer", "spectr", "traversal"])
def test_a_rule_that_looks_at_the_branch_draws_is_caught(name):
    from decode.verifiers import get_verifier

    worst = 0.0
    for seed in SEEDS[:3]:
        pair = ToyPair(vocab=3, seed=seed)
        worst = max(worst, stream_error(pair, emitted_law(pair, functools.partial(peeking_tree, pair),
                                                          get_verifier(name)), 3))
    assert worst > 1e-6
