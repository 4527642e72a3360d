"""Batched decoding (decode/batch.py) keeps every request exactly the target's law, whatever the others do.

Exact enumeration through the real batch (tiny HF models over a 3-token vocabulary, :mod:`tests.decode.exact.harness`):
:class:`ReplayRandom` walks every random choice of one request (its tree draws and its verifier's coins) while the
others decode beside it from seeded sources, with other prompts, verifiers, temperatures, top-p and policies, joining
after the first step and leaving by themselves or by the caller; the law of its first tokens must equal the target's,
for every verifier on the trees it takes. Two requests that share one replaying source are enumerated jointly: their
joint law must be the product of their target laws (each exact, and independent of the other).

Negative controls the same harness must catch: a request's tree verified with another request's q (of a tree of the
same shape), and a mask that lets a request attend to the other requests' prefixes. A seeded request gives the same
tokens alone (the single loop, or a batch of one) and in a batch: its rows are the same bits
(tests/decode/models/test_batch_invariance.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from decode.batch import BatchDecoder, Job
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.models.masks import SequenceColumns, sequence_columns
from decode.models.shared_cache import SharedCache, SharedSlots
from decode.policies.base import EntropyStopPolicy, Policy, StaticPolicy
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.harness import enumerate_runs, outcome_law, recomputed_law
from tests.decode.exact.test_draft_vocab_loop import reduced_pair
from tests.decode.exact.test_expander_loop import PROMPT, TOKENS, TOL, VOCAB, law_error, pair

NAMES = verifier_names()
WATCHED = SamplingConfig(0.8)


def shape(name: str) -> Action:
    """A branching tree where the verifier takes one, else a single path."""
    return Action(2, 1, 1) if get_verifier(name).supports_action(2, 1, 1) else Action(1, 2, 0)


def other(name: str, shift: int = 1) -> str:
    """Another verifier, for a companion request."""
    return NAMES[(NAMES.index(name) + shift) % len(NAMES)]


def job(prompt, tokens: int, name: str, sampling: SamplingConfig, rng, policy: Policy | None = None) -> Job:
    return Job(prompt, tokens, policy or StaticPolicy(shape(name)), rng, sampling, get_verifier(name))


@dataclass
class Entry:
    """A request of a run: it joins before step ``at`` (0: the first) and, with ``leave_after``, is ended by the
    caller after that many of its steps; else it runs until it ends by itself."""

    job: Job
    at: int = 0
    leave_after: int | None = None


def drive(decoder: BatchDecoder, entries: list[Entry]) -> list[tuple[int, ...]]:
    """Run the entries in one batch until every one has ended; each one's tokens."""
    ids: dict[int, int] = {}
    steps: dict[int, int] = {}
    out: dict[int, tuple[int, ...]] = {}
    step = 0
    while len(out) < len(entries):
        ids.update({decoder.join(e.job): i for i, e in enumerate(entries) if e.at == step})
        for rid, report in decoder.step().items():
            i = ids[rid]
            steps[i] = steps.get(i, 0) + 1
            if report.finished is not None:
                out[i] = tuple(report.finished.tokens)
            elif entries[i].leave_after == steps[i]:
                out[i] = tuple(decoder.leave(rid).tokens)
        step += 1
    assert not decoder.requests and decoder.target.slots.length == 0 and decoder.draft.slots.length == 0
    return [out[i] for i in range(len(entries))]


def watched_law(decoder: BatchDecoder, make: callable) -> dict:
    """Law of the first entry's tokens over every random choice of its source; ``make(rng)`` gives the entries."""
    return outcome_law(enumerate_runs(lambda rng: drive(decoder, make(rng))[0][:TOKENS]))


def beside_one(name: str):
    """The watched request and one companion, with another prompt, verifier, temperature and top-p."""
    return lambda rng: [Entry(job(PROMPT, TOKENS, name, WATCHED, rng)),
                        Entry(job([1], 4, other(name), SamplingConfig(1.2, 0.9), TorchRandom(7)))]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_request_beside_another_is_the_targets_law(name):
    target, draft = pair()
    got = watched_law(BatchDecoder(target, draft), beside_one(name))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)) < TOL


def among_three(name: str):
    """The watched request; a one-token prompt that ends by itself after two tokens; and a third on the entropy stop
    rule (per node) that joins after the first step and is ended by the caller after one step of its own."""
    return lambda rng: [
        Entry(job(PROMPT, TOKENS, name, SamplingConfig(1.0), rng)),
        Entry(job([0], 2, other(name), SamplingConfig(0.6), TorchRandom(1))),
        Entry(job([1, 1, 2, 0], 5, other(name, 2), SamplingConfig(1.3, 0.8), TorchRandom(2),
                  EntropyStopPolicy(2, 1.08)), at=1, leave_after=1),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_request_among_three_joining_and_leaving_is_the_targets_law(name):
    target, draft = pair()
    got = watched_law(BatchDecoder(target, draft), among_three(name))
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, SamplingConfig(1.0))) < TOL


@pytest.mark.parametrize(("a", "b"), [("specinfer", "traversal"), ("rsd", "block")])
def test_two_requests_enumerated_together_are_independent_draws_of_their_target_laws(a, b):
    """Both requests draw from one replaying source, so every joint outcome is walked: the joint law must be the
    product of the two target laws."""
    target, draft = pair()
    decoder = BatchDecoder(target, draft)
    second, cool = [1, 2], SamplingConfig(0.7)
    joint = outcome_law(enumerate_runs(lambda rng: tuple(drive(decoder, [
        Entry(job(PROMPT, 2, a, WATCHED, rng)), Entry(job(second, 2, b, cool, rng))]))))
    law_a = recomputed_law(target, PROMPT, 2, VOCAB, WATCHED)
    law_b = recomputed_law(target, second, 2, VOCAB, cool)
    product = {(s, t): pa * pb for s, pa in law_a.items() for t, pb in law_b.items()}
    assert law_error(joint, product) < TOL


