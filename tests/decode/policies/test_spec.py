"""The policy spec: one grammar, one canonical spelling that reads back, and one-line errors."""

from __future__ import annotations

import pytest

from decode.drafting.actions import Action
from decode.policies.spec import PolicySpec, check_spec_verifier, parse_policy_spec
from decode.verifiers import get_verifier


@pytest.mark.parametrize(("text", "spec"), [
    ("2,2,4", PolicySpec("static", Action(2, 2, 4))),
    ("1,3,0", PolicySpec.static("1,0,3")),
    ("adaptive", PolicySpec.adaptive()),
    ("adaptive:max-draft=4", PolicySpec.adaptive(4)),
    ("entropy", PolicySpec.entropy()),
    ("entropy:threshold=1.5", PolicySpec.entropy(1.5)),
    ("entropy:max-draft=6", PolicySpec.entropy(max_draft=6)),
    ("entropy:threshold=0.123456789,max-draft=16", PolicySpec.entropy(0.123456789, 16)),
    ("selector=a/m.onnx", PolicySpec.file("selector", "a/m.onnx")),
    ("expander=e.onnx", PolicySpec.file("expander", "e.onnx")),
    ("policy=runs/policy.json", PolicySpec.file("policy", "runs/policy.json")),
])
def test_every_canonical_spelling_reads_back_to_its_spec(text, spec):
    assert parse_policy_spec(text) == spec
    assert spec.text == str(spec) == text and parse_policy_spec(spec.text) == spec


def test_other_spellings_of_one_policy_read_as_its_canonical_spec():
    assert parse_policy_spec("2,2,0").text == parse_policy_spec("1,0,2").text == "1,2,0"
    assert parse_policy_spec("entropy:max-draft=8,threshold=2.0").text == "entropy"
    assert parse_policy_spec("entropy:max-draft=3,threshold=1").text == "entropy:threshold=1,max-draft=3"


@pytest.mark.parametrize(("text", "message"), [
    ("bogus", "'bogus' is not a policy: use K,L1,L2, adaptive"),
    ("1,x,0", "an action is 'K,L1,L2' (three integers), got '1,x,0'"),
    ("0,1,0", "an action needs K >= 1"),
    ("9,9,9", "(9,9,9) is beyond the action grid"),
    ("selector=", "name the file after selector="),
    ("adaptive:max-draft=0", "max-draft must be >= 1, got 0"),
    ("adaptive:max-draft=17", "max-draft 17: (1,17,0) is beyond the action grid"),
    ("adaptive:max-draft=x", "max-draft must be an integer, got 'x'"),
    ("adaptive:threshold=1", "adaptive takes max-draft=VALUE, got 'threshold=1'"),
    ("entropy:threshold=nan", "threshold must be a finite number > 0, got nan"),
    ("entropy:threshold=-1", "threshold must be a finite number > 0"),
    ("entropy:threshold=1,threshold=2", "entropy: threshold is given twice"),
    ("entropy:", "entropy takes threshold=VALUE, max-draft=VALUE, got ''"),
])
def test_bad_specs_are_one_line_value_errors(text, message):
    with pytest.raises(ValueError) as caught:
        parse_policy_spec(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_spec_holds_exactly_the_parts_of_its_kind():
    for kwargs in [{"kind": "static"}, {"kind": "selector"}, {"kind": "adaptive"}, {"kind": "bogus"},
                   {"kind": "adaptive", "max_draft": 4, "entropy_threshold": 1.0},
                   {"kind": "static", "action": Action(1, 2, 0), "path": "x"}]:
        with pytest.raises(ValueError, match="not a policy spec"):
            PolicySpec(**kwargs)


def test_the_verifier_check_refuses_a_shape_it_is_not_lossless_on():
    check_spec_verifier(PolicySpec.static("2,0,2"), get_verifier("traversal"))
    with pytest.raises(ValueError, match="not lossless"):
        check_spec_verifier(PolicySpec.static("2,0,2"), get_verifier("block"))
