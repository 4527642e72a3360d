"""The method contract: one parse, one canonical spelling, and the rows found again by typed methods."""

from __future__ import annotations

import pytest

from bench.method import AR, Method, by_method, static_rows, unique_methods
from decode.drafting.actions import Action
from decode.policies.spec import PolicySpec


def test_equivalent_static_shapes_are_one_method_under_the_canonical_spelling():
    assert Method.parse("specinfer@2,2,0") == Method.parse("specinfer@1,0,2") == Method.static("specinfer", "1,2,0")
    assert Method.parse("specinfer@1,0,2").key == "specinfer@1,2,0"
    assert Method.parse("traversal@2,1,3").key == "traversal@2,1,3" and Method.parse("ar") == AR
    kept, dropped = unique_methods(["ar", "specinfer@1,0,2", "specinfer@2,2,0", "traversal@4,3,0", "nss@1,3,0"])
    assert [m.key for m in kept] == ["ar", "specinfer@1,2,0", "traversal@1,3,0", "nss@1,3,0"]
    assert dropped == ["specinfer@2,2,0"]


def test_every_form_parses_into_its_parts_and_back():
    for text, kind, action, path in [
        ("ar", "ar", None, None), ("hf-assisted", "hf-assisted", None, None),
        ("traversal@2,1,3", "static", Action(2, 1, 3), None), ("nss@adaptive", "adaptive", None, None),
        ("nss@entropy", "entropy", None, None), ("specinfer@selector=a/m.onnx", "selector", None, "a/m.onnx"),
        ("specinfer@policy=runs/policy.json", "policy", None, "runs/policy.json"),
        ("traversal@expander=m/e.onnx", "expander", None, "m/e.onnx"),
    ]:
        method = Method.parse(text)
        assert (method.kind, method.action, method.path) == (kind, action, path)
        assert method.key == str(method) == text and Method.parse(method.key) == method
        assert method.is_static == (kind == "static") and method.is_hf == (kind in ("ar", "hf-assisted"))
    assert Method.parse("specinfer@selector=a/m.onnx").label == "specinfer@selector=m.onnx"
    assert Method.selector("specinfer", "a/m.onnx") == Method.parse("specinfer@selector=a/m.onnx")
    assert Method.parse("Traversal@1,3,0").verifier == "traversal"  # the verifier's own name


@pytest.mark.parametrize(("text", "error", "message"), [
    ("bogus@1,2,0", KeyError, "unknown verifier"), ("block@2,0,2", ValueError, "not lossless"),
    ("traversal", ValueError, "bad method"), ("traversal@1,x,0", ValueError, "bad method"),
])
def test_bad_methods_are_refused_with_one_line(text, error, message):
    with pytest.raises(error, match=message):
        Method.parse(text)


def test_rows_are_found_by_their_typed_method():
    rows = [{"method": m, "temperature": t} for t in (0.6, 1.0) for m in ("ar", "nss@1,3,0", "nss@selector=s.onnx")]
    at_t = by_method(rows, 1.0)
    assert at_t[AR] is rows[3] and at_t[Method.selector("nss", "s.onnx")] is rows[5]
    assert static_rows(rows, "nss", 0.6, ["1,0,3", "3,3,0"]) == [rows[1], rows[1]]  # canonical shapes


def test_a_method_holds_exactly_the_parts_of_its_kind():
    spec = PolicySpec.static("1,2,0")
    for parts in [("ar", "nss"), ("ar", None, spec), (None, "nss"), (None, None, spec), ("bogus",), ()]:
        with pytest.raises(ValueError, match="not a method"):
            Method(*parts)


def test_named_policies_with_options_are_methods_and_defaults_keep_the_old_spelling():
    method = Method.parse("nss@entropy:max-draft=6,threshold=1.5")
    assert method.policy == PolicySpec.entropy(1.5, 6) and method.key == "nss@entropy:threshold=1.5,max-draft=6"
    assert Method.parse("nss@entropy:threshold=2,max-draft=8").key == "nss@entropy"
    assert Method.parse("nss@adaptive:max-draft=4").policy == PolicySpec.adaptive(4)
    with pytest.raises(ValueError, match="bad method 'nss@9,9,9': .* beyond the action grid"):
        Method.parse("nss@9,9,9")


def test_a_ddte_method_may_name_another_draft():
    method = Method.parse("specinfer@1,0,2+draft=runs/distill/steered")
    assert (method.kind, method.action, method.draft) == ("static", Action(1, 2, 0), "runs/distill/steered")
    assert method.key == "specinfer@1,2,0+draft=runs/distill/steered" and Method.parse(method.key) == method
    assert method.label == "specinfer@1,2,0+draft=steered" and method != Method.static("specinfer", "1,2,0")
    policy = Method.parse("nss@selector=a/m.onnx+draft=d")
    assert (policy.kind, policy.path, policy.draft) == ("selector", "a/m.onnx", "d")
    kept, dropped = unique_methods(["nss@1,3,0", "nss@1,3,0+draft=d", "nss@3,3,0+draft=d"])
    assert [m.key for m in kept] == ["nss@1,3,0", "nss@1,3,0+draft=d"] and dropped == ["nss@3,3,0+draft=d"]
    with pytest.raises(ValueError, match="name the draft folder"):
        Method.parse("nss@1,3,0+draft=")
    with pytest.raises(ValueError, match="not a method"):
        Method("ar", draft="d")
