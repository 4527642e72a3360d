"""A generation's statistics: the comparison with plain decoding counts one target pass per new token, and prices
them at a one-token pass (not at this run's tree passes)."""

from __future__ import annotations

import pytest

from decode.stats import GenerationStats, plain_target_seconds


def test_plain_decoding_needs_one_pass_per_new_token_and_a_step_never_costs_more():
    stats = GenerationStats()
    for emitted in (1, 1, 1):  # nothing accepted: each step's pass gives one token, as plain decoding's does
        stats.record_step("1,0,2", 2, 0, emitted)
    stats.seconds["target"] = 0.3
    assert stats.vs_plain_decoding().startswith("vs plain decoding: 3 target passes instead of 3 (one per new "
                                                "token): 0 avoided; this run's target passes took 0.30 s (100.0 ms "
                                                "each, a whole tree")
    stats.record_step("1,0,2", 2, 2, 3)
    stats.seconds["target"] = 0.4
    line = stats.vs_plain_decoding()
    assert "4 target passes instead of 6 (one per new token): 2 avoided; " in line
    assert "not known here" in line and "≈" not in line  # no price put on the avoided passes without a table


def test_plain_decodings_passes_are_priced_at_a_one_token_pass_not_at_this_runs_tree_pass():
    """4 steps of tree passes at 100 ms emit 10 tokens; plain decoding's 10 one-token passes at 40 ms cost 0.40 s,
    so the target time saved is 0.40 - 0.40 = 0 s (the old line said 6 avoided × 100 ms = 0.60 s)."""
    stats = GenerationStats()
    for emitted in (4, 3, 2, 1):
        stats.record_step("2,1,2", 3, emitted - 1, emitted)
    stats.seconds.update(target=0.4, draft=0.05, verify=0.01, policy=0.0)
    line = stats.vs_plain_decoding(plain_target_seconds(lambda length: 40.0, 8, stats.new_tokens))
    assert line == ("vs plain decoding: 4 target passes instead of 10 (one per new token): 6 avoided; target time "
                    "0.40 s against plain decoding's ≈ 0.40 s (40.0 ms per one-token pass, latency table): ≈ 0.00 s "
                    "saved on the target, against 0.06 s of drafting, verifying and policy")


def test_plain_target_seconds_sums_one_token_passes_over_the_growing_cache():
    """The k-th pass runs over prompt - 1 + k cached tokens: with a pass of `length` ms, 3 tokens after a 5-token
    prompt are 4 + 5 + 6 = 15 ms."""
    assert plain_target_seconds(float, 5, 3) == pytest.approx(0.015)
    assert plain_target_seconds(float, 5, 0) == 0.0
