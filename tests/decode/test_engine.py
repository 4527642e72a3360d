"""Layer 3: the decoding loop on tiny models: greedy equality, EOS inside a tree, budgets, limits, statistics."""

from __future__ import annotations

import copy

import pytest
import torch

from decode.drafting.actions import Action, distinct_trees
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.policies.base import AdaptiveLengthPolicy, StaticPolicy
from decode.verifiers import get_verifier, verifier_names
from tests.factories import tiny_llama

PROMPT = [5, 9, 3, 17, 22]
ACTIONS = [Action(1, 4, 0), Action(4, 0, 2), Action(2, 1, 2), Action(3, 2, 3), Action(2, 0, 0)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=1, vocab=64, hidden=64, layers=2)


def greedy_reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def supported(name):
    for action in ACTIONS:
        try:
            get_verifier(name).check_action(action)
        except ValueError:
            continue
        yield action


@pytest.mark.parametrize("draft_kind", ["same-weights", "noisy", "independent"])
@pytest.mark.parametrize("name", verifier_names())
def test_greedy_output_equals_the_targets_own_greedy_generate(target, name, draft_kind):
    if draft_kind == "same-weights":
        draft_model = target  # every draft token accepted: exercises committing whole trees
    elif draft_kind == "noisy":
        draft_model = copy.deepcopy(target)
        with torch.no_grad():
            for prm in draft_model.parameters():
                prm.add_(torch.randn_like(prm) * 0.004)
    else:
        draft_model = tiny_llama(seed=2, vocab=64, hidden=32, layers=1)
    reference = greedy_reference(target, PROMPT, 24)
    for action in supported(name):
        decoder = SpeculativeDecoder(CachedLM(target), CachedLM(draft_model), get_verifier(name))
        gen = decoder.generate(PROMPT, 24, StaticPolicy(action), TorchRandom(0), SamplingConfig(0.0))
        assert gen.tokens == reference, (name, action, draft_kind)


def test_same_weights_accepts_every_drafted_token(target):
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(target), get_verifier("traversal"))
    gen = decoder.generate(PROMPT, 25, StaticPolicy(Action(1, 4, 0)), TorchRandom(3), SamplingConfig(1.0))
    assert gen.tokens and gen.stats.steps == 5 and gen.stats.block_efficiency == 5.0
    assert gen.stats.acceptance_rate == 1.0


def test_one_token_prompt(target):
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(target), get_verifier("specinfer"))
    gen = decoder.generate([7], 12, StaticPolicy(Action(2, 1, 2)), TorchRandom(0), SamplingConfig(0.0))
    assert gen.tokens == greedy_reference(target, [7], 12)


def test_eos_inside_an_accepted_tree_stops_there(target):
    reference = greedy_reference(target, PROMPT, 12)
    eos = reference[2]  # the third greedy token, drafted and accepted inside the first tree
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(target), get_verifier("traversal"), eos_token_id=eos)
    gen = decoder.generate(PROMPT, 12, StaticPolicy(Action(1, 6, 0)), TorchRandom(0), SamplingConfig(0.0))
    assert gen.tokens == reference[: reference.index(eos) + 1]
    assert gen.stopped_by == "eos" and gen.stats.steps == 1


@pytest.mark.parametrize("budget", [1, 2, 3, 7])
def test_the_token_budget_is_exact(target, budget):
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(target), get_verifier("naive"))
    gen = decoder.generate(PROMPT, budget, StaticPolicy(Action(2, 2, 4)), TorchRandom(1), SamplingConfig(1.0))
    assert len(gen.tokens) == budget and gen.stopped_by == "length"
    assert gen.stats.new_tokens == budget


def test_trees_are_clipped_at_the_context_window(target):
    limit = target.config.max_position_embeddings
    prompt = list(range(2, 2 + limit - 6))
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(target), get_verifier("spectr"))
    gen = decoder.generate(prompt, 6, StaticPolicy(Action(2, 4, 4)), TorchRandom(0), SamplingConfig(0.0))
    assert gen.tokens == greedy_reference(target, prompt, 6)


@pytest.mark.parametrize(
    ("prompt", "max_new", "message"),
    [([], 4, "empty"), ([1, 2], 0, "max_new_tokens"), ([1, 999], 4, "out of range"), (list(range(60)), 10, "context")],
)
def test_bad_requests_are_refused(target, prompt, max_new, message):
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(target), get_verifier("nss"))
    with pytest.raises(ValueError, match=message):
        decoder.generate(prompt, max_new, StaticPolicy(Action(1, 2, 0)), TorchRandom(0), SamplingConfig(1.0))


def test_vocabulary_mismatch_is_refused(target):
    other = tiny_llama(seed=3, vocab=32, hidden=32)
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeDecoder(CachedLM(target), CachedLM(other), get_verifier("nss"))


def test_unsupported_action_is_refused_before_decoding():
    with pytest.raises(ValueError, match="not lossless"):
        get_verifier("block").check_action(Action(2, 0, 3))
    with pytest.raises(ValueError, match="K >= 1"):
        Action(0, 1, 1)
    with pytest.raises(ValueError, match="K,L1,L2"):
        Action.parse("1,2")


def test_distinct_trees_count_each_drafted_tree_once():
    ranked = ["1,0,3", "1,3,0", "2,3,0", "1,1,4", "2,1,3", "1,0,5", "4,0,2"]
    assert distinct_trees(ranked, 3) == ["1,3,0", "1,5,0", "2,1,3"]
    assert distinct_trees(ranked, 10) == ["1,3,0", "1,5,0", "2,1,3", "4,0,2"]


def test_statistics_add_up(target):
    draft = tiny_llama(seed=4, vocab=64, hidden=32, layers=1)
    decoder = SpeculativeDecoder(CachedLM(target), CachedLM(draft), get_verifier("traversal"))
    gen = decoder.generate(PROMPT, 40, AdaptiveLengthPolicy(), TorchRandom(5), SamplingConfig(1.0))
    s = gen.stats
    assert s.new_tokens == len(gen.tokens) == 40
    assert sum(s.action_counts.values()) == sum(s.accepted_counts.values()) == s.steps
    assert s.block_efficiency == pytest.approx(40 / s.steps)
    assert 0.0 <= s.acceptance_rate <= 1.0
    assert sum(s.seconds.values()) <= s.wall_seconds * 1.01 and s.tokens_per_second > 0
    assert len(s.action_counts) > 1  # the adaptive policy moved


def test_adaptive_policy_schedule():
    policy = AdaptiveLengthPolicy(initial=4, minimum=1, maximum=6)
    from decode.policies.base import StepOutcome

    policy.observe(StepOutcome(Action(1, 4, 0), 4, 5))
    assert policy.length == 6
    policy.observe(StepOutcome(Action(1, 6, 0), 6, 7))
    assert policy.length == 6  # capped
    policy.observe(StepOutcome(Action(1, 6, 0), 2, 3))
    assert policy.length == 5