def test_a_per_node_policy_in_a_batch_is_the_targets_law():
    """The watched request halts its trunk by the entropy stop rule (a per-node decision inside the shared drafting
    rule). The draft's entropy is 1.067 nats after this prompt and 1.066 to 1.092 after its next token, so a
    threshold of 1.08 grows the trunk at the root and halts it after some first tokens only."""
    target, draft = pair()
    decoder = BatchDecoder(target, draft)
    prompt, depths = [1, 2], set()

    def run(rng):
        rid = decoder.join(job(prompt, TOKENS, "traversal", SamplingConfig(1.0), rng, EntropyStopPolicy(3, 1.08)))
        decoder.join(job(PROMPT, 3, "specinfer", SamplingConfig(0.7), TorchRandom(3)))
        while rid in decoder.requests:
            finished = decoder.step()[rid].finished
        depths.update(Action.parse(key.strip("()")).l1 for key in finished.stats.action_counts)
        for other_id in list(decoder.requests):
            decoder.leave(other_id)
        return tuple(finished.tokens[:TOKENS])

    got = outcome_law(enumerate_runs(run))
    assert len(depths) >= 2, f"the trunk never halted early: {depths}"
    assert law_error(got, recomputed_law(target, prompt, TOKENS, VOCAB, SamplingConfig(1.0))) < TOL


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_draft_vocabulary_in_a_batch_is_the_targets_law(name):
    """A draft proposing tokens {0, 2} only, on HF's forward: the batch's drafting passes return its ``(n, Vs)``
    logits, its pending passes the full ones, as the single loop's."""
    target, draft = reduced_pair(fast=False)
    got = watched_law(BatchDecoder(target, draft), beside_one(name))
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)) < TOL


# --- negative controls -------------------------------------------------------------------------------------------
class SwappedQ(BatchDecoder):
    """Wrong: a request's verifier reads the q of another request's tree of the same shape (the other's laws)."""

    def _q(self, rid, drafted):
        same = [d.q for r, d in drafted.items() if r != rid and d.q.shape == drafted[rid].q.shape]
        return same[0] if same else drafted[rid].q


class LeakySlots(SharedSlots):
    """Wrong: each new token also sees every other sequence's settled slots."""

    def _own_settled(self, seq):
        return super()._own_settled(seq) | ((self.owner >= 0) & self.settled)


def leaky_columns(row_owners, slot_owners, allowed):
    """Wrong: each sequence's attention also gathers every other sequence's cached slots (LeakySlots' mask lets it
    see their settled ones)."""
    if allowed is None:  # a lone sequence's linear run: nothing to leak
        return sequence_columns(row_owners, slot_owners, allowed)
    live = np.flatnonzero(slot_owners >= 0)
    cuts = [0, *(np.flatnonzero(np.diff(row_owners)) + 1).tolist(), len(row_owners)]
    groups = []
    for a, b in itertools.pairwise(cuts):
        columns = np.concatenate([live, len(slot_owners) + np.arange(a, b)])
        groups.append(SequenceColumns(slice(a, b), columns, allowed[a:b][:, columns], len(live)))
    return groups


class LeakyCache(SharedCache):
    layout = LeakySlots
    columns = staticmethod(leaky_columns)


class Leaky(BatchDecoder):
    cache_class = LeakyCache


def two_paths(name: str):
    """Two requests drafting single paths of one shape, the watched one enumerated."""
    return lambda rng: [Entry(job(PROMPT, TOKENS, name, WATCHED, rng, StaticPolicy(Action(1, 2, 0)))),
                        Entry(job([1, 0], 4, name, WATCHED, TorchRandom(5), StaticPolicy(Action(1, 2, 0))))]


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
@pytest.mark.parametrize("wrong", [SwappedQ, Leaky], ids=["q-of-another-request", "mask-leaking-prefixes"])
def test_the_harness_catches_a_batch_that_mixes_requests(name, wrong):
    target, draft = pair()
    want = recomputed_law(target, PROMPT, TOKENS, VOCAB, WATCHED)
    assert law_error(watched_law(BatchDecoder(target, draft), two_paths(name)), want) < TOL
    assert law_error(watched_law(wrong(target, draft), two_paths(name)), want) > 100 * TOL


# --- seeded ------------------------------------------------------------------------------------------------------
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch():
    target, draft = pair()
    name, sampling, tokens = "traversal", SamplingConfig(1.0), 10
    for seed in range(6):
        alone = SpeculativeDecoder(target, draft, get_verifier(name)).generate(
            PROMPT, tokens, StaticPolicy(shape(name)), TorchRandom(seed), sampling).tokens
        decoder = BatchDecoder(target, draft)
        solo = drive(decoder, [Entry(job(PROMPT, tokens, name, sampling, TorchRandom(seed)))])[0]
        batched = drive(decoder, [
            Entry(job([1], 6, "specinfer", SamplingConfig(0.6), TorchRandom(100 + seed))),
            Entry(job(PROMPT, tokens, name, sampling, TorchRandom(seed))),
            Entry(job([0, 2], 8, "gbv", SamplingConfig(1.2, 0.9), TorchRandom(200 + seed)), at=1),
        ])[1]
        assert list(solo) == alone and list(batched) == alone, seed
