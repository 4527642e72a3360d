"""One request at a time: :class:`SpeculativeDecoder` decodes a generation as a batch of one on the one decoding
step (:class:`~decode.batch.BatchDecoder`), so a request gives the same tokens here, through ``ddte generate``, and
alone on ``ddte serve``.

The decoder holds the models and the verifier; everything that belongs to one generation (its sampling settings,
the policy serving it, its random source) comes with each call, as in gpt-fast, so one decoder serves any number of
generations, at any temperature, one after another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from decode.batch import BatchDecoder
from decode.cost.table import LatencyTable
from decode.drafting.rng import RandomSource
from decode.drafting.sampling import SamplingConfig
from decode.generation import Generation, Job
from decode.models.cached_lm import CachedLM
from decode.models.loading import check_same_vocab
from decode.policies.base import PolicySource
from decode.verifiers import Verifier


class SpeculativeDecoder:
    """Lossless speculative decoding of a target model with a draft model and delayed trees, one request at a time.

    Commands open one through :func:`decode.session.open_session`, which moves the models to this machine's kernels
    first and hands the decoder the latency table its policies read. A generation whose policy reads root features
    needs ``latency`` (their pass times), and fails without it.
    """

    step_class = BatchDecoder  # the step each generation runs on (a test's negative control swaps in a wrong one)

    def __init__(self, target: CachedLM, draft: CachedLM, verifier: Verifier, eos_token_id: int | None = None,
                 allow_padded_vocab: bool = False, latency: LatencyTable | None = None) -> None:
        check_same_vocab(target.config, draft.config, allow_padded_tail=allow_padded_vocab)  # refused here, not later
        self.target, self.draft, self.verifier = target, draft, verifier
        self.eos_token_id, self.allow_padded_vocab, self.latency = eos_token_id, allow_padded_vocab, latency

    def batch(self) -> BatchDecoder:
        """A fresh step over this decoder's models (it takes over their caches)."""
        return self.step_class(self.target, self.draft, self.eos_token_id, self.allow_padded_vocab, self.latency)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, policy: PolicySource, rng: RandomSource,
                 sampling: SamplingConfig, on_step: Callable[[list[int]], bool] | None = None) -> Generation:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` at ``sampling`` (stops early at EOS).

        ``policy`` (a policy source) may serve every call: the request runs the runner ``policy.start(sampling)``
        returns. ``on_step``, when given, receives each step's kept tokens as soon as the step ends (a server streams
        them); returning False ends the generation there (``stopped_by`` "caller": a stop string, a client gone).
        Whether to go on may depend on the tokens emitted so far only, which is what keeps a stop rule exact
        (tests/decode/exact/test_on_step.py).
        """
        step = self.batch()
        rid = step.join(Job(prompt_ids, max_new_tokens, policy, rng, sampling, self.verifier))
        while True:
            report = step.step()[rid]
            go_on = on_step(report.tokens) if on_step is not None else True
            if report.finished is not None:
                return report.finished
            if not go_on:
                return step.leave(rid)
