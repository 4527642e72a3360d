"""Stopping on what was emitted (``SpeculativeDecoder.generate(on_step=...)``: a server's stop strings, a client gone)
keeps the output exact: the law of the output cut at the first stop token equals the target's law of its own
continuations cut the same way.

Exact enumeration through the real loop (tiny HF models, 3 tokens, :mod:`tests.decode.exact.harness`): a caller
stops the generation once the stop token has been emitted, and keeps the tokens up to and including it. Negative
control: a caller that, on seeing the stop token, drops the whole step that held it (trimming by steps instead of
by tokens) must be caught; the real trim passes the same cases.
"""

from __future__ import annotations

import pytest

from decode.drafting.actions import Action
from decode.engine import SpeculativeDecoder
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.harness import enumerate_runs, outcome_law
from tests.decode.exact.test_expander_loop import LATENCY, PROMPT, SAMPLING, TOKENS, TOL, pair, target_law

STOP = 1


def cut(tokens) -> tuple[int, ...]:
    """The tokens up to and including the first stop token."""
    tokens = list(tokens)
    return tuple(tokens[: tokens.index(STOP) + 1] if STOP in tokens else tokens)


def stopped_law(decoder: SpeculativeDecoder, shape: Action, drop_step: bool = False) -> dict:
    """Law of the output of a caller that stops once the stop token is out; ``drop_step``: the wrong trim."""

    def run(rng):
        kept: list[int] = []

        def on_step(emitted: list[int]) -> bool:
            if STOP in emitted and drop_step:
                return False  # the step that held the stop token is never kept
            kept.extend(emitted)
            return STOP not in kept

        decoder.generate(PROMPT, TOKENS, StaticPolicy(shape), rng, SAMPLING, on_step=on_step)
        return cut(kept)

    return outcome_law(enumerate_runs(run))


def expected_law(target) -> dict:
    out: dict = {}
    for tokens, prob in target_law(target).items():
        out[cut(tokens)] = out.get(cut(tokens), 0.0) + prob
    return out


def error(got: dict, want: dict) -> float:
    return max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want))


def _shape(name: str) -> Action:
    return Action(2, 1, 1) if get_verifier(name).supports_action(2, 1, 1) else Action(1, 2, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", verifier_names())
def test_stopping_on_emitted_tokens_is_exact(name):
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    got = stopped_law(decoder, _shape(name))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert error(got, expected_law(target)) < TOL


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_caller_that_drops_the_step_holding_the_stop_is_caught(name):
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    want = expected_law(target)
    assert error(stopped_law(decoder, Action(1, 2, 0), drop_step=True), want) > 100 * TOL
    assert error(stopped_law(decoder, Action(1, 2, 0)), want) < TOL
