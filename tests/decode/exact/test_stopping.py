"""A single path whose length is a stopping time of the draft's own entropy (the entropy stop rule) keeps every
verifier exactly lossless: the stream criterion on toy pairs, with the rule's threshold placed so that it
stops after some first tokens and not after others."""

from __future__ import annotations

import functools

import pytest

from decode.drafting.sampling import entropy as _entropy
from decode.drafting.tree import single_path
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.harness import ToyPair, emitted_law, stream_error


def entropy(q) -> float:
    return float(_entropy(q))


def stopping_path(pair: ToyPair, max_len: int, threshold: float, rng):
    """The rule of decode.drafting.delayed: before each draw, stop if the draft's entropy at the tip exceeds the
    threshold."""
    tokens: list[int] = []
    while len(tokens) < max_len:
        q = pair.dist(tuple(tokens), "q")
        if entropy(q) > threshold:
            break
        tokens.append(rng.categorical(q))
    return single_path(tokens)


def splitting_threshold(pair: ToyPair) -> float | None:
    """A threshold that lets the root draw but stops after some first tokens and not others, if one exists."""
    first = sorted(entropy(pair.dist((a,), "q")) for a in range(3))
    threshold = (first[0] + first[1]) / 2
    return threshold if entropy(pair.dist((), "q")) <= threshold else None


SEEDS = [s for s in range(1, 60) if splitting_threshold(ToyPair(vocab=3, seed=s)) is not None][:8]


def test_enough_seeds_exercise_the_rule():
    assert len(SEEDS) == 8


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", verifier_names())
def test_entropy_stopping_paths_are_lossless(name, seed):
    pair = ToyPair(vocab=3, seed=seed)
    draft = functools.partial(stopping_path, pair, 3, splitting_threshold(pair))
    law = emitted_law(pair, draft, get_verifier(name))
    assert len({len(out) for out in law}) > 1
    assert stream_error(pair, law, 4) < 1e-9


def peeking_path(pair: ToyPair, max_len: int, rng):
    """Wrong: draws a token, then drops it and stops if it was unlikely under q (the kept draws are not q-draws)."""
    tokens: list[int] = []
    while len(tokens) < max_len:
        q = pair.dist(tuple(tokens), "q")
        token = rng.categorical(q)
        if float(q[token]) < float(q.max()):
            break
        tokens.append(token)
    return single_path(tokens)


@pytest.mark.parametrize("name", ["specinfer", "traversal", "block"])
def test_a_stop_rule_that_peeks_at_the_draw_is_caught(name):
    worst = 0.0
    for seed in SEEDS[:3]:
        pair = ToyPair(vocab=3, seed=seed)
        law = emitted_law(pair, functools.partial(peeking_path, pair, 3), get_verifier(name))
        worst = max(worst, stream_error(pair, law, 4))
    assert worst > 1e-6
