"""The survival model (selector/acceptance/survival.py): fitted on the drawn token's features it recovers a survival
that depends on q(x) better than the model without them, the dense set's token ranks come from the next node's draw,
and its signals at trunk depth d read nothing past depth d (a signal that reads x_{d+1} is caught by the same check)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from decode.policies.halting import marginal_gain, survival_gain
from decode.policies.signals import TrunkArrays
from selector.acceptance.survival import (
    DenseDraws,
    SurvivalModel,
    fit_logistic,
    fit_survival,
    heldout_cross_entropy,
    load_dense_draws,
    survival_signals,
    token_ranks,
)


def _synthetic_draws(n: int = 6000, seed: int = 0) -> tuple[DenseDraws, np.ndarray]:
    """Nodes whose drawn token survives with a chance set by log q(x) (the law only through what q shows), and that
    chance ``(N,)``: the realized label is its noisy draw in {0, 1}."""
    rng = np.random.default_rng(seed)
    entropy = rng.uniform(0.0, 3.0, n)
    top = np.exp(-0.6 * entropy) * rng.uniform(0.8, 1.0, n)
    favourite = rng.random(n) < top
    q = np.where(favourite, top, top * rng.uniform(0.001, 0.9, n))
    rank = np.where(favourite, 0, rng.integers(1, 50, n))
    chance = 1.0 / (1.0 + np.exp(-(1.0 + 1.5 * np.log(q))))
    realized = (rng.random(n) < chance).astype(np.float64)
    temperature = rng.choice([0.6, 1.0], n)
    prompts = np.array([str(i // 60) for i in range(n)], dtype=object)
    return DenseDraws(entropy, top, temperature, q, rank, chance, realized, prompts), chance


def test_the_drawn_tokens_features_recover_a_survival_the_law_alone_cannot():
    draws, chance = _synthetic_draws()
    law, both = draws.law(), np.concatenate([draws.law(), draws.draws()], axis=1)
    assert heldout_cross_entropy(both, draws.realized, draws.prompts, folds=4) < \
        heldout_cross_entropy(law, draws.realized, draws.prompts, folds=4) - 0.02
    model = fit_survival(draws)
    fitted = model.token_survival(draws.entropy, draws.top, draws.temperature, draws.token_q, draws.token_rank)
    no_draw = fit_logistic(law, draws.realized).predict(law)
    assert np.abs(fitted - chance).mean() < 0.5 * np.abs(no_draw - chance).mean()


def test_a_logistic_fit_recovers_its_generating_weights_from_a_soft_label():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(20000, 3)) * [1.0, 2.0, 0.5] + [0.0, 1.0, -1.0]
    truth = 1.0 / (1.0 + np.exp(-(x @ np.array([1.0, -0.5, 2.0]) + 0.3)))
    fit = fit_logistic(x, truth, l2=0.0)
    assert np.allclose(fit.predict(x), truth, atol=1e-6)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        fit_logistic(x, truth + 1.0)


def test_a_tokens_rank_is_the_next_nodes_draw_unless_that_node_is_a_root():
    keys = np.array([0, 0, 0, 0, 1, 1])
    depth = np.array([0, 1, 0, 1, 0, 1])  # depth cycle 2: the third node starts a new trunk
    draw_rank = np.array([0, 7, 0, 3, 0, 5])
    assert token_ranks(keys, depth, draw_rank).tolist() == [7, -1, 3, -1, 5, -1]


def test_dense_draws_read_in_continuation_order_with_their_tokens_ranks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "dense.json").write_text(json.dumps({"schema_version": 2, "spec": {"source": "draft"}}))
    rows = [(p, t, c, j) for p in (7, 12) for t in (0.6, 1.0) for c in (0, 1) for j in range(4)]
    order = np.random.default_rng(0).permutation(len(rows))  # shards need not be in continuation order
    rows = [rows[i] for i in order]
    column = {"prompt_id": [r[0] for r in rows], "temperature": [r[1] for r in rows],
              "continuation": [r[2] for r in rows], "position": [r[3] for r in rows],
              "depth": [r[3] % 2 for r in rows], "draw_rank": [10 * r[3] + r[2] for r in rows]}
    column |= {name: [0.5] * len(rows) for name in ("entropy", "top1", "beta", "token_q", "realized")}
    pq.write_table(pa.table(column), tmp_path / "dense-00000.parquet")
    draws = load_dense_draws(tmp_path)
    # positions 0..3, depth cycle 2: the token at position 0 has rank 10 + c (position 1's draw), position 2's 30 + c
    expected = [r for _ in range(2) for _ in range(2) for c in (0, 1) for r in (10 + c, -1, 30 + c, -1)]
    assert draws.token_rank.tolist() == expected
    assert draws.prompts.tolist() == ["12"] * 16 + ["7"] * 16


def _trunks(rng, shape=(5, 2, 7)) -> TrunkArrays:
    entropy = rng.uniform(0.0, 3.0, shape)
    top = np.exp(-0.5 * entropy)
    draw_q = top * rng.uniform(0.01, 1.0, shape)
    draw_rank = rng.integers(0, 20, shape).astype(np.float64)
    draw_top = rng.uniform(0.2, 1.0, shape)
    draw_q[..., 0], draw_rank[..., 0], draw_top[..., 0] = 1.0, 0.0, 1.0
    return TrunkArrays(top, entropy, draw_q, draw_rank, draw_top)


def _reads_past(signal, arrays: TrunkArrays, rng) -> bool:
    """Whether ``signal`` (``TrunkArrays -> (..., D)``) at some depth d moves when the states past d change (the law
    at depth d + 1 and on, and the draws from x_{d+1} on)."""
    base = signal(arrays)
    for d in range(base.shape[-1] - 1):
        changed = _trunks(rng, arrays.top.shape)
        mixed = TrunkArrays(*(np.concatenate([getattr(arrays, f)[..., :d + 1], getattr(changed, f)[..., d + 1:]],
                                             axis=-1) for f in ("top", "entropy", "draw_q", "draw_rank", "draw_top")))
        if not np.allclose(signal(mixed)[..., :d + 1], base[..., :d + 1]):
            return True
    return False


def test_the_survival_signals_at_depth_d_read_no_draw_past_x_d_and_a_peeking_one_is_caught():
    rng = np.random.default_rng(2)
    draws, _ = _synthetic_draws(2000)
    model: SurvivalModel = fit_survival(draws)
    arrays = _trunks(rng)
    chain = np.cumsum(rng.uniform(20.0, 40.0, (5, 1, 7)), axis=-1)
    for name in ("survival", "survival_marginal"):
        assert not _reads_past(lambda a, name=name: survival_signals(model, a, 0.6, chain)[name], arrays, rng)

    def peeking(a: TrunkArrays) -> np.ndarray:  # P_d β̂_d with x_{d+1}'s survival in place of β̂_d
        p = survival_signals(model, a, 0.6)["survival"] / model.beta(a.entropy, a.top, 0.6)
        nxt = model.token_survival(a.entropy[..., :-1], a.top[..., :-1], 0.6, a.draw_q[..., 1:], a.draw_rank[..., 1:])
        return p * np.concatenate([nxt, nxt[..., -1:]], axis=-1)

    assert _reads_past(peeking, arrays, rng)


def test_the_survival_gain_on_the_products_of_beta_is_the_marginal_rule():
    rng = np.random.default_rng(3)
    beta = rng.uniform(0.2, 1.0, (4, 3, 7))
    chain = np.cumsum(rng.uniform(20.0, 40.0, (4, 1, 7)), axis=-1)
    before = np.concatenate([np.ones_like(beta[..., :1]), np.cumprod(beta, axis=-1)[..., :-1]], axis=-1)
    assert np.array_equal(survival_gain(before, beta, chain), marginal_gain(beta, chain))
    # a drawn token surer than β̂ said raises the gain of growing past it
    sure = before.copy()
    sure[..., 2:] = before[..., 2:] / beta[..., 1:2]
    assert (survival_gain(sure, beta, chain)[..., 2:] > marginal_gain(beta, chain)[..., 2:]).all()
