"""A draft budget shared across a batch (``VERIFIER@shared``): each step one chain length for the whole batch.

Each request r keeps a survival estimate β_r: the chance that its next drafted token is accepted, given the ones
before it were, from its OWN earlier steps only (discounted counts of accepted tokens over the drafted positions the
verifier tested, with a prior). Every request of the step drafts the chain (1, L, 0), L clipped to its own cap
(``max-draft``, its room in the context and its token budget), with the L of the most expected tokens per ms:

    E = Σ_r (1 + Σ_{j ≤ L_r} β_r^j),
    T = c(l) + t_q(l, R) + Σ_{j ≥ 1} t_q(l + j, n_j) + t_p(l, Σ_r (1 + L_r))

on the machine's latency table at the batch's mean context length l, each pass priced beside the batch's R requests
(decode/cost/pricing.py ``step_ms``, whose docstring reads T term by term). Alone (R = 1) this is
the request's own best chain; in a batch it is the best static chain at the batch's size (a single-token pass costs
the same for the batch, so a larger batch wants shorter chains), following the batch's acceptance.

Why one length, not one per request: a request's own longer chain adds draft levels that every request of the step
waits for, and a closed batch lasts as long as its slowest request: offline, cross-fitted, chains chosen per request
lost to the batch's best static tree where one chain for all matched it (bench/batch_admission.py,
results/batch_admission_qwen_coder_traversal_zen5.json).

**Exactness.** The lengths read only what is known before the step's drafting: each request's earlier outcomes, the
context lengths, the caps and the table; never this step's draft draws nor the target's outputs. So each step's tree
is fixed before its tokens are drawn, as for any stateful policy, and every verifier keeps each request's target law
(tests/decode/exact/test_batch_budget.py, by exact enumeration, with a budget that peeks at the draws as the negative
control). A request alone (the single loop, a batch of one) runs the same rule over itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from decode.cost.pricing import step_ms
from decode.drafting.actions import Action
from decode.policies.base import Policy, PolicySource, RootState, StepOutcome

if TYPE_CHECKING:
    from decode.cost.table import LatencyTable
    from decode.drafting.sampling import SamplingConfig

DEFAULT_MAX_DRAFT = 6
PRIOR_SURVIVAL = 0.7  # β before any step: the prior's mean ...
PRIOR_TRIALS = 2.0  # ... worth this many tested positions
DISCOUNT = 0.9  # earlier steps' counts shrink by this every step, so β follows the text and drifts back to the prior


class SharedBudgetPolicy(Policy):
    """One generation's runner: its survival estimate β (``survival``) and its cap; the batch decides one chain for
    it and the others (:func:`batch_actions`), alone ``choose`` decides it over itself."""

    name = "shared"
    stateful = True
    shares_budget = True

    def __init__(self, table: LatencyTable, max_draft: int = DEFAULT_MAX_DRAFT) -> None:
        self.table, self.max_draft = table, max_draft
        self.accepted, self.tested = 0.0, 0.0  # discounted counts of this generation's earlier steps

    @property
    def survival(self) -> float:
        """β: the posterior mean of a tested position's acceptance, prior included."""
        return (PRIOR_SURVIVAL * PRIOR_TRIALS + self.accepted) / (PRIOR_TRIALS + self.tested)

    def choose(self, root: RootState) -> Action:
        length = shared_lengths([self.survival], [min(self.max_draft, root.max_depth)], root.context_length,
                                self.table)[0]
        return Action(1, length, 0)

    def observe(self, outcome: StepOutcome) -> None:
        """Positions tested: the accepted ones and the first rejected one, if the chain had one left."""
        drafted = outcome.action.l1
        self.accepted = DISCOUNT * self.accepted + outcome.accepted
        self.tested = DISCOUNT * self.tested + min(outcome.accepted + 1, drafted)


class SharedBudgetSource(PolicySource):
    """``shared[:max-draft=N]`` on the running machine's latency table; starts a fresh estimate per generation.
    Without a table (None) it is only checked: it starts nothing (decode.policies.build builds it with one)."""

    name = "shared"

    def __init__(self, table: LatencyTable | None, max_draft: int = DEFAULT_MAX_DRAFT) -> None:
        self.table, self.max_draft = table, max_draft

    def start(self, sampling: SamplingConfig) -> SharedBudgetPolicy:
        if self.table is None:
            raise ValueError("the shared budget prices each step on the machine's latency table, and has none")
        return SharedBudgetPolicy(self.table, self.max_draft)

    def describe(self, sampling: SamplingConfig) -> str:
        return f"shared budget (one chain of up to {self.max_draft} tokens for the batch, each step)"


def batch_actions(policies: Sequence[SharedBudgetPolicy], rooms: Sequence[int], context_lengths: Sequence[int],
                  fixed: Sequence[Action] = ()) -> list[Action]:
    """The chains of one batch step: ``policies[i]`` with ``rooms[i]`` tokens of room gets ``result[i]``.

    ``context_lengths``: every live request's (the sharing ones and the others), whose mean the table is read at;
    ``fixed``: the trees the other requests' own policies chose, whose nodes the step's passes run too. The first
    policy's table prices the step (one source serves a batch)."""
    caps = [max(0, min(policy.max_draft, room)) for policy, room in zip(policies, rooms, strict=True)]
    length = sum(context_lengths) / len(context_lengths)
    lengths = shared_lengths([policy.survival for policy in policies], caps, length, policies[0].table, fixed)
    return [Action(1, n, 0) for n in lengths]


def shared_lengths(survival: Sequence[float], caps: Sequence[int], length: float, table: LatencyTable,
                   fixed: Sequence[Action] = ()) -> list[int]:
    """``(R,)`` chain lengths: the one length L (each request's clipped to its cap) with the most expected tokens per
    ms (module docstring), ``survival`` β_r and ``caps`` per request, the table read at context ``length``;
    ``fixed``: other requests' trees, priced only."""
    best, best_rate = [0] * len(survival), _rate(survival, [0] * len(survival), length, table, fixed)
    for common in range(1, max(caps, default=0) + 1):
        lengths = [min(common, cap) for cap in caps]
        rate = _rate(survival, lengths, length, table, fixed)
        if rate > best_rate:
            best, best_rate = lengths, rate
    return best


def _rate(survival: Sequence[float], lengths: Sequence[int], length: float, table: LatencyTable,
          fixed: Sequence[Action]) -> float:
    """E / T of one step with these chains (module docstring); the fixed trees add their time, not their tokens."""
    expected = sum(1 + sum(beta ** j for j in range(1, n + 1)) for beta, n in zip(survival, lengths, strict=True))
    return expected / step_ms(lengths, length, table, fixed)
