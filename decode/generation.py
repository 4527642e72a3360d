"""What a caller hands the decoder and gets back: a :class:`Job` (one request: its prompt, budget, policy, random
source, sampling and verifier) and a :class:`Generation` (its tokens, why it stopped, its statistics), with the two
rules every request obeys: :func:`check_request` before it joins, :func:`cut_at_eos` on each step's tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode.drafting.rng import RandomSource
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import PolicySource
from decode.stats import GenerationStats
from decode.verifiers.base import Verifier


@dataclass(frozen=True)
class Job:
    """One request, everything that is its own: the prompt's token ids, how many tokens it may add, the policy
    source that starts its runner, its random source, its sampling settings and the verifier of its trees.

    ``logprobs``: k, each new token's log-probability under the target's law as sampled (the verification pass's p)
    and the k likeliest tokens there; ``prompt_logprobs``: k, each prompt token's (the first excepted) under the
    target's raw law (temperature 1, the prompt's own pass) and the k likeliest there; None: neither is computed.
    ``stop_at_eos``: False decodes past EOS up to the budget."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    policy: PolicySource
    rng: RandomSource
    sampling: SamplingConfig
    verifier: Verifier
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop_at_eos: bool = True


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under a law and the ``k`` likeliest tokens there (``(id, logprob)``, likeliest
    first); ``-inf`` where the law gives the token no mass."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(log_laws: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Each ``tokens[i]``'s entry of ``log_laws[i]`` ``(n, V)`` (log-probabilities) and that row's ``k`` likeliest."""
    if len(tokens) == 0:
        return []
    picked = log_laws[torch.arange(len(tokens)), torch.as_tensor(list(tokens))].tolist()
    values, ids = (log_laws.topk(k, dim=-1) if k > 0 else (log_laws[:, :0], log_laws[:, :0].long()))
    return [TokenLogprob(int(t), float(lp), tuple(zip(i.tolist(), v.tolist(), strict=True)))
            for t, lp, i, v in zip(tokens, picked, ids, values, strict=True)]


@dataclass
class Generation:
    """One generated sample: the new token ids and the statistics of producing them."""

    tokens: list[int]
    stats: GenerationStats
    stopped_by: str  # "eos", "length", or "caller" (a stop string, a client gone)

    def as_dict(self, tokenizer=None) -> dict:
        """The sample as JSON: its tokens, why it stopped, its statistics, and its text when given a tokenizer."""
        record = {"tokens": self.tokens, "stopped_by": self.stopped_by, "stats": self.stats.as_dict()}
        if tokenizer is not None:
            record["text"] = tokenizer.decode(self.tokens)
        return record


def cut_at_eos(emitted: list[int], budget: int, eos_token_id: int | None) -> tuple[list[int], bool]:
    """(the first ``budget`` of a step's ``emitted`` tokens, cut after EOS if it is among them; whether it was)."""
    kept = emitted[:budget]
    if eos_token_id is not None and eos_token_id in kept:
        return kept[: kept.index(eos_token_id) + 1], True
    return kept, False


def check_request(prompt_ids: Sequence[int], max_new_tokens: int, vocab: int, context_limit: int) -> None:
    """ValueError, in one line, for a request no decoder can serve: an empty prompt, no tokens asked, an id outside
    the vocabulary, or more positions than the models' context window."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    if len(prompt_ids) + max_new_tokens > context_limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the models' "
                         f"context window ({context_limit} positions)")
