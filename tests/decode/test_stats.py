"""A generation's statistics: the comparison with plain decoding counts one target pass per new token."""

from __future__ import annotations

from decode.stats import GenerationStats


def test_plain_decoding_needs_one_pass_per_new_token_and_a_step_never_costs_more():
    stats = GenerationStats()
    for emitted in (1, 1, 1):  # nothing accepted: each step's pass gives one token, as plain decoding's does
        stats.record_step("1,0,2", 2, 0, emitted)
    stats.seconds["target"] = 0.3
    assert stats.vs_plain_decoding().startswith("vs plain decoding: 3 target passes instead of 3 (one per new "
                                                "token): 0 avoided, ≈ 0.00 s of target time at 100.0 ms per pass")
    stats.record_step("1,0,2", 2, 2, 3)
    stats.seconds["target"] = 0.4
    assert "4 target passes instead of 6 (one per new token): 2 avoided, ≈ 0.20 s" in stats.vs_plain_decoding()
