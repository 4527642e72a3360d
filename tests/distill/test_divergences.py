"""Each divergence against a hand computation on small distributions, and β = 1 − TV."""

from __future__ import annotations

import math

import pytest
import torch

from distill.divergences import DIVERGENCES, acceptance

P = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
Q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a.tolist(), b.tolist(), strict=True))


def test_each_divergence_equals_its_hand_computation():
    m = 0.5 * (P + Q)
    want = {
        "fkl": _kl(P, Q),
        "rkl": _kl(Q, P),
        "tvd": 0.5 * (abs(0.5 - 0.2) + abs(0.3 - 0.2) + abs(0.2 - 0.6)),
        "jsd": 0.5 * _kl(P, m) + 0.5 * _kl(Q, m),
    }
    for name, value in want.items():
        assert float(DIVERGENCES[name](P, Q.log())) == pytest.approx(value, rel=1e-12), name
    assert float(acceptance(P, Q)) == pytest.approx(1 - want["tvd"])  # β = Σ min(p, q) = 1 − TV


def test_divergences_vanish_on_equal_laws_and_work_per_position():
    batch = torch.softmax(torch.randn(2, 5, 7, dtype=torch.float64), dim=-1)
    for name, divergence in DIVERGENCES.items():
        same = divergence(batch, batch.log())
        assert same.shape == (2, 5) and float(same.abs().max()) < 1e-12, name
        other = divergence(batch, torch.log_softmax(torch.randn(2, 5, 7, dtype=torch.float64), -1))
        assert bool((other > 0).all()), name
