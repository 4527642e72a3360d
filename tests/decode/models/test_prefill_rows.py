"""A prefill that returns its last rows only (``CachedLM.prefill(..., last=k)``): the output head runs over those
rows alone, the same logits and hidden states as the full prefill's last rows, and the same cache after it (the
decoding loop and the collectors read nothing else of a prompt)."""

from __future__ import annotations

import pytest
import torch

from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import cached_lm
from tests.decode.architectures import arch_model
from tests.decode.models.test_architectures import V


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gpt_neox"])
@pytest.mark.parametrize("fast", [False, True])
def test_the_last_rows_equal_the_full_prefills_and_leave_the_same_cache(family: str, fast: bool) -> None:
    lm = cached_lm(arch_model(family, 2, V, 32, 2, 8), fast=fast) if fast else CachedLM(arch_model(family, 2, V, 32,
                                                                                                   2, 8))
    if fast and lm.forward_name != "fast":
        pytest.skip(f"{family} has no fast forward")
    seq = list(range(3, 30))
    full_logits, full_hidden = lm.prefill(seq, output_hidden=True)
    after_full = lm.extend([7, 8], commit=True)
    logits, hidden = lm.prefill(seq, output_hidden=True, last=2)
    assert logits.shape == (2, full_logits.shape[1]) and hidden.shape == (2, full_hidden.shape[1])
    torch.testing.assert_close(logits, full_logits[-2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, full_hidden[-2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm.extend([7, 8], commit=True), after_full, rtol=1e-5, atol=1e-5)
    assert lm.prefill(seq, last=1).shape[0] == 1
    with pytest.raises(ValueError, match="at least 1"):
        lm.prefill(seq, last=0)
