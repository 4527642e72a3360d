"""The steering plumbing (decode.models.steering): a new map leaves the draft as it was, the fast forward steers as HF's
does, the target's taps are its hidden states, the file round-trips, and a map meets only its own target."""

from __future__ import annotations

import pytest
import torch

from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import FastCachedLM
from decode.models.hooks import ForwardHook
from decode.models.steering import FILE, SteeringLink, SteeringMap, SteeringSpec, TargetTaps, link_steering
from decode.pair import load_pair, model_fingerprint
from tests.factories import save_tiny_pair, tiny_llama

PROMPT = [5, 9, 3, 17, 22, 40, 2, 11]


def _spec(**kw) -> SteeringSpec:
    return SteeringSpec(**{"target_layers": (0, 2), "target_hidden": 32, "rank": 8, "draft_layers": 2,
                           "draft_ffn": 64, **kw})


def _trained_like(spec: SteeringSpec, seed: int = 0) -> SteeringMap:
    steering = SteeringMap(spec)
    with torch.no_grad():
        steering.out.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return steering


class FixedBias(ForwardHook):
    """Every forward, the prefill included, adds one δ: the plumbing without a target."""

    def __init__(self, delta: torch.Tensor) -> None:
        self.delta = delta

    def up_bias(self, root):
        return self.delta


def _draft(wrapper):
    return wrapper(tiny_llama(seed=2, vocab=64, hidden=32, layers=2, logit_scale=4.0))


def _run_blocks(lm: CachedLM) -> torch.Tensor:
    """Prefill, a two-branch tree block, a commit and a linear block: every kind of forward, logits stacked."""
    out = [lm.prefill(PROMPT)]
    tip = lm.length - 1
    out.append(lm.extend_tree([30, 31, 32, 33], [tip, -1, tip, -3]))
    lm.commit([tip + 3, tip + 4])
    out.append(lm.extend([44, 45], commit=True))
    return torch.cat(out)


def test_a_new_map_leaves_the_draft_as_its_parent():
    steering = SteeringMap(_spec())
    delta = steering(torch.randn(2, 32))
    assert delta.shape == (2, 64) and not delta.any()
    plain, steered = _draft(FastCachedLM), _draft(FastCachedLM)
    steered.hook = FixedBias(delta)
    assert torch.equal(_run_blocks(plain), _run_blocks(steered))


@pytest.mark.parametrize("wrapper", [CachedLM, FastCachedLM], ids=["hf", "fast"])
def test_steering_changes_the_draft(wrapper):
    plain, steered = _draft(wrapper), _draft(wrapper)
    steering = _trained_like(_spec())
    steered.hook = FixedBias(steering(torch.randn(2, 32)))
    assert (_run_blocks(plain) - _run_blocks(steered)).abs().max() > 1e-2


def test_the_steered_fast_forward_equals_the_steered_hf_forward():
    steering = _trained_like(_spec())
    delta = steering(torch.randn(2, 32))
    runs = []
    for wrapper in (CachedLM, FastCachedLM):
        lm = _draft(wrapper)
        lm.hook = FixedBias(delta)
        runs.append(_run_blocks(lm))
    assert (runs[0] - runs[1]).abs().max() <= 1e-5


def test_a_second_steered_draft_must_read_the_same_target_layers():
    target = CachedLM(tiny_llama(seed=1, vocab=64, hidden=32, layers=2))
    link_steering(_draft(CachedLM), target, _trained_like(_spec()))
    link_steering(_draft(FastCachedLM), target, _trained_like(_spec(), seed=1))  # the same taps serve both
    with pytest.raises(ValueError, match="same target layers"):
        link_steering(_draft(CachedLM), target, _trained_like(_spec(target_layers=(1,))))


@pytest.mark.parametrize("wrapper", [CachedLM, FastCachedLM], ids=["hf", "fast"])
def test_taps_are_the_hidden_states_entering_those_layers(wrapper):
    lm = _draft(wrapper)
    lm.hook = TargetTaps((0, 1, 2))
    lm.prefill(PROMPT)
    with torch.inference_mode():
        states = lm.model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    want = torch.stack([states[i][0] for i in (0, 1, 2)], dim=1)
    tapped = torch.stack([lm.hook.row(s) for s in range(len(PROMPT))])
    assert tapped.shape == (len(PROMPT), 3, 32)
    assert (tapped - want).abs().max() <= 1e-5


