"""The network and its objectives: shapes, standardisation inside forward, Eq. 12, masking of unlabelled actions."""

from __future__ import annotations

import math

import pytest
import torch

from selector.root.model import INVALID_SCORE, SelectorModule, SelectorNet, be_loss, choose_actions, policy_loss

SIZES = {"target_hidden_prev": 6, "draft_hidden_prev": 4, "draft_hidden_root": 4}


def _inputs(batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 6, generator=g), torch.randn(batch, 4, generator=g), torch.randn(batch, 4, generator=g),
            torch.rand(batch, 11, generator=g) * 5)


def test_forward_shapes_and_raw_scalar_standardisation():
    net = SelectorNet(SIZES, num_scalars=11, num_actions=5, d_proj=8, mlp_hidden=(16, 8)).eval()
    th, dp, dr, sc = _inputs(3)
    mean, std = torch.linspace(0, 1, 11), torch.linspace(1, 2, 11)
    log_mask = [i in (3, 4) for i in range(11)]
    net.set_normalisation(mean.tolist(), std.tolist(), log_mask)
    z = net.standardise(sc)
    expected = torch.where(torch.tensor(log_mask), torch.log1p(sc), sc)
    torch.testing.assert_close(z, (expected - mean) / std)
    assert net(th, dp, dr, sc).shape == (3, 5)


def test_never_valid_actions_get_the_invalid_score():
    net = SelectorNet(SIZES, num_scalars=11, num_actions=5, d_proj=8, mlp_hidden=(16,)).eval()
    net.set_valid_actions([True, False, True, True, False])
    scores = net(*_inputs(4))
    assert (scores[:, [1, 4]] == INVALID_SCORE).all()
    assert (scores[:, [0, 2, 3]] > INVALID_SCORE).all()


def test_nan_actions_are_never_chosen():
    scores = torch.tensor([[0.0, 9.0, 1.0], [5.0, 0.0, 9.0]])  # the invalid actions score highest
    valid = torch.tensor([[True, False, True], [True, True, False]])
    step = torch.ones(2, 3)
    assert choose_actions(scores, step, valid, "policy").tolist() == [2, 0]
    assert choose_actions(scores, step, valid, "be").tolist() == [2, 0]


def test_be_decision_divides_by_step_time():
    scores = torch.tensor([[2.0, 3.0]])  # predicted Ê
    step = torch.tensor([[1.0, 2.0]])  # 2 tokens/ms vs 1.5 tokens/ms
    assert choose_actions(scores, step, torch.ones(1, 2, dtype=torch.bool), "be").tolist() == [0]


def test_policy_loss_matches_eq_12_by_hand():
    # Row: two valid actions, equal scores -> pi = (1/2, 1/2), third action invalid (its be was NaN, stored as 0).
    scores = torch.tensor([[0.0, 0.0, 50.0]], requires_grad=True)
    be = torch.tensor([[2.0, 4.0, 0.0]])
    step = torch.tensor([[1.0, 4.0, 1.0]])
    valid = torch.tensor([[True, True, False]])
    loss, ratio = policy_loss(scores, be, step, valid, torch.tensor([0]), lam=2.0, alpha=0.5)
    tp_pi = (0.5 * 2 + 0.5 * 4) / (0.5 * 1 + 0.5 * 4)  # 3 / 2.5 = 1.2
    r = tp_pi / 2.0  # baseline action 0: 2 / 1
    assert ratio.item() == torch.tensor(r).item()
    assert math.isclose(loss.item(), -math.log(r) + 2.0 * (1 - r) ** 2, rel_tol=1e-6)
    loss.backward()
    assert torch.isfinite(scores.grad).all() and scores.grad[0, 2] == 0  # the invalid action gets no gradient


def test_policy_tail_term_averages_the_worst_alpha_fraction():
    scores = torch.zeros(4, 2)
    be = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [4.0, 4.0]])
    step = torch.ones(4, 2)
    valid = torch.ones(4, 2, dtype=torch.bool)
    base = torch.tensor([0, 0, 0, 0])
    _, ratio = policy_loss(scores, be, step, valid, base, lam=0.0, alpha=0.25)
    assert torch.allclose(ratio, torch.ones(4))
    be_bad = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])  # row 0: the pi-mix is half the base
    loss, ratio = policy_loss(scores, be_bad, step, valid, base, lam=1.0, alpha=0.25)
    expected = -torch.log(ratio).mean() + (1 - 0.5) ** 2  # k = ceil(0.25 * 4) = 1 worst row
    assert torch.isclose(loss, expected)


def test_be_loss_ignores_invalid_actions():
    pred = torch.tensor([[1.0, 100.0], [3.0, 0.0]])
    be = torch.tensor([[2.0, 0.0], [3.0, 1.0]])
    valid = torch.tensor([[True, False], [True, True]])
    assert be_loss(pred, be, valid).item() == pytest.approx((1.0 + 0.0 + 1.0) / 3)


def test_module_keeps_hyperparameters():
    m = SelectorModule(hidden_sizes=SIZES, num_actions=5, objective="be", d_proj=8, mlp_hidden=[16], lam=0.5)
    assert m.hparams.lam == 0.5 and m.decision == "throughput"
    assert SelectorModule(hidden_sizes=SIZES, num_actions=5).decision == "argmax"
