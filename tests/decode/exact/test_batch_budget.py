"""The shared budget (decode/policies/budget.py) keeps every request of a batch exactly its target's law.

Exact enumeration through the real batch (tests/decode/exact/test_batch.py's harness): the watched request and its
companions share the budget, so each step's chain lengths of all of them are decided together from every request's
earlier outcomes; the watched request's lengths vary over the enumeration (asserted), yet the law of its first tokens
must equal the target's. Two sharing requests enumerated jointly must be independent draws of their target laws.

Negative control the same harness must catch: a budget that peeks, which draws the request's first draft token before
deciding and drafts only where the target's law p at the root would surely accept it (p(x) >= q(x)), else nothing.
(A budget that reads p at the root alone, without the draws, is a function of the context and so stays exact.)
"""

from __future__ import annotations

import pytest
import torch

from decode.batch import BatchDecoder
from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig, distributions
from decode.engine import SpeculativeDecoder
from decode.policies.base import StaticPolicy
from decode.policies.budget import SharedBudgetPolicy
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.harness import enumerate_runs, outcome_law, recomputed_law
from tests.decode.exact.test_batch import WATCHED, Entry, drive, job, other
from tests.decode.exact.test_expander_loop import PROMPT, TOKENS, TOL, VOCAB, law_error, pair

# draft passes 1 ms, a target pass 10 + 3n ms: alone, β = 0.5 drafts 1 token, 0.7 two, 0.85 four
SIZES = list(range(1, 16))
TABLE = LatencyTable(lengths=[1, 64], sizes=SIZES, draft_ms=[[1.0] * len(SIZES)] * 2,
                     target_ms=[[10.0 + 3 * n for n in SIZES]] * 2)
MAX_DRAFT = 3


class Recording(SharedBudgetPolicy):
    """The shared budget, recording the chain lengths it was given into ``seen``."""

    def __init__(self, seen: set[int]) -> None:
        super().__init__(TABLE, MAX_DRAFT)
        self.seen = seen

    def start(self, sampling):  # a fresh one per run already: its own source
        return self

    def observe(self, outcome) -> None:
        self.seen.add(outcome.action.l1)
        super().observe(outcome)


def shared(prompt, tokens: int, name: str, sampling: SamplingConfig, rng, seen: set[int] | None = None):
    return job(prompt, tokens, name, sampling, rng, Recording(set() if seen is None else seen))


def sharing_batch(name: str, seen: set[int]):
    """The watched request; a sharing companion with another prompt, verifier, temperature and top-p; a static one
    that joins after the first step (its tree priced beside the chains)."""
    return lambda rng: [
        Entry(shared(PROMPT, TOKENS, name, WATCHED, rng, seen)),
        Entry(shared([1], 4, other(name), SamplingConfig(1.2, 0.9), TorchRandom(7))),
        Entry(job([0, 2], 3, other(name, 2), SamplingConfig(0.6), TorchRandom(2), StaticPolicy(Action(1, 2, 0))),
              at=1),
    ]


def watched_law(decoder: BatchDecoder, make) -> dict:
    return outcome_law(enumerate_runs(lambda rng: drive(decoder, make(rng))[0][:TOKENS]))


@pytest.mark.parametrize("name", verifier_names())
def test_a_request_sharing_the_budget_is_the_targets_law(name):
    target, draft = pair()
    seen: set[int] = set()
    got = watched_law(BatchDecoder(target, draft), sharing_batch(name, seen))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)) < TOL
    assert len(seen) >= 2, f"the budget never changed the watched request's chain: {seen}"


@pytest.mark.parametrize(("a", "b"), [("specinfer", "traversal"), ("rsd", "block")])
def test_two_sharing_requests_enumerated_together_are_independent_draws_of_their_target_laws(a, b):
    target, draft = pair()
    second, cool = [1, 2], SamplingConfig(0.7)
    joint = outcome_law(enumerate_runs(lambda rng: tuple(drive(BatchDecoder(target, draft), [
        Entry(shared(PROMPT, 2, a, WATCHED, rng)), Entry(shared(second, 2, b, cool, rng))]))))
    law_a = recomputed_law(target, PROMPT, 2, VOCAB, WATCHED)
    law_b = recomputed_law(target, second, 2, VOCAB, cool)
    assert law_error(joint, {(s, t): pa * pb for s, pa in law_a.items() for t, pb in law_b.items()}) < TOL


def test_alone_on_the_single_loop_the_budget_is_the_targets_law():
    target, draft = pair()
    decoder, seen = SpeculativeDecoder(target, draft, get_verifier("traversal")), set()
    got = outcome_law(enumerate_runs(lambda rng: tuple(decoder.generate(
        PROMPT, TOKENS, Recording(seen), rng, WATCHED).tokens[:TOKENS])))
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)) < TOL
    assert len(seen) >= 2, seen


# --- negative control --------------------------------------------------------------------------------------------
class Lookahead:
    """A random source whose next categorical draw can be taken early (:meth:`peek`), then handed out as drawn."""

    def __init__(self, rng) -> None:
        self.rng, self.held = rng, None

    def bernoulli(self, prob: float) -> bool:
        return self.rng.bernoulli(prob)

    def categorical(self, weights: torch.Tensor) -> int:
        if self.held is not None:
            drawn, self.held = self.held, None
            return drawn
        return self.rng.categorical(weights)

    def peek(self, weights: torch.Tensor) -> int:
        self.held = self.rng.categorical(weights)
        return self.held


class Peeking(BatchDecoder):
    """Wrong: a request on a :class:`Lookahead` source keeps the budget's chain only where its first token, drawn
    before the decision, is one the target's law at the root would surely accept; else it drafts nothing."""

    def _choose_all(self, live, q_roots):
        actions = super()._choose_all(live, q_roots)
        for rid, r in live.items():
            if isinstance(r.job.rng, Lookahead) and actions[rid].l1 > 0:
                drawn = r.job.rng.peek(q_roots[rid])
                with torch.inference_mode():
                    logits = self.target.lm.model(torch.tensor([[*r.job.prompt_ids, *r.tokens]])).logits[0, -1]
                if distributions(logits.double(), r.job.sampling)[drawn] < q_roots[rid][drawn]:
                    r.job.rng.held, actions[rid] = None, Action(1, 0, 0)
        return actions


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_the_harness_catches_a_budget_that_peeks_at_the_draws(name):
    target, draft = pair()
    want = recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)

    def make(rng):
        return [Entry(shared(PROMPT, TOKENS, name, WATCHED, Lookahead(rng))),
                Entry(shared([1, 0], 4, name, WATCHED, TorchRandom(5)))]

    assert law_error(watched_law(BatchDecoder(target, draft), make), want) < TOL
    assert law_error(watched_law(Peeking(target, draft), make), want) > 100 * TOL