def test_the_file_round_trips_and_meets_only_its_target(tmp_path):
    root = save_tiny_pair(tmp_path / "pair", vocab=64, target_hidden=32, draft_hidden=16, target_layers=2)
    spec = _spec(draft_layers=1, draft_ffn=32, target_fingerprint=model_fingerprint(root / "target"))
    saved = _trained_like(spec)
    saved.save(root / "draft")
    loaded = SteeringMap.load(root / "draft")
    assert loaded.spec == spec
    states = torch.randn(2, 32)
    assert torch.equal(loaded(states), saved(states).detach())
    pair = load_pair(root / "target", root / "draft")
    assert isinstance(pair.draft.hook, SteeringLink) and pair.target.hook.tap_layers == (0, 2)
    other = save_tiny_pair(tmp_path / "other", vocab=64, target_hidden=32, draft_hidden=16, target_layers=2,
                           seeds=(7, 2))
    with pytest.raises(ValueError, match="trained with another target"):
        load_pair(other / "target", root / "draft")


def test_a_corrupt_file_is_refused(tmp_path):
    (tmp_path / FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="unreadable steering map"):
        SteeringMap.load(tmp_path)


@pytest.mark.parametrize("wrapper", [CachedLM, FastCachedLM], ids=["hf", "fast"])
def test_a_tapping_target_keeps_the_taps_of_each_committed_position_through_commits_and_crops(wrapper):
    lm = _draft(wrapper)
    lm.hook = TargetTaps((0, 2))
    lm.prefill(PROMPT)
    tip = lm.length - 1
    lm.extend_tree([30, 31, 32, 33], [tip, -1, tip, -3])
    lm.commit([tip + 3, tip + 4])  # the second branch: 32, 33
    lm.extend([44, 45], commit=True)
    lm.crop(lm.length - 1)
    sequence = PROMPT + [32, 33, 44]
    with torch.inference_mode():
        states = lm.model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    want = torch.stack([states[i][0] for i in (0, 2)], dim=1)
    got = torch.stack([lm.hook.row(p) for p in range(len(sequence))])
    assert (got - want).abs().max() <= 1e-5
    with pytest.raises(IndexError):
        lm.hook.row(len(sequence))


def test_a_linked_draft_takes_the_delta_of_the_targets_state_before_each_forwards_root():
    """Prefill unsteered; a committed run ending at r and a speculative block above the tip r under δ(taps at r − 1);
    unsteered where the target has not committed r − 1. Negative control: an unlinked draft's logits differ."""
    target = CachedLM(tiny_llama(seed=1, vocab=64, hidden=32, layers=2))
    steering = _trained_like(_spec(draft_layers=2, draft_ffn=64))
    linked, fixed, plain = _draft(CachedLM), _draft(CachedLM), _draft(CachedLM)
    link_steering(linked, target, steering)
    assert target.hook.tap_layers == (0, 2)
    assert torch.equal(linked.prefill(PROMPT[:4]), plain.prefill(PROMPT[:4]))  # the target has run nothing
    assert torch.equal(linked.extend(PROMPT[4:6], commit=True), plain.extend(PROMPT[4:6], commit=True))
    target.prefill(PROMPT[:7])
    fixed.prefill(PROMPT[:6])
    fixed.hook = FixedBias(steering.step_delta(target.hook.row(6)))  # a run ending at position 7: δ of position 6
    want = fixed.extend(PROMPT[6:8], commit=True)
    got = linked.extend(PROMPT[6:8], commit=True)
    assert (got - want).abs().max() <= 1e-5 and (got - plain.extend(PROMPT[6:8], commit=True)).abs().max() > 1e-2
    tip = linked.length - 1
    assert (linked.extend_tree([30, 31], [tip, -1]) - fixed.extend_tree([30, 31], [tip, -1])).abs().max() <= 1e-5
    with torch.inference_mode():  # δ is set only while a forward runs: HF's own forward of the draft is unsteered
        ids = torch.tensor([PROMPT])
        assert torch.equal(linked.model(ids).logits, plain.model(ids).logits)
