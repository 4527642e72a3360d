"""Log-probabilities from the decoding step: each new token's under the target's law as sampled (the verification
pass's p), each prompt token's under the target's raw law (the prompt's own pass), both equal to a plain recompute;
and a job that does not stop at EOS decodes past it."""

from __future__ import annotations

import pytest
import torch

from decode.batch import BatchDecoder
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig, distributions
from decode.generation import Job
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier
from tests.decode.exact.test_expander_loop import pair

PROMPT = [2, 0, 1, 1, 0]


def run(decoder: BatchDecoder, job: Job) -> tuple[list[int], list, list]:
    """(tokens, the new tokens' log-probabilities, the prompt's), gathered over the job's steps."""
    rid = decoder.join(job)
    tokens, new, prompt = [], [], []
    while True:
        report = decoder.step()[rid]
        tokens += report.tokens
        new += report.logprobs
        prompt += report.prompt_logprobs
        if report.finished is not None:
            return tokens, new, prompt


def raw_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("action", [Action(1, 3, 0), Action(2, 1, 1)], ids=["chain", "tree"])
def test_new_and_prompt_logprobs_equal_a_recompute(temperature, action):
    target, draft = pair()
    sampling = SamplingConfig(temperature)
    job = Job(PROMPT, 8, StaticPolicy(action), TorchRandom(1), sampling, get_verifier("traversal"), logprobs=2,
              prompt_logprobs=1)
    companion = Job([1, 2], 5, StaticPolicy(Action(1, 2, 0)), TorchRandom(2), SamplingConfig(1.0),
                    get_verifier("specinfer"))
    decoder = BatchDecoder(target, draft)
    decoder.join(companion)
    tokens, new, prompt = run(decoder, job)
    logits = raw_logits(target.model, PROMPT + tokens)
    want_prompt = torch.log_softmax(logits, -1)
    assert [lp.token for lp in prompt] == PROMPT[1:]
    for i, lp in enumerate(prompt):
        assert lp.logprob == pytest.approx(float(want_prompt[i, PROMPT[i + 1]]), abs=1e-4)
        assert len(lp.top) == 1 and lp.top[0][0] == int(want_prompt[i].argmax())
    assert [lp.token for lp in new] == tokens
    laws = distributions(logits, sampling).log()
    for j, lp in enumerate(new):
        row = len(PROMPT) - 1 + j
        assert lp.logprob == pytest.approx(float(laws[row, tokens[j]]), abs=1e-4)
        assert [t for t, _ in lp.top] == laws[row].topk(2).indices.tolist()


def test_no_logprobs_unless_asked_and_no_stop_at_eos():
    target, draft = pair()
    policy, sampling = StaticPolicy(Action(1, 2, 0)), SamplingConfig(1.0)
    for seed in range(20):
        stopping = Job(PROMPT, 12, policy, TorchRandom(seed), sampling, get_verifier("traversal"))
        tokens, new, prompt = run(BatchDecoder(target, draft, eos_token_id=0), stopping)
        if len(tokens) < 12:
            break
    assert tokens[-1] == 0 and not new and not prompt  # it stopped at EOS (token 0)
    going_on = Job(PROMPT, 12, policy, TorchRandom(seed), sampling, get_verifier("traversal"), stop_at_eos=False)
    past, _, _ = run(BatchDecoder(target, draft, eos_token_id=0), going_on)
    assert len(past) == 12 and past[:len(tokens)] == tokens
