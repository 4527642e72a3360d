"""decode.batch.BatchDecoder's mechanics: requests join and leave between steps, end at EOS or their budget, and what
a batch refuses leaves it as it was. (Exactness is tests/decode/exact/test_batch.py.)"""

from __future__ import annotations

import pytest

from decode.batch import BatchDecoder, Job
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier
from tests.decode.exact.test_expander_loop import pair

T1 = SamplingConfig(1.0)
TREE = Action(2, 1, 1)


def job(prompt, tokens: int, seed: int, name: str = "traversal", action: Action = TREE,
        sampling: SamplingConfig = T1) -> Job:
    return Job(prompt, tokens, StaticPolicy(action), TorchRandom(seed), sampling, get_verifier(name))


def alone(j: Job, seed: int, eos: int | None = None) -> list[int]:
    """The same request through the single loop on models of its own (a batch owns its models' caches), from a fresh
    source of the same seed."""
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, j.verifier, eos_token_id=eos)
    return decoder.generate(j.prompt_ids, j.max_new_tokens, j.policy, TorchRandom(seed), j.sampling).tokens


def test_requests_join_and_leave_between_steps():
    target, draft = pair()
    decoder = BatchDecoder(target, draft)
    first = decoder.join(job([2, 0, 1], 12, seed=0))
    assert set(decoder.step()) == {first}
    second = decoder.join(job([1], 8, seed=1, name="specinfer", action=Action(1, 3, 0), sampling=SamplingConfig(0.7)))
    assert set(decoder.step()) == {first, second}
    left = decoder.leave(first)  # a client gone: its tokens so far, its slots dropped
    assert left.stopped_by == "caller" and len(left.tokens) >= 2 and left.stats.steps == 2
    assert left.tokens == alone(job([2, 0, 1], 12, 0), 0)[: len(left.tokens)]
    with pytest.raises(ValueError, match="no request"):
        decoder.leave(first)
    finished = None
    while finished is None:
        report = decoder.step()
        assert set(report) == {second}
        finished = report[second].finished
    assert finished.stopped_by == "length" and finished.stats.new_tokens == len(finished.tokens) == 8
    assert finished.tokens == alone(job([1], 8, 1, "specinfer", Action(1, 3, 0),
                                                        SamplingConfig(0.7)), 1)
    assert decoder.step() == {} and not decoder.requests
    assert decoder.target.slots.length == 0 and decoder.draft.slots.length == 0


def test_a_joining_prompt_runs_inside_the_next_steps_passes():
    """Joining runs nothing; the next step's one target pass holds the new prompt beside the other request's tree,
    the output head runs over roots and tree nodes only, and both requests still decode as alone."""
    target, draft = pair()
    decoder = BatchDecoder(target, draft)
    calls = []
    for name, lm in (("target", target), ("draft", draft)):
        forward = lm._forward

        def counted(ids, *args, _forward=forward, _name=name, **kwargs):
            out = _forward(ids, *args, **kwargs)
            calls.append((_name, len(ids), out.logits.shape[0]))
            return out

        lm._forward = counted
    first = decoder.join(job([2, 0, 1], 6, seed=0))
    first_tokens = decoder.step()[first].tokens
    calls.clear()
    second = decoder.join(job([1, 2, 0, 2, 1], 6, seed=1, name="specinfer", action=Action(1, 2, 0)))
    assert calls == []
    reports = decoder.step()
    target_calls = [c for c in calls if c[0] == "target"]
    assert len(target_calls) == 1  # the prompt ran in the shared pass, not in one of its own
    _, rows, heads = target_calls[0]
    assert rows - heads == 4  # the new prompt's first four tokens: no logits
    tokens = {first: first_tokens, second: []}
    while decoder.requests:
        for rid, report in reports.items():
            tokens[rid] += report.tokens
        reports = decoder.step()
    for rid, report in reports.items():
        tokens[rid] += report.tokens
    assert tokens[second] == alone(job([1, 2, 0, 2, 1], 6, 1, "specinfer", Action(1, 2, 0)), 1)
    assert tokens[first] == alone(job([2, 0, 1], 6, 0), 0)


def test_requests_end_at_eos_as_alone():
    target, draft = pair()
    eos, stopped = 1, set()
    for seed in range(4):
        decoder = BatchDecoder(target, draft, eos_token_id=eos)
        jobs = [job([2, 0, 1], 10, seed), job([0, 2], 10, seed + 10, "rsd", Action(3, 0, 2))]
        for j, generation, s in zip(jobs, decoder.generate(jobs), (seed, seed + 10), strict=True):
            assert generation.tokens == alone(j, s, eos)
            stopped.add(generation.stopped_by)
            if generation.stopped_by == "eos":
                assert generation.tokens[-1] == eos and eos not in generation.tokens[:-1]
    assert stopped == {"eos", "length"}


def test_what_a_batch_refuses_leaves_it_as_it_was():
    target, draft = pair()
    decoder = BatchDecoder(target, draft)
    for bad, match in [(job([], 4, 0), "empty"), (job([1], 0, 0), "max_new_tokens"), (job([7], 4, 0), "out of range"),
                       (job([1] * 60, 10, 0), "context window")]:
        with pytest.raises(ValueError, match=match):
            decoder.join(bad)

    class ReadsRootFeatures(StaticPolicy):
        needs_root_features = True

    with pytest.raises(ValueError, match="root features"):
        decoder.join(Job([1], 4, ReadsRootFeatures(Action(1, 1, 0)), TorchRandom(0), T1, get_verifier("block")))
    good = decoder.join(job([2, 0, 1], 6, seed=3))
    refused = decoder.join(job([1, 2], 6, seed=4, name="block"))  # block verifies single paths only
    with pytest.raises(ValueError, match="block"):
        decoder.step()
    decoder.leave(refused)
    finished = None
    while finished is None:
        finished = decoder.step()[good].finished
    assert finished.tokens == alone(job([2, 0, 1], 6, 3), 3)
    target.prefill([1, 2])  # another decoder on the same model empties the batch's cache: refused, not misread
    with pytest.raises(ValueError, match="outside the batch"):
        decoder.join(job([2, 0, 1], 6, seed=3))


def test_a_generations_time_to_its_first_tokens_is_its_first_step_and_tpot_leaves_it_out():
    """The step records when a request's first tokens came (its prompt ran in that step); a bench's TPOT counts the
    time and tokens after them, for a ddte row as for an HF one."""
    from bench.decoding import decode_time

    target, draft = pair()
    stats = SpeculativeDecoder(target, draft, get_verifier("traversal")).generate(
        [2, 0, 1], 9, StaticPolicy(Action(1, 1, 0)), TorchRandom(0), SamplingConfig(1.0)).stats
    assert stats.steps > 1 and 0 < stats.first_token_seconds < stats.wall_seconds
    assert decode_time(stats) == {"decode_seconds": stats.wall_seconds - stats.first_token_seconds,
                                  "decode_tokens": stats.new_tokens - 1}
