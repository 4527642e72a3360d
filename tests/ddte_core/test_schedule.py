"""The one optimisation schedule: linear warmup, cosine to the floor, and its check."""

from __future__ import annotations

import pytest

from ddte_core.schedule import OptimSchedule


def test_warmup_then_cosine_down_to_the_floor():
    s = OptimSchedule(steps=110, lr=0.01, min_lr_ratio=0.1, warmup_steps=10)
    assert s.lr_at(0) == pytest.approx(0.001) and s.lr_at(9) == pytest.approx(0.01)
    assert s.lr_at(10) == pytest.approx(0.01)
    assert s.lr_at(60) == pytest.approx(0.001 + 0.009 * 0.5)  # half way down the cosine
    assert s.lr_at(110) == pytest.approx(0.001) and s.lr_at(500) == pytest.approx(0.001)  # the floor, then held
    rates = [s.lr_at(k) for k in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))


@pytest.mark.parametrize(("changes", "message"), [
    ({"steps": 0}, "steps must be >= 1"), ({"lr": 0.0}, "lr > 0"), ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ({"warmup_steps": -1}, "warmup_steps >= 0"), ({"grad_clip": 0.0}, "grad_clip > 0"),
    ({"max_minutes": 0.0}, "max_minutes must be > 0"),
])
def test_each_bad_value_is_named(changes, message):
    assert message in OptimSchedule(**changes).problem()
    assert OptimSchedule().problem() is None
