"""The architecture matrix (issue 25): ddte on tiny random models of every HF architecture it claims, each built from
a config in tests/decode/architectures.py (sliding windows of 5 positions, far below the 20-50 positions used here).

For every case: a tree pass, commits and crops equal a full recompute of each kept path, for the target (HF's
forward) and the draft (the fast forward where it covers the architecture); `ddte generate` at temperature 0 with a
multi-path tree equals greedy decoding by full recompute (not HF's incremental decoding: on phi the two differ at
a near-tie). Windowed cases have a negative control: the same passes with the window ignored miss the recompute.
One χ² case runs the sampling loop on a hybrid sliding-window target with a windowed Qwen2 draft.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from ddte.cli import main
from decode.drafting.actions import Action
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig, distributions
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM, cached_lm
from decode.models.loading import load_causal_lm
from decode.models.masks import attention_windows
from decode.models.slots import block_parents
from decode.policies.base import StaticPolicy
from decode.verifiers import get_verifier
from tests.decode.architectures import (
    ARCHITECTURES,
    FAST_DRAFTS,
    WINDOW,
    WINDOWED,
    arch_config,
    arch_model,
    randomized,
)
from tests.decode.test_lossless import chi2_p_value

V = 128
# relative to the largest |logit| of the reference row: float32 tree passes sit at ~3e-7 here, a wrong mask at >1e-2
TOL = 1e-5
ROLES = {"target": (1, 64, 2), "draft": (2, 32, 1)}  # seed, width, layers


def _recompute(lm: CachedLM, seq: list[int]) -> torch.Tensor:
    """``(len(seq), V)`` float32 logits of one plain forward without a cache (HF's own masks, windows included)."""
    with torch.inference_mode():
        return lm.model(torch.tensor([seq]), use_cache=False).logits[0].float()


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def _path(tokens: list[int], local: list[int], i: int) -> list[int]:
    """Tokens from the block's root child down to node i (``local``: block-local parents, -1 = the cache's tip)."""
    path = []
    while i >= 0:
        path.append(tokens[i])
        i = local[i]
    return path[::-1]


def _worst_gap(lm: CachedLM) -> float:
    """Run tree blocks, commits, linear runs and crops on ``lm``; the largest gap of any logit row from a recompute
    of its path. Every block reaches past the window."""
    rng = random.Random(0)
    rand = lambda n: [rng.randrange(V) for _ in range(n)]  # noqa: E731
    gaps = []
    prefix = rand(12)
    gaps.append(_gap(lm.prefill(prefix), _recompute(lm, prefix)))
    # a 9-node tree: a trunk, then branches, some deeper than the window
    tokens, local = rand(9), [-1, 0, 1, 2, 3, 2, 5, 2, 7]
    out = lm.extend_tree(tokens, block_parents(range(len(local)), local, {-1: lm.length - 1}))
    gaps += [_gap(out[i], _recompute(lm, prefix + _path(tokens, local, i))[-1]) for i in range(9)]
    lm.commit([12 + i for i in (0, 1, 2, 7, 8)])  # keep 0 -> 1 -> 2 -> 7 -> 8, drop the rest
    seq = prefix + [tokens[i] for i in (0, 1, 2, 7, 8)]
    # a linear speculative run (the model's causal path, cut by the window) and a tree hanging off a committed slot
    run = rand(6)
    gaps.append(_gap(lm.extend(run), _recompute(lm, seq + run)[-6:]))
    side = rand(3)
    out = lm.extend_tree(side, [len(seq) - 3, -1, len(seq) + 5])  # under slot 14, under it, under the run's tip
    gaps.append(_gap(out[0], _recompute(lm, seq[:15] + side[:1])[-1]))
    gaps.append(_gap(out[1], _recompute(lm, seq[:15] + side[:2])[-1]))
    gaps.append(_gap(out[2], _recompute(lm, seq + run + side[2:])[-1]))
    lm.commit(list(range(len(seq), len(seq) + 4)))  # the run's first four tokens
    seq += run[:4]
    bonus = rand(1)
    gaps.append(_gap(lm.extend(bonus, commit=True)[0], _recompute(lm, seq + bonus)[-1]))
    lm.crop(15)  # back into the committed prefix, then a different continuation
    more = rand(7)
    gaps.append(_gap(lm.extend(more, commit=True), _recompute(lm, seq[:15] + more)[-7:]))
    return max(gaps)


def _wrap(name: str, role: str, window: int = WINDOW) -> CachedLM:
    seed, width, layers = ROLES[role]
    model = arch_model(name, seed, V, width, layers, window)
    return CachedLM(model) if role == "target" else cached_lm(model)


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_tree_passes_commits_and_crops_equal_a_recompute(name: str, role: str) -> None:
    lm = _wrap(name, role)
    assert isinstance(lm, FastCachedLM) == (role == "draft" and name in FAST_DRAFTS), lm.fast_fallback
    assert _worst_gap(lm) < TOL


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_a_mask_that_ignores_the_window_misses_the_recompute(name: str, role: str) -> None:
    """Negative control: the same passes with every layer attending to its whole path are far off, so the matrix
    sees the window (and the window is smaller than the test's context)."""
    lm = _wrap(name, role)
    assert any(w is not None for w in lm.layer_windows)
    lm.layer_windows = [None] * len(lm.layer_windows)
    lm.type_windows = dict.fromkeys(lm.type_windows)
    assert _worst_gap(lm) > 1e-3


@pytest.mark.parametrize(("name", "biases"), [("llama", {"attention_bias": True, "mlp_bias": True}),
                                              ("qwen3", {"attention_bias": True})])
def test_fast_forward_takes_every_projection_bias(name: str, biases: dict) -> None:
    """Biased variants the matrix's default configs lack: Llama's attention and MLP biases (o_proj included) and
    Qwen3's, all random and nonzero, through the fast forward."""
    config = arch_config(name, V, 32, 1)
    for key, value in biases.items():
        setattr(config, key, value)
    torch.manual_seed(4)
    model = randomized(AutoModelForCausalLM.from_config(config).eval())
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    lm = cached_lm(model)
    assert isinstance(lm, FastCachedLM) and _worst_gap(lm) < TOL


def test_default_windows_and_eager_only_models_load() -> None:
    """The configs issue 25 saw refused: Mistral's and Gemma3's default 4096-window configs (far longer than the
    context) run; Gemma2, which has no sdpa path for its softcapped scores, runs eager, softcapping on."""
    for name in ("mistral", "gemma3_text"):
        lm = CachedLM(arch_model(name, 0, V, 64, 2, window=4096))
        assert 4096 in lm.layer_windows and _worst_gap(lm) < TOL
    gemma2 = CachedLM(arch_model("gemma2", 0, V, 64, 2))
    assert gemma2.model.config._attn_implementation == "eager"
    assert gemma2.config.attn_logit_softcapping and gemma2.config.final_logit_softcapping


def test_unsupported_attention_is_refused() -> None:
    from transformers import Gemma3TextConfig, Llama4TextConfig

    with pytest.raises(ValueError, match="chunked"):
        attention_windows(Llama4TextConfig(attention_chunk_size=8, num_hidden_layers=2))
    with pytest.raises(ValueError, match="bidirectionally"):
        attention_windows(Gemma3TextConfig(use_bidirectional_attention=True, num_hidden_layers=2))
    assert attention_windows(arch_config("gemma3_text", V, 64, 2)) == {"sliding_attention": WINDOW,
                                                                        "full_attention": None}


# --- ddte generate -----------------------------------------------------------------------------------------------
PROMPT = [5, 9, 3, 17, 22, 40, 2, 11]
NEW_TOKENS = 40


def _greedy_by_recompute(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation, each token from a full forward of everything before it."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            top2 = logits.topk(2).values
            # a near-tie (within TOL, 30x the float32 noise of a tree pass) would make the comparison itself depend
            # on float rounding
            assert float(top2[0] - top2[1]) > TOL * float(logits.abs().max()), "near-tie: pick another seed"
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def _generate(root, draft: str, verifier: str, action: str, forward: str, out) -> dict:
    code = main(["generate", "--prompt-ids", ",".join(map(str, PROMPT)), "--target", str(root / "target"),
                 "--draft", str(root / draft), "--verifier", verifier, "--action", action, "--temperature", "0",
                 "--max-new-tokens", str(NEW_TOKENS), "--draft-forward", forward, "--output", str(out),
                 "--kernels", "default"])  # the target as its own draft is the same q only on the same kernels
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_generate_greedy_equals_a_full_recompute(name: str, tmp_path) -> None:
    """Traversal on (2,1,2) with the small draft (its fast forward where there is one), and SpecInfer on (3,0,3)
    with the target as its own draft through HF's forward, so that whole tree paths are accepted and committed."""
    for role in ROLES:
        seed, width, layers = ROLES[role]
        model = arch_model(name, seed, V, width, layers)
        model.config.eos_token_id = model.generation_config.eos_token_id = None  # all 40 tokens, no early stop
        model.save_pretrained(tmp_path / role)
    target = load_causal_lm(tmp_path / "target")
    reference = _greedy_by_recompute(target, PROMPT, NEW_TOKENS)
    small = _generate(tmp_path, "draft", "traversal", "2,1,2", "fast", tmp_path / "a.jsonl")
    assert small["tokens"] == reference
    perfect = _generate(tmp_path, "target", "specinfer", "3,0,3", "hf", tmp_path / "b.jsonl")
    assert perfect["tokens"] == reference
    assert perfect["stats"]["acceptance_rate"] > 0.9  # the trees' paths were accepted, not only their roots


# --- the sampling loop ---------------------------------------------------------------------------------------------
def _first_two(decoder: SpeculativeDecoder, prompt: list[int], samples: int, sampling: SamplingConfig
               ) -> tuple[dict, int]:
    """Counts of the first two tokens of ``samples`` 4-token generations (4, so the (2,1,2) tree is not clipped by
    the budget), and the draft tokens accepted over all of them."""
    counts: dict[tuple[int, int], int] = {}
    accepted = 0
    for seed in range(samples):
        gen = decoder.generate(prompt, 4, StaticPolicy(Action(2, 1, 2)), TorchRandom(seed), sampling)
        counts[tuple(gen.tokens[:2])] = counts.get(tuple(gen.tokens[:2]), 0) + 1
        accepted += gen.stats.accepted_tokens
    return counts, accepted


def test_sampling_loop_is_lossless_on_a_hybrid_sliding_window_target() -> None:
    """Gemma3 target (sliding, full layers; window 3), windowed Qwen2 draft on the fast forward, SpecInfer on (2,1,2)
    trees at T = 1 after a 6-token prompt, so tree paths reach past the window. The first two tokens of 800
    generations against the target's exact joint law by recompute (χ², rare cells pooled). Negative control: the
    same loop with the window left out of the tree masks is rejected."""
    vocab, prompt, window, sampling = 8, [3, 5, 2, 6, 1, 4], 3, SamplingConfig(1.0)
    target_model = arch_model("gemma3_text", 11, vocab, 32, 2, window, logit_scale=0.5)
    draft = cached_lm(arch_model("qwen2-window", 12, vocab, 32, 1, window, logit_scale=0.5))
    target = CachedLM(target_model)
    assert isinstance(draft, FastCachedLM) and target.layer_windows == [window, None]
    with torch.inference_mode():
        first = distributions(_recompute(target, prompt)[-1], sampling)
        second = distributions(target_model(torch.tensor([prompt + [a] for a in range(vocab)]),
                                            use_cache=False).logits[:, -1].float(), sampling)
    exact = {(a, b): float(first[a] * second[a, b]) for a in range(vocab) for b in range(vocab)}
    counts, accepted = _first_two(SpeculativeDecoder(target, draft, get_verifier("specinfer")), prompt, 800, sampling)
    assert accepted > 800  # most steps accept drafted tokens, so the tree passes decide the output
    assert chi2_p_value(exact, counts) > 1e-4
    blind = CachedLM(target_model)
    blind.layer_windows = [None] * len(blind.layer_windows)
    blind.type_windows = dict.fromkeys(blind.type_windows)
    counts, _ = _first_two(SpeculativeDecoder(blind, draft, get_verifier("specinfer")), prompt, 500, sampling)
    assert chi2_p_value(exact, counts) < 1e-4  # the threshold the correct loop passes
