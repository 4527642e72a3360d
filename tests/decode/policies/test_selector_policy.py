"""The ONNX selector at decode time: it is refused when its metadata does not match, fails cleanly on a broken
file, and keeps the decoding loop lossless (χ² on the first two tokens, as tests/engine/test_lossless.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from decode.cost.measure import loop_table
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.policies.files.selector_file import INPUT_NAMES
from decode.policies.selector import Guard, SelectorError, SelectorPolicy
from decode.verifiers import get_verifier
from tests.decode.selectors import HIDDEN, selector_policy, with_guard, with_metadata
from tests.decode.test_lossless import P_VALUE, PROMPT, SAMPLES, chi2_p_value, exact_first_two
from tests.factories import tiny_llama

T1 = SamplingConfig(1.0)


def test_selector_loads_and_reports_its_provider(selector_file):
    policy = selector_policy(selector_file)
    assert policy.provider == "CPUExecutionProvider"
    assert len(policy.actions) == 4 * 3 * 3


def test_bound_buffers_give_the_session_scores(selector_file):
    """The per-step call copies features into buffers bound once; each call must see its own features."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from decode.policies.features import SCALAR_NAMES, RootFeatures

    policy = selector_policy(selector_file)
    assert policy.bound is not None
    run = SelectorPolicy(policy, policy.guard(T1))
    session = ort.InferenceSession(str(selector_file), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        features = RootFeatures(*(torch.randn(n, generator=generator) for n in (HIDDEN, HIDDEN, HIDDEN)),
                                torch.rand(len(SCALAR_NAMES), generator=generator))
        feeds = {name: getattr(features, name).numpy()[None] for name in INPUT_NAMES}
        want = session.run(None, feeds)[0][0]
        np.testing.assert_allclose(run.scores(features), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"verifier": "traversal"}, "trained for verifier 'specinfer'"),
        ({"target_hidden": 64}, "hidden sizes"),
        ({"pair_fingerprint": "f" * 64}, "another pair"),
    ],
)
def test_mismatched_selector_is_refused(selector_file, changes, message):
    with pytest.raises(SelectorError, match=message):
        selector_policy(selector_file, **changes)


def test_other_feature_schema_is_refused(selector_file, tmp_path):
    names = json.dumps(["entropy_p_prev", "something_else"])
    odd = with_metadata(selector_file, tmp_path / "odd.onnx", "ddte.scalar_names", names)
    with pytest.raises(SelectorError, match="scalar features"):
        selector_policy(odd)
    old = with_metadata(selector_file, tmp_path / "old.onnx", "ddte.feature_schema", "0")
    with pytest.raises(SelectorError, match="feature schema 0"):
        selector_policy(old)


def test_a_file_without_the_guard_metadata_is_refused_with_a_clear_message(selector_file, tmp_path):
    """Files exported before the never-lose guard (metadata version 1: no fallback, no margin) are refused."""
    v1 = with_metadata(selector_file, tmp_path / "v1.onnx", "ddte.metadata_version", None)
    v1 = with_metadata(v1, v1, "ddte.fallbacks", None)
    with pytest.raises(SelectorError, match="metadata version 1.*retrain and re-export"):
        selector_policy(v1)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing"])
def test_broken_file_gives_a_clear_error(selector_file, tmp_path, damage):
    bad = tmp_path / "bad.onnx"
    data = selector_file.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(b"not an onnx file at all")
    with pytest.raises(SelectorError, match="bad.onnx"):
        selector_policy(bad)


