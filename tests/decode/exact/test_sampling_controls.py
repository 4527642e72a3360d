"""Top-k and min-p (decode/drafting/sampling.py) keep every verifier exact: both are functions of one row of logits,
so the draft samples from its law under them, the target's law goes through the same transform, and the verifier
reads both.

Exact enumeration through the real batch step (tiny HF models over a 3-token vocabulary,
:mod:`tests.decode.exact.harness`): :class:`ReplayRandom` walks every random choice of the watched request (its tree
draws and its verifier's coins) beside a companion with other settings; the law of its first tokens must equal
:func:`recomputed_law` under the same :class:`SamplingConfig` (which calls :func:`distributions`, so it applies the
same top-k and min-p). Negative control the same harness must catch: a loop whose draft samples under top-k (or
min-p) while its verifier reads q computed without it.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import decode.batch
from decode.batch import BatchDecoder
from decode.drafting.delayed import TreeDrafting
from decode.drafting.rng import TorchRandom
from decode.drafting.sampling import SamplingConfig, distributions
from decode.verifiers import verifier_names
from tests.decode.exact.harness import enumerate_runs, outcome_law, recomputed_law
from tests.decode.exact.test_batch import Entry, drive, job, other
from tests.decode.exact.test_expander_loop import PROMPT, TOKENS, TOL, VOCAB, law_error, pair

CONTROLS = {
    "top-k": SamplingConfig(1.0, top_k=2),
    "min-p": SamplingConfig(0.7, min_p=0.75),
    "top-k+top-p+min-p": SamplingConfig(1.2, 0.9, top_k=2, min_p=0.5),
}


def test_each_control_cuts_the_law_it_is_tested_on():
    """Every control removes tokens from some of the laws the enumeration meets (the target's and the draft's), so a
    loop that applied it to one side only would change the law."""
    target, draft = pair()
    for name, sampling in CONTROLS.items():
        plain = SamplingConfig(sampling.temperature, sampling.top_p)
        for model in (target, draft):
            cut = 0
            with torch.inference_mode():
                for prefix in itertools.chain.from_iterable(itertools.product(range(VOCAB), repeat=n)
                                                            for n in range(TOKENS)):
                    logits = model.model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
                    cut += int((distributions(logits, sampling) == 0).sum() > (distributions(logits, plain) == 0).sum())
            assert cut > 0, f"{name} cuts nothing of the {'target' if model is target else 'draft'}"


def watched(name: str, sampling: SamplingConfig):
    """The watched request under ``sampling`` and a companion with another verifier, temperature and top-k."""
    return lambda rng: [Entry(job(PROMPT, TOKENS, name, sampling, rng)),
                        Entry(job([1], 4, other(name), SamplingConfig(1.1, top_k=2, min_p=0.2), TorchRandom(7)))]


@pytest.mark.parametrize("name", verifier_names())
@pytest.mark.parametrize("control", list(CONTROLS))
def test_a_request_under_top_k_and_min_p_is_the_targets_law(name, control):
    target, draft = pair()
    sampling = CONTROLS[control]
    got = outcome_law(enumerate_runs(lambda rng: drive(BatchDecoder(target, draft), watched(name, sampling)(rng))[0]
                                     [:TOKENS]))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, recomputed_law(target, PROMPT, TOKENS, VOCAB, sampling)) < TOL


# --- negative control ---------------------------------------------------------------------------------------------
def without(sampling: SamplingConfig, field: str) -> SamplingConfig:
    """``sampling`` with one control turned off."""
    return dataclasses.replace(sampling, **{field: 0})


class DrawsFiltered(TreeDrafting):
    """Wrong: keeps (and hands the verifier) each node's law without the control ``field``, but draws each child
    from the law with it, as a draft that filtered its own draws and reported the unfiltered q."""

    field = "top_k"

    def __init__(self, draft, q_root, sampling, rng, output_hidden, root_slot=None) -> None:
        super().__init__(draft, q_root, without(sampling, self.field), rng, output_hidden, root_slot)
        self.filtered = sampling

    def draw_index(self, node: int) -> tuple[int, int]:
        law = self.laws[node]
        # re-applied to the law's logs: temperature 1 and no top-p, so only the control itself acts
        kept = distributions(law.clamp_min(1e-30).log(), SamplingConfig(1.0, top_k=self.filtered.top_k,
                                                                         min_p=self.filtered.min_p))
        index = self.rng.categorical(kept * (law > 0))
        return self.builder.draw(node, index), index


class UnfilteredRoots(BatchDecoder):
    """The root's q without the control, as the tree's other rows (DrawsFiltered draws from it filtered)."""

    def _draft_roots(self, live):
        super()._draft_roots(live)
        return {rid: distributions(r.draft_root_logits, without(r.job.sampling, DrawsFiltered.field))
                for rid, r in live.items()}


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
@pytest.mark.parametrize(("field", "control"), [("top_k", "top-k"), ("min_p", "min-p")])
def test_the_harness_catches_a_verifier_that_reads_q_without_the_control(name, field, control, monkeypatch):
    target, draft = pair()
    sampling = CONTROLS[control]
    want = recomputed_law(target, PROMPT, TOKENS, VOCAB, sampling)

    def law(decoder_class) -> dict:
        return outcome_law(enumerate_runs(lambda rng: drive(decoder_class(target, draft),
                                                            watched(name, sampling)(rng))[0][:TOKENS]))

    assert law_error(law(BatchDecoder), want) < TOL
    monkeypatch.setattr(DrawsFiltered, "field", field)
    monkeypatch.setattr(decode.batch, "TreeDrafting", DrawsFiltered)
    assert law_error(law(UnfilteredRoots), want) > 100 * TOL
