"""Offline metrics on hand-made arrays: every expected number is worked out by hand in the test."""

from __future__ import annotations

import matplotlib.figure
import numpy as np
import pytest

from selector.root.data import best_static_actions, ranked_static_actions
from selector.root.metrics import (
    action_histogram_figure,
    offline_metrics,
    oracle_actions,
    predicted_vs_true_figure,
    stream_throughput,
)
from selector.root.root_data import RootArrays

NAN = float("nan")
# Config 0: two roots, three actions. Per-root throughput be/step: row 0 [1, 1, 1.5], row 1 [1, 1.5, 2]; ms per
# token step/be: row 0 [1, 1, 2/3], row 1 [1, 2/3, 1/2]. A rule's stream throughput is N / Σ ms per token.
BE0 = np.array([[1.0, 2.0, 3.0], [1.0, 3.0, 2.0]])
MS0 = np.array([[1.0, 2.0, 2.0], [1.0, 2.0, 1.0]])
# Config 1: one root whose action 2 has no label (NaN): throughput [2, 0.5, -].
BE1 = np.array([[2.0, 2.0, NAN]])
MS1 = np.array([[1.0, 4.0, 1.0]])
BE, MS = np.vstack([BE0, BE1]), np.vstack([MS0, MS1])
CFG = np.array([0, 0, 1])
STATIC = {0: 1, 1: 0}


def test_oracle_skips_unlabelled_actions():
    assert oracle_actions(BE, MS).tolist() == [2, 2, 0]


def test_stream_throughput_averages_the_time_per_token_over_roots():
    # 2 / (2/3 + 1/2) = 12/7: not the ratio of sums (3 + 2) / (2 + 1) = 5/3, nor the mean of 1.5 and 2
    assert stream_throughput(BE0, MS0, np.array([2, 2])) == pytest.approx(12 / 7)


def test_oracle_choice_has_ratio_one_and_no_regret():
    m = offline_metrics(np.array([2, 2, 0]), BE, MS, CFG, STATIC)
    # config 0: TP(oracle) = 12/7, TP(static action 1) = 2 / (1 + 2/3) = 6/5 -> ratio 10/7
    assert m.per_config[0].ratio_vs_static == pytest.approx(10 / 7)
    assert m.per_config[0].ratio_vs_oracle == pytest.approx(1.0)
    # config 1: static is the oracle itself
    assert m.per_config[1].ratio_vs_static == pytest.approx(1.0)
    assert m.ratio_vs_static == pytest.approx((10 / 7 + 1.0) / 2)  # plain mean over configs
    assert m.ratio_vs_oracle == pytest.approx(1.0)
    assert m.regret == pytest.approx(0.0)
    assert m.static_vs_oracle == pytest.approx(((6 / 5) / (12 / 7) + 1.0) / 2)


def test_suboptimal_choice():
    m = offline_metrics(np.array([0, 1, 1]), BE, MS, CFG, np.array([1, 1, 0]))  # static given per row
    # config 0: TP = 2 / (1 + 2/3) = 6/5, the static rule's too -> vs static 1, vs oracle (6/5)/(12/7) = 7/10
    assert m.per_config[0].ratio_vs_static == pytest.approx(1.0)
    assert m.per_config[0].ratio_vs_oracle == pytest.approx(7 / 10)
    # config 1: TP = 1 / (4/2) = 0.5 vs static 2 and oracle 2 -> 1/4
    assert m.per_config[1].ratio_vs_static == pytest.approx(0.25)
    assert m.per_config[1].regret == pytest.approx(0.75)
    assert m.regret == pytest.approx(1 - (7 / 10 + 1 / 4) / 2)
    flat = m.as_dict("val/")
    assert flat["val/ratio_vs_static/cfg1"] == pytest.approx(0.25)
    assert set(flat) >= {"val/ratio_vs_static", "val/ratio_vs_oracle", "val/regret"}


def test_choosing_an_unlabelled_action_is_an_error():
    with pytest.raises(ValueError, match="no label"):
        offline_metrics(np.array([2, 2, 2]), BE, MS, CFG, STATIC)


def test_best_static_uses_stream_throughput_and_only_always_valid_actions():
    arrays = RootArrays(prompt_id=np.array(["a", "a", "b"], dtype=object), sampling_index=CFG, hidden={},
                        scalars=np.zeros((3, 11), np.float32), step_ms=MS.astype(np.float32),
                        be=BE.astype(np.float32))
    # config 0: TP 2 / [2, 5/3, 7/6] -> [1, 1.2, 1.71]: action 2; config 1: action 2 unlabelled -> 0
    assert best_static_actions(arrays) == {0: 2, 1: 0}
    # the ranking behind it: every always-labelled action, fastest first; action 2 is not ranked in config 1
    assert ranked_static_actions(arrays) == {0: [2, 1, 0], 1: [0, 1]}


def test_plot_helpers_return_figures():
    import matplotlib.pyplot as plt

    scatter = predicted_vs_true_figure(BE + 0.1, BE, "t")
    hist = action_histogram_figure(np.array([0, 2, 2]), ["1,0,0", "1,0,1", "1,1,0"], "h", oracle=np.array([2, 2, 0]))
    assert isinstance(scatter, matplotlib.figure.Figure) and isinstance(hist, matplotlib.figure.Figure)
    labels = [t.get_text() for t in hist.axes[0].get_xticklabels()]
    assert labels == ["1,1,0", "1,0,0"]  # most frequent first; the never-seen action is left out
    plt.close(scatter)
    plt.close(hist)
