"""What the decoding step keeps of one request between steps (:class:`Request`), what it reports of one request's
step (:class:`StepReport`), and its clock; decode/batch.py's glossary names the parts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decode.drafting.delayed import DraftedTree
from decode.drafting.tree import ROOT, Regime
from decode.generation import Generation, Job, TokenLogprob, token_logprobs
from decode.policies.base import Policy
from decode.stats import GenerationStats
from decode.verifiers.base import VerifyResult

State = tuple[torch.Tensor, torch.Tensor]  # (final hidden state (H,), law after it (V,)) of one model at one position


@dataclass
class StepReport:
    """One request's part of a step: the tokens it kept (cut at EOS or its budget) and, when it ended in this step
    and left the batch, its :class:`~decode.generation.Generation`; with the job's ``logprobs``, each kept token's
    (:class:`~decode.generation.TokenLogprob`), and with its ``prompt_logprobs``, in its first step, each prompt
    token's after the first."""

    tokens: list[int]
    finished: Generation | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Request:
    """One request between steps.

    Attributes:
        job: what the caller asked (prompt, budget, policy source, random source, sampling, verifier).
        policy: its runner, ``job.policy.start(job.sampling)``.
        target_seq, draft_seq: its sequence in each model's cache.
        target_pending: tokens the target has not run, the root last (a new request's prompt, then the root alone).
        draft_pending: tokens the draft has not run (a new request's prompt; the root, after an accepted leaf).
        draft_root_logits ``(V,)``, draft_root_hidden ``(H_d,)``: the draft at the root, once it ran it.
        target_prev, draft_prev: each model's (state, law) at the token before the root, for root features only.
    """

    job: Job
    policy: Policy
    target_seq: int
    draft_seq: int
    started: float
    stats: GenerationStats = field(default_factory=GenerationStats)
    tokens: list[int] = field(default_factory=list)
    target_pending: list[int] = field(default_factory=list)
    draft_pending: list[int] = field(default_factory=list)
    draft_root_logits: torch.Tensor | None = None
    draft_root_hidden: torch.Tensor | None = None
    target_prev: State | None = None
    draft_prev: State | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # until its first step reports them

    @property
    def context_length(self) -> int:
        return len(self.job.prompt_ids) + len(self.tokens)

    @property
    def root_logits(self) -> torch.Tensor:
        """The draft's logits at the root ``(V,)``, once it ran it."""
        if self.draft_root_logits is None:
            raise ValueError("the draft has not run this request's root yet")
        return self.draft_root_logits

    @property
    def budget(self) -> int:
        return self.job.max_new_tokens - len(self.tokens)

    @property
    def features(self) -> bool:
        """Whether its policy reads root features (and with them the states of both models)."""
        return self.policy.needs_root_features

    @property
    def draft_hidden(self) -> bool:
        """Whether the draft's hidden states are kept for it (root features, or a policy reading trunk states)."""
        return self.policy.needs_root_features or self.policy.needs_draft_hidden

    @property
    def without_replacement(self) -> bool:
        return self.job.verifier.draft_regime == Regime.WITHOUT_REPLACEMENT


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each prompt token's log-probability under the target's raw law at the row before it: ``logits`` ``(m, V)``,
    row i predicting ``tokens[i]``."""
    return token_logprobs(torch.log_softmax(logits.float(), dim=-1), tokens[: len(logits)], k)


def remember_previous(r: Request, drafted: DraftedTree, result: VerifyResult, p: torch.Tensor,
                       target_hidden: torch.Tensor | None, q_root: torch.Tensor) -> None:
    """After a step, the last accepted node (the root if none) is the next root's previous token: each model's state
    and law there. ``p`` ``(n, V)`` and ``target_hidden`` ``(n, H_t)``: the target's rows of the tree, root first."""
    if target_hidden is None or r.draft_root_hidden is None or drafted.hidden is None:
        raise ValueError("root features need both models' hidden states: the step ran without them")
    last = result.path[-1] if result.path else ROOT
    r.target_prev = (target_hidden[last], p[last])
    if last == ROOT:
        r.draft_prev = (r.draft_root_hidden, q_root)
    elif drafted.slots[last] >= 0:
        r.draft_prev = (drafted.hidden[last], drafted.q[last])
    # else: an accepted leaf the draft never ran; the next step's pending pass gives its state


class StepClock:
    """Splits a step's wall time into the phases of each request's statistics (each request waited the whole
    step, so every phase counts for every request)."""

    def __init__(self, stats: list[GenerationStats]) -> None:
        self.stats, self.start = stats, time.perf_counter()
        self.last = self.start

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        for stats in self.stats:
            stats.seconds[phase] += now - self.last
        self.last = now

    def move(self, source: str, to: str, seconds: float) -> None:
        """Count ``seconds`` already lapped in ``source`` as ``to``'s."""
        for stats in self.stats:
            stats.seconds[source] -= seconds
            stats.seconds[to] += seconds