def test_generate_cli_refuses_a_broken_selector(tmp_path, capsys):
    from ddte.cli import main

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x01garbage")
    code = main(["generate", "--prompt-ids", "1,400,12", "--max-new-tokens", "4", "--selector", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "bad.onnx" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_loop_with_the_selector_is_lossless(selector_file, name):
    target = tiny_llama(seed=11, vocab=8, layers=2, logit_scale=6.0)
    draft = tiny_llama(seed=12, vocab=8, layers=1, logit_scale=6.0)
    sampling = SamplingConfig(1.0)
    policy = selector_policy(selector_file, verifier="specinfer")
    target_lm, draft_lm = CachedLM(target), CachedLM(draft)
    # the pass times its root features read, measured as decode/session.py does for a decoder given no table
    decoder = SpeculativeDecoder(target_lm, draft_lm, get_verifier(name), latency=loop_table(target_lm, draft_lm))
    counts: dict[tuple[int, int], int] = {}
    chosen = set()
    for seed in range(SAMPLES):
        gen = decoder.generate(PROMPT, 2, policy, TorchRandom(seed), sampling)
        counts[tuple(gen.tokens)] = counts.get(tuple(gen.tokens), 0) + 1
        chosen.update(gen.stats.action_counts)
    assert len(chosen) >= 2, "the selector must vary its choice for this test to mean more than a static one"
    p_value = chi2_p_value(exact_first_two(target, sampling), counts)
    assert p_value > P_VALUE, f"{name} + selector: χ² p = {p_value:.2e}"


class _StubLatency:
    """Eq. 11 stand-in: T̂ grows by 1 ms per drafted token."""

    def step_ms_many(self, length, passes):
        return 5.0 + (passes.tree_sizes - 1).astype(float)  # tree_sizes count the root


def test_throughput_decision_calibrates_the_unmodelled_step_time(selector_file, tmp_path, monkeypatch):
    from decode.drafting.actions import Action
    from decode.policies.base import RootState, StepOutcome

    small, large = Action(1, 1, 0), Action(2, 1, 2)  # T̂ 6 and 10 ms
    path = with_metadata(selector_file, tmp_path / "throughput.onnx", "ddte.objective", "be")
    path = with_guard(path, path, margin=0.0, action=small.key)
    policy = selector_policy(path)
    scores = np.full(len(policy.actions), -1e9, dtype=np.float32)
    scores[policy.actions.index(small)], scores[policy.actions.index(large)] = 1.5, 2.0
    monkeypatch.setattr(SelectorPolicy, "scores", lambda self, features: scores)
    run = policy.start(T1)  # stateful: each generation calibrates its own copy
    root = RootState(64, None, 8, T1, features=object(), latency=_StubLatency())
    assert run.choose(root) == small  # 1.5/6 > 2.0/10
    for _ in range(5):  # every step really costs 30 ms more than Eq. 11 says
        run.observe(StepOutcome(large, 1, 2, context_length=64, seconds=(10.0 + 30.0) / 1e3))
    assert run.overhead_ms == pytest.approx(30.0)
    assert run.choose(root) == large  # 2.0/40 > 1.5/36
    assert policy.start(T1).overhead_ms == 0.0  # the next generation starts afresh
    for _ in range(200):  # steps faster than modelled never make the overhead negative
        run.observe(StepOutcome(small, 0, 1, context_length=64, seconds=1e-3))
    assert run.overhead_ms == 0.0


def test_the_guard_keeps_the_fallback_unless_the_margin_is_met(selector_file, tmp_path, monkeypatch):
    from decode.drafting.actions import Action
    from decode.policies.base import RootState

    fallback, other = Action(1, 1, 0), Action(2, 1, 2)
    path = with_guard(selector_file, tmp_path / "guard.onnx", margin=0.25, action=fallback.key)
    policy = selector_policy(path)
    assert policy.guard(T1) == Guard(fallback, policy.actions.index(fallback), 0.25)
    run = policy.start(T1)
    assert isinstance(run, SelectorPolicy) and run.needs_root_features
    scores = np.zeros(len(policy.actions), dtype=np.float32)
    monkeypatch.setattr(run, "scores", lambda features: scores)
    root = RootState(64, None, 8, T1, features=object())
    scores[policy.actions.index(fallback)], scores[policy.actions.index(other)] = 0.4, 0.48  # +20 %: not enough
    assert run.choose(root) == fallback
    scores[policy.actions.index(other)] = 0.52  # +30 %: clears the 25 % margin
    assert run.choose(root) == other


def test_a_guard_that_never_leaves_the_fallback_costs_nothing(selector_file, tmp_path, monkeypatch):
    """Margin None: a generation starts as the static fallback (no root features); the network is never called."""
    from decode.drafting.actions import Action
    from decode.policies.base import RootState, StaticPolicy

    path = with_guard(selector_file, tmp_path / "off.onnx", margin=None, action="2,1,2")
    policy = selector_policy(path)
    run = policy.start(T1)
    assert type(run) is StaticPolicy and run.action == Action(2, 1, 2) and not run.needs_root_features

    def no_call(*_):
        raise AssertionError("the network must not run")

    monkeypatch.setattr(SelectorPolicy, "scores", no_call)
    assert run.choose(RootState(64, None, 8, T1)) == Action(2, 1, 2)


def test_one_selector_serves_every_temperature_with_its_own_guard(selector_file, tmp_path):
    """The guard comes from the generation's sampling (the nearest configuration the file has), not from a
    configuration fixed when the selector was loaded."""
    from decode.drafting.actions import Action
    from decode.policies.base import StaticPolicy

    guards = [{"temperature": 0.6, "top_p": 1.0, "action": "1,0,2", "margin": None},  # spelled as (1,2,0) is
              {"temperature": 1.0, "top_p": 1.0, "action": "2,1,2", "margin": 0.1}]
    policy = selector_policy(with_metadata(selector_file, tmp_path / "two.onnx", "ddte.fallbacks", json.dumps(guards)))
    cool, warm = policy.start(SamplingConfig(0.5)), policy.start(SamplingConfig(0.9))
    assert type(cool) is StaticPolicy and cool.action.canonical() == Action(1, 2, 0)
    assert isinstance(warm, SelectorPolicy) and warm.guard.action == Action(2, 1, 2)
    assert policy.describe(SamplingConfig(0.6)).endswith(f"(fallback {Action(1, 2, 0)}, never leaves it)")
