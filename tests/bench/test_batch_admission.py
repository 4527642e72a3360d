"""The batch admission study: its calibration, its root decision and its per-node admission do what they say on
episodes whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from bench.batch_admission import Episodes, admitted, at_root, calibration, static_step
from decode.cost.pricing import passes_ms
from decode.cost.table import LatencyTable
from decode.drafting.actions import Action

CAP = 4


def _table() -> LatencyTable:
    """A pass costs 10 + n ms for the draft and 100 + 8 n ms for the target over n tokens, at any length."""
    sizes = [1, 64]
    row = lambda base, per: [base + per * n for n in sizes]  # noqa: E731
    return LatencyTable(lengths=[0, 1000], sizes=sizes, draft_ms=[row(10, 1), row(10, 1)],
                        target_ms=[row(100, 8), row(100, 8)])


def _episodes(betas: np.ndarray) -> Episodes:
    """Roots ``(N,)`` whose every node accepts with the root's β: chains' Ê = Σ β^d, leaves of (2, d, 1) add
    β^d (1 − (1 − β)²) after d accepted tokens; the signal at every depth is β itself."""
    actions = [Action(1, d, 0) for d in range(CAP + 1)] + [Action(2, d, 1) for d in range(CAP + 1)]
    n = len(betas)
    powers = betas[:, None] ** np.arange(CAP + 1)  # (N, D + 1) P_d
    chains = np.cumsum(powers, axis=1)
    branches = chains + powers * (1 - (1 - betas[:, None]) ** 2)
    be = np.concatenate([chains, branches], axis=1)[:, None, :]  # (N, 1, A)
    signal = np.repeat(betas[:, None], CAP + 1, axis=1)[:, None, :]
    return Episodes(actions, be, powers[:, None, :], {"entropy": signal}, np.full(n, 100), np.arange(n), CAP)


def test_the_calibration_reads_back_each_bins_acceptance():
    betas = np.repeat([0.2, 0.5, 0.9], 40)
    episodes = _episodes(betas)
    beta = calibration(episodes.signals["entropy"], episodes.survival, bins=3)
    assert [beta(b) for b in (0.2, 0.5, 0.9)] == pytest.approx([0.2, 0.5, 0.9])


@pytest.mark.parametrize("acceptance", [0.3, 0.7, 0.95])
def test_alone_the_root_decision_is_the_best_chain(acceptance):
    episodes, table = _episodes(np.array([acceptance])), _table()
    rates = [episodes.tree_be(0, 0, Action(1, d, 0)) / static_step(Action(1, d, 0), 1, 100, table)
             for d in range(CAP + 1)]
    tokens, ms = at_root(episodes, [(0, 0)], 100.0, table, episodes.survival[:, 0])
    assert tokens / ms == pytest.approx(max(rates))


def test_admission_follows_the_gains():
    """Sure trunks grow to the cap, hopeless ones never start, and the step is priced on the passes it ran."""
    episodes, table = _episodes(np.array([0.99, 0.0])), _table()

    def reader(batch):
        return lambda r, d: float(episodes.survival[batch[r][0], 0, d + 1] / max(
            episodes.survival[batch[r][0], 0, d], 1e-12))

    mixed, hopeless = [(0, 0), (1, 0)], [(1, 0), (1, 0)]
    tokens, ms = admitted(episodes, mixed, 100.0, table, reader(mixed), branch=False)
    assert tokens == pytest.approx(episodes.tree_be(0, 0, Action(1, CAP, 0)) + 1.0)
    assert ms == pytest.approx(passes_ms(2, [1] * (CAP - 1), 2 + CAP, 100.0, table))
    nothing, ms_nothing = admitted(episodes, hopeless, 100.0, table, reader(hopeless), branch=True)
    assert nothing == pytest.approx(2 * episodes.tree_be(1, 0, Action(2, 0, 1)))
    assert ms_nothing == pytest.approx(passes_ms(2, [], 2 * 3, 100.0, table))
