"""The deployment file: one policy per verifier that starts, for each generation, the choice nearest its sampling."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import StaticPolicy
from decode.policies.deployment import Choice, Deployment, load_deployment

PAIR = SimpleNamespace(fingerprint=lambda: "f" * 64)


@pytest.fixture
def deployment(tmp_path) -> Deployment:
    choices = [Choice("specinfer", 0.6, 1.0, "static", "1,3,0"), Choice("specinfer", 1.0, 1.0, "static", "2,1,2"),
               Choice("traversal", 1.0, 1.0, "static", "1,5,0")]
    return load_deployment(Deployment(choices, "specinfer", PAIR.fingerprint()).write(tmp_path / "policy.json"))


def test_one_policy_serves_every_temperature_with_the_nearest_choice(deployment):
    policy = deployment.policy_for("specinfer", PAIR)
    cool, warm = policy.start(SamplingConfig(0.5)), policy.start(SamplingConfig(0.9))
    assert type(cool) is StaticPolicy and cool.action == Action(1, 3, 0)
    assert type(warm) is StaticPolicy and warm.action == Action(2, 1, 2)
    assert policy.describe(SamplingConfig(0.0)) == f"static {Action(1, 3, 0)}, from {deployment.path}"


def test_a_verifier_without_a_choice_and_another_pair_are_refused(deployment):
    with pytest.raises(ValueError, match="no choice for verifier 'nss'"):
        deployment.policy_for("nss", PAIR)
    with pytest.raises(ValueError, match="measured on another pair"):
        deployment.policy_for("specinfer", SimpleNamespace(fingerprint=lambda: "0" * 64))


def test_the_policy_says_once_when_the_nearest_measured_choice_stands_in(deployment):
    policy = deployment.policy_for("specinfer", PAIR)
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
    from decode.policies.deployment import FORMAT, load_deployment

    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format": FORMAT, "verifier": "traversal", "choices": [choice]}))
    with pytest.raises(ValueError, match=message):
        load_deployment(path)


def test_a_file_without_choices_says_so(tmp_path):
    from decode.policies.deployment import Deployment

    with pytest.raises(ValueError, match="it holds no choices"):
        Deployment([], "traversal").choices_of("traversal")
