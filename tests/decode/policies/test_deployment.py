"""The deployment file: one policy per verifier that starts, for each generation, the choice nearest its sampling."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import StaticPolicy
from decode.policies.build import deployed_source
from decode.policies.files.deployment import Choice, Deployment, load_deployment

PAIR = SimpleNamespace(fingerprint=lambda: "f" * 64)


@pytest.fixture
def deployment(tmp_path) -> Deployment:
    choices = [Choice("specinfer", 0.6, 1.0, "static", "1,3,0"), Choice("specinfer", 1.0, 1.0, "static", "2,1,2"),
               Choice("traversal", 1.0, 1.0, "static", "1,5,0")]
    return load_deployment(Deployment(choices, "specinfer", PAIR.fingerprint()).write(tmp_path / "policy.json"))


def test_one_policy_serves_every_temperature_with_the_nearest_choice(deployment):
    policy = deployed_source(deployment, "specinfer", PAIR)
    cool, warm = policy.start(SamplingConfig(0.5)), policy.start(SamplingConfig(0.9))
    assert type(cool) is StaticPolicy and cool.action == Action(1, 3, 0)
    assert type(warm) is StaticPolicy and warm.action == Action(2, 1, 2)
    assert policy.describe(SamplingConfig(0.0)) == f"static {Action(1, 3, 0)}, from {deployment.path}"


def test_a_verifier_without_a_choice_and_another_pair_are_refused(deployment):
    with pytest.raises(ValueError, match="no choice for verifier 'nss'"):
        deployed_source(deployment, "nss", PAIR)
    with pytest.raises(ValueError, match="measured on another pair"):
        deployed_source(deployment, "specinfer", SimpleNamespace(fingerprint=lambda: "0" * 64))


def test_the_policy_says_once_when_the_nearest_measured_choice_stands_in(deployment):
    policy = deployed_source(deployment, "specinfer", PAIR)
    assert policy.sampling_note(SamplingConfig(0.6)) is None  # measured there
    note = policy.sampling_note(SamplingConfig(0.3, 0.9))
    assert note == ("note: the policy file has choices for T=0.6 top-p=1, T=1 top-p=1; T=0.3 top-p=0.9 uses the "
                    "nearest, T=0.6 top-p=1")
    assert StaticPolicy(Action(1, 3, 0)).sampling_note(SamplingConfig(0.3)) is None  # holds at any settings


def test_a_choice_of_an_unknown_policy_is_refused_on_reading(tmp_path):
    path = Deployment([Choice("traversal", 1.0, 1.0, "expandr", "1,0,0")], "traversal").write(tmp_path / "p.json")
    with pytest.raises(ValueError, match="unknown policy 'expandr'"):
        load_deployment(path)


@pytest.mark.parametrize("choice, message", [
    ({"verifier": "traversal", "temperature": 1.0, "top_p": 1.0, "policy": "static", "action": "1,1,0",
      "colour": "red"}, "choice 1 has unknown keys colour"),
    ({"verifier": "traversal", "temperature": 1.0, "policy": "static"}, "choice 1 lacks action, top_p"),
    ("static", "choice 1 is not an object"),
])
def test_a_malformed_choice_is_named_in_user_terms(tmp_path, choice, message):
    from decode.policies.files.deployment import FORMAT, load_deployment

    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format": FORMAT, "verifier": "traversal", "choices": [choice]}))
    with pytest.raises(ValueError, match=message):
        load_deployment(path)


def test_a_file_without_choices_says_so(tmp_path):
    from decode.policies.files.deployment import Deployment

    with pytest.raises(ValueError, match="it holds no choices"):
        Deployment([], "traversal").choices_of("traversal")


GOOD_CHOICE = {"verifier": "traversal", "temperature": 1.0, "top_p": 1.0, "policy": "static", "action": "1,1,0"}


@pytest.mark.parametrize(("change", "message"), [
    ({"temperature": "0.6"}, "temperature must be a finite number >= 0, got '0.6'"),
    ({"temperature": None}, "temperature must be a finite number >= 0, got None"),
    ({"temperature": [0.6]}, "temperature must be a finite number >= 0, got [0.6]"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"temperature": True}, "temperature must be a finite number >= 0, got True"),
    ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
    ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
    ({"top_p": "1"}, "top_p must be a number in (0, 1]"),
    ({"verifier": "bogus"}, "verifier must be one of"),
    ({"verifier": 3}, "verifier must be one of"),
    ({"action": "9,9,9"}, "action: (9,9,9) is beyond the action grid"),
    ({"action": [1, 1, 0]}, "action must be a 'K,L1,L2' string"),
    ({"action": "1,x,0"}, "action: an action is 'K,L1,L2'"),
    ({"verifier": "block", "action": "2,0,2"}, "verifier 'block' is not lossless"),
    ({"policy": "selector"}, "a selector choice without its file ('selector':"),
    ({"selector": "s.onnx"}, "a static choice names a selector file, which only a selector choice reads"),
    ({"policy": "expander", "expander": ""}, "an expander choice without its file ('expander':"),
    ({"tokens_per_s": float("inf")}, "tokens_per_s must be a finite number >= 0 or null"),
    ({"reason": 1}, "reason must be a string"),
    ({"profile": {"actions": ["9,9,9"], "be": [1.0], "lengths": [8]}}, "profile is not a static profile"),
    ({"profile": "fast"}, "profile is not a static profile (not an object)"),
])
def test_every_field_of_a_policy_file_is_checked_at_load(tmp_path, change, message):
    from decode.policies.files.deployment import FORMAT

    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format": FORMAT, "verifier": "traversal", "choices": [GOOD_CHOICE | change]}))
    with pytest.raises(ValueError) as caught:
        load_deployment(path)
    assert f"{path}: choice 1" in str(caught.value) and message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("change", "message"), [
    ({"verifier": None}, "verifier must be one of"), ({"choices": []}, "choices must be a non-empty list"),
    ({"choices": {"a": 1}}, "choices must be a non-empty list"), ({"source": []}, "source an object"),
    ({"choices": [GOOD_CHOICE, GOOD_CHOICE | {"action": "1,2,0"}]}, "two choices for one verifier"),
])
def test_a_policy_file_whose_top_level_is_malformed_is_refused(tmp_path, change, message):
    from decode.policies.files.deployment import FORMAT

    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format": FORMAT, "verifier": "traversal", "choices": [GOOD_CHOICE]} | change))
    with pytest.raises(ValueError, match=message):
        load_deployment(path)


def test_the_shipped_policy_files_pass_the_validator():
    from tests.factories import REPO

    for name in ("pipeline_qwen_coder_policy.json", "pipeline_smollm2_expander/policy.json"):
        assert load_deployment(REPO / "results" / name).choices


def test_the_builder_reads_a_policy_file_once_and_builds_every_spec(deployment, monkeypatch):
    import decode.policies.files.deployment as module
    from decode.policies.base import AdaptiveLengthPolicy, EntropyStopPolicy
    from decode.policies.build import LoadedPolicy, build_policy, load_policy_spec, needs_latency
    from decode.policies.spec import PolicySpec, parse_policy_spec

    monkeypatch.setattr(module, "load_deployment", lambda path: pytest.fail("read again"))
    spec = PolicySpec.file("policy", str(deployment.path))
    loaded = load_policy_spec(spec, PAIR, "specinfer", deployment)
    assert isinstance(loaded, LoadedPolicy) and loaded.deployment is deployment and needs_latency(spec)
    assert build_policy(loaded, PAIR, "specinfer").chosen(SamplingConfig(1.0)).action == Action(2, 1, 2)
    assert build_policy(parse_policy_spec("1,0,3"), PAIR, "traversal").action == Action(1, 3, 0)
    adaptive = build_policy(parse_policy_spec("adaptive:max-draft=6"), PAIR, "nss")
    assert isinstance(adaptive, AdaptiveLengthPolicy) and (adaptive.initial, adaptive.maximum) == (4, 6)
    entropy = build_policy(parse_policy_spec("entropy:threshold=1.5"), PAIR, "nss")
    assert isinstance(entropy, EntropyStopPolicy) and (entropy.threshold, entropy.action.l1) == (1.5, 8)
    assert not needs_latency(parse_policy_spec("entropy"))


def test_the_builder_checks_the_verifier_and_the_pair_before_building(deployment):
    from decode.policies.build import build_policy, load_policy_spec
    from decode.policies.spec import PolicySpec

    with pytest.raises(ValueError, match="not lossless"):
        load_policy_spec(PolicySpec.static("2,0,2"), PAIR, "block")
    with pytest.raises(ValueError, match="measured on another pair"):
        load_policy_spec(PolicySpec.file("policy", str(deployment.path)), SimpleNamespace(fingerprint=lambda: "0"),
                         "specinfer")
    with pytest.raises(ValueError, match="no choice for verifier 'nss'"):
        load_policy_spec(PolicySpec.file("policy", str(deployment.path)), PAIR, "nss")
    loaded = load_policy_spec(PolicySpec.static("1,2,0"), PAIR, "nss")
    with pytest.raises(ValueError, match="checked for verifier 'nss', not 'traversal'"):
        build_policy(loaded, PAIR, "traversal")


def test_a_writer_checks_its_choices_with_the_readers_rules():
    Deployment([Choice("traversal", 1.0, 1.0, "static", "1,2,0")], "traversal").check()
    with pytest.raises(ValueError, match="choice 2: action: .* beyond the action grid"):
        Deployment([Choice("traversal", 1.0, 1.0, "static", "1,2,0"), Choice("traversal", 0.6, 1.0, "static",
                                                                               "9,9,9")], "traversal").check()
