"""The real pretrained pair (SmolLM2-135M-Instruct in bf16 and its shipped draft): tree attention, rollback and
greedy decoding against full recomputes.

These need the target fetched (``ddte fetch smollm2``; CI runs it before the suite) and skip without it.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddte.cli import main
from decode.models.cached_lm import CachedLM
from decode.models.registry import is_fetched
from decode.pair import load_pair_config

pytestmark = pytest.mark.skipif(not is_fetched("smollm2"), reason="run `ddte fetch smollm2` first (CI does)")

# bf16 keeps 8 bits of mantissa, and a cached tree pass and a full recompute may sum in different orders. On this
# CPU the two agree exactly (gap 0 on every row, measured); the tolerance, relative to the row's largest |logit|,
# leaves room for kernels that reorder sums (CUDA). A wrong parent moves the row by ~100 % (the negative control).
BF16_TOL = 0.03
PROMPT_TEXT = "Write a Python function that checks whether a number is prime."


@pytest.fixture(scope="module")
def pair():
    return load_pair_config("smollm2")


@pytest.fixture(scope="module")
def prompt(pair) -> list[int]:
    from decode.pair import render_chat

    return list(pair.tokenizer(render_chat(pair.tokenizer, [{"role": "user", "content": PROMPT_TEXT}]))["input_ids"])


def _recompute(lm: CachedLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(torch.tensor([ids])).logits[0, -1].float()


def _relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0))


def test_the_pair_runs_bf16_where_the_cpu_has_it(pair):
    from ddte_core.machine import native_bf16_cpu

    want = torch.bfloat16 if native_bf16_cpu() else torch.float32
    assert pair.target.dtype == want and pair.draft.dtype == want
    assert pair.target.vocab_size == pair.draft.vocab_size == 49152
    assert pair.tokenizer.chat_template


def test_tree_attention_and_rollback_match_a_recompute_in_bf16(pair, prompt):
    lm = pair.target
    lm.prefill(prompt)
    tip = lm.length - 1
    a, b, c, d = pair.tokenizer.convert_tokens_to_ids(["Here", "Ġis", "Sure", "!"])
    logits = lm.extend_tree([a, b, c, d], [tip, -1, tip, -3])
    for row, path in zip(logits, [[a], [a, b], [c], [c, d]], strict=True):
        assert _relative_gap(row, _recompute(lm, prompt + path)) < BF16_TOL, path
    assert _relative_gap(logits[1], _recompute(lm, prompt + [c, b])) > 3 * BF16_TOL  # the wrong parent is caught
    lm.commit([tip + 3, tip + 4])  # keep c -> d
    bonus = lm.extend([a], commit=True)[-1]
    assert _relative_gap(bonus, _recompute(lm, prompt + [c, d, a])) < BF16_TOL
    lm.crop(len(prompt))
    again = lm.extend([b], commit=True)[-1]
    assert _relative_gap(again, _recompute(lm, prompt + [b])) < BF16_TOL


def _greedy_by_recompute(lm: CachedLM, ids: list[int], n: int) -> list[int]:
    """Up to n greedy tokens by plain recomputes, cut before the first near-tie: there bf16 rounding (a tree pass
    against a recompute) makes the reference itself a coin flip, and nothing after it can be compared."""
    out: list[int] = []
    for _ in range(n):
        logits = _recompute(lm, ids + out)
        top = logits.topk(2).values
        if float(top[0] - top[1]) <= 1e-3 * float(top[0].abs()):
            break
        out.append(int(logits.argmax()))
    return out


def share_loaded_pair(pair, monkeypatch) -> None:
    """Commands in this test run on the module's loaded ``pair``: one copy of a real target per worker (an fp32 1.5B
    target is 6 GB, and its oneDNN copy as much again: two such pairs in one worker were OOM-killed on 24 GiB)."""
    import decode.pair

    monkeypatch.setattr(decode.pair, "load_pair_config", lambda *args, **kwargs: pair)


def test_greedy_generate_on_a_multipath_tree_equals_greedy_by_full_recompute(pair, prompt, tmp_path, monkeypatch):
    share_loaded_pair(pair, monkeypatch)
    out = tmp_path / "out.jsonl"
    # the reference below is F.linear's, so the command runs the default kernels it is compared with
    code = main(["generate", "--pair", "smollm2", PROMPT_TEXT, "--temperature", "0", "--verifier", "specinfer",
                 "--action", "2,1,3", "--max-new-tokens", "32", "--output", str(out), "--kernels", "default"])
    assert code == 0
    tokens = json.loads(out.read_text().splitlines()[0])["tokens"]
    reference = _greedy_by_recompute(pair.target, prompt, 32)
    eos = pair.eos_token_id
    if eos in reference:
        reference = reference[: reference.index(eos) + 1]
    # at least 10 tokens compared: the first near-tie falls at token 12 on an AMD EPYC without AVX-512 BF16
    assert len(reference) >= 10, "a near-tie within the first 10 tokens: choose another prompt"
    assert tokens[: len(reference)] == reference


@pytest.mark.parametrize("verifier", ["specinfer", "traversal"])
def test_the_shipped_expanders_fit_this_pair_and_halt_the_trunk_while_drafting(pair, prompt, verifier):
    """models/expanders/ load against this pair (fingerprint, draft size, verifier) and decide per node in the loop."""
    from decode.drafting.rng import TorchRandom
    from decode.drafting.sampling import SamplingConfig
    from decode.engine import SpeculativeDecoder
    from decode.policies.expander import ExpanderSource
    from decode.verifiers import get_verifier
    from tests.factories import REPO

    policy = ExpanderSource.for_pair(REPO / "models" / "expanders" / f"smollm2-{verifier}.onnx", verifier, pair)
    decoder = SpeculativeDecoder(pair.target, pair.draft, get_verifier(verifier), pair.eos_token_id)
    generation = decoder.generate(prompt, 12, policy, TorchRandom(0), SamplingConfig(0.6))
    started = policy.start(SamplingConfig(0.6))
    assert generation.stats.new_tokens == 12
    if started.decides_per_node:  # a rule at T = 0.6: it was asked at every trunk node the loop reached
        assert generation.stats.network_seconds and generation.stats.seconds["policy"] > 0
