"""The pretrained Qwen2.5-Coder pair (1.5B target, 0.5B draft, both bf16, on the default kernels as loaded): tree
attention, rollback and greedy decoding against full recomputes, and the exact kernel paths against the default.

These need both models fetched (``ddte fetch qwen-coder``; CI runs it before the suite, once per machine) and skip
without them. Prompts are plain text (no chat template) and short, so that a full recompute costs little.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddte.cli import main
from decode.models.registry import KNOWN_PAIRS, is_fetched
from decode.pair import load_pair_config
from tests.decode.models.test_smollm2 import BF16_TOL, _recompute, _relative_gap, share_loaded_pair

pytestmark = pytest.mark.skipif(not all(is_fetched(name) for name in KNOWN_PAIRS["qwen-coder"]),
                                reason="run `ddte fetch qwen-coder` first (CI does)")

# BF16_TOL and the recompute helpers are SmolLM2's (tests/decode/models/test_smollm2.py): bf16 keeps 8 bits of mantissa
# and a cached tree pass may sum in another order than a recompute. A wrong parent moves a row far more.
PROMPT_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def pair():
    return load_pair_config("qwen-coder")


@pytest.fixture(scope="module")
def prompt(pair) -> list[int]:
    return list(pair.tokenizer(PROMPT_TEXT)["input_ids"])


def test_the_pair_runs_both_models_in_the_cpus_dtype(pair):
    """``bfloat16-native``: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere (an emulated bf16 draft ran
    0.56-0.64x HF AR's speed on an AMD EPYC without AVX-512); ``kernels:
    auto`` (each command measures the paths once per machine)."""
    from ddte_core.machine import native_bf16_cpu

    want = torch.bfloat16 if native_bf16_cpu() else torch.float32
    assert pair.target.dtype == want and pair.draft.dtype == want
    assert pair.target.vocab_size == pair.draft.vocab_size == 151936
    assert pair.draft.forward_name == "fast" and pair.spec.kernels == "auto"
    assert pair.target.kernel == pair.draft.kernel == "default"
    assert pair.tokenizer.chat_template and pair.chat


def test_the_targets_exact_kernel_path_keeps_its_logits(pair, prompt):
    """onednn (prepacked weights, the target's own dtype) against F.linear: bf16 rounding apart, the same logits, in
    a prefill and in a tree block."""
    from decode.models.kernels import KERNEL_PATHS

    lm = pair.target
    if KERNEL_PATHS["onednn"].unavailable(lm.dtype, lm.device):
        pytest.skip("no onednn path for this dtype here")
    tip = len(prompt) - 1
    block = list(pair.tokenizer(" if n < 2:")["input_ids"])
    want = lm.prefill(prompt), lm.extend_tree(block, [tip, *[-(j + 1) for j in range(len(block) - 1)]])
    try:
        lm.use_kernel("onednn")
        got = lm.prefill(prompt), lm.extend_tree(block, [tip, *[-(j + 1) for j in range(len(block) - 1)]])
    finally:
        lm.use_kernel("default")
    for a, b in zip(got, want, strict=True):
        assert max(_relative_gap(x, y) for x, y in zip(a, b, strict=True)) < BF16_TOL


def test_tree_attention_and_rollback_match_a_recompute(pair, prompt):
    lm = pair.target
    lm.prefill(prompt)
    tip = lm.length - 1
    a, b, c, d = (pair.tokenizer.convert_tokens_to_ids(t) for t in ["ĠĠĠ", "Ġif", "Ġreturn", "Ġn"])
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


def _greedy_prefix_length(lm, prompt: list[int], tokens: list[int]) -> int:
    """How many of ``tokens`` are checked to be the target's greedy choices by full recompute: one uncached forward
    over prompt + tokens gives the target's logits after every prefix at once (causal attention), and token i must be
    the argmax after prompt + tokens[:i]. Checking stops at the first near-tie, where bf16 rounding makes the
    reference itself a coin flip; a token that is not the argmax fails the test."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:].float()
    for i, token in enumerate(tokens):
        top = logits[i].topk(2).values
        if float(top[0] - top[1]) <= 1e-3 * float(top[0].abs()):
            return i
        assert token == int(logits[i].argmax()), f"token {i} is not the target's greedy choice"
    return len(tokens)


@pytest.mark.parametrize("verifier", ["specinfer", "traversal"])
def test_greedy_generate_on_a_multipath_tree_equals_greedy_by_full_recompute(pair, prompt, tmp_path, verifier,
                                                                           monkeypatch):
    share_loaded_pair(pair, monkeypatch)
    out = tmp_path / "out.jsonl"
    # compared with F.linear's recompute below: the command runs those kernels
    code = main(["generate", "--pair", "qwen-coder", PROMPT_TEXT, "--chat", "off", "--temperature", "0",
                 "--verifier", verifier, "--action", "2,1,1", "--max-new-tokens", "24", "--output", str(out),
                 "--kernels", "default"])
    assert code == 0
    tokens = json.loads(out.read_text().splitlines()[0])["tokens"]
    assert len(tokens) == 24 or tokens[-1] == pair.eos_token_id
    assert _greedy_prefix_length(pair.target, prompt, tokens) >= 16, "a near-tie early on: choose another prompt"
