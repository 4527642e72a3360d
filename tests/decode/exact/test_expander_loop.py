"""Expansion decided while drafting, in the real loop: an expander's halting rule (decode/policies/expander.py) ends the
trunk node by node inside :meth:`SpeculativeDecoder.generate`, and every verifier that accepts the trees it drafts
stays exactly lossless through several steps.

Exact enumeration (algorithms.md §1.3): :class:`ReplayRandom` walks every random choice of the loop (the tree draws
and the verifiers' coins) on tiny HF models over a 3-token vocabulary; the law of the first three tokens must equal
the target's. The rule's threshold is placed between signal values the loop meets, so the trunk halts on some paths
and grows on others. Signals: the draft's top probability, and a learned head on the draft's hidden state, depth
and root scalars (a fixed random linear map standing in for an exported one; it sees the same inputs), and the
marginal rule on an acceptance model's β̂ (a random map of the node's own features through a sigmoid; the loop then
keeps the draft's hidden states and computes no root features). Negative
control, through the same hooks: a loop that looks at the trunk's first draw and drafts nothing when that draw was
not the draft's favourite must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.batch import BatchDecoder
from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.delayed import DraftedTree
from decode.drafting.sampling import SamplingConfig, distributions
from decode.drafting.tree import Regime, TreeBuilder
from decode.engine import SpeculativeDecoder
from decode.models.cached_lm import CachedLM
from decode.models.fast_llama import cached_lm
from decode.policies.expander import HaltingPolicy
from decode.policies.files.expander_file import HaltingRule, NodeRule
from decode.verifiers import get_verifier, verifier_names
from tests.decode.exact.harness import enumerate_runs, outcome_law, recomputed_law
from tests.factories import tiny_llama

VOCAB, PROMPT, TOKENS = 3, [2, 0, 1], 3
TOL = 1e-5  # float32 models: a tree pass and a plain recompute differ by ~1e-7 in p
SAMPLING = SamplingConfig(1.0)
LATENCY = LatencyTable(lengths=[1], sizes=[1], draft_ms=[[1.0]], target_ms=[[1.0]])  # root features need one


def pair(seed: int = 3) -> tuple[CachedLM, CachedLM]:
    target = CachedLM(tiny_llama(seed=seed, vocab=VOCAB, hidden=32, layers=2, logit_scale=3.0))
    draft = cached_lm(tiny_llama(seed=seed + 100, vocab=VOCAB, hidden=16, layers=1, logit_scale=3.0))
    return target, draft


class LinearHead:
    """A learned head's interface (decode.policies.expander.AcceptanceHead) over a fixed random linear map: on the
    node's features and root scalars (the ridge head), or on the node's alone through a sigmoid (an acceptance
    model's β̂, ``reads_root`` False)."""

    def __init__(self, width: int, seed: int = 0, reads_root: bool = True) -> None:
        self.weight = np.random.default_rng(seed).normal(size=width).astype(np.float32)
        self.root = np.zeros(0, dtype=np.float32)
        self.reads_root = reads_root

    def set_root(self, hidden_size: int, scalars: np.ndarray) -> None:
        self.root = scalars

    def __call__(self, hidden: torch.Tensor, entropy: float, top: float, depth: int) -> float:
        features = np.concatenate([hidden.float().numpy(), [entropy, top, depth], self.root])
        value = float(features @ self.weight)
        return value if self.reads_root else float(1.0 / (1.0 + np.exp(-value)))


class Recorder(HaltingPolicy):
    """The policy, also recording every signal it computes and every tree the loop drafts."""

    signals: list[float] = []

    def halts(self, node):
        halt = super().halts(node)  # the marginal signal reads the β̂ this appends
        if not self.marginal:
            Recorder.signals.append(self.signal(node))
        elif node.depth < self.rule.cap:
            Recorder.signals.append(self.marginal_signal(node.depth))
        return halt

    def start(self, sampling):
        return Recorder(self.node_rule, self.head, self.machine)


def policy(signal: str, rule: HaltingRule) -> HaltingPolicy:
    head = {"learned": LinearHead(16 + 3 + 11), "marginal": LinearHead(16 + 3, reads_root=False)}.get(signal)
    chain = [1.0 + d for d in range(rule.cap + 1)] if signal == "marginal" else None
    return Recorder(NodeRule(1.0, 1.0, signal, "1,0,0", rule, chain_ms=chain), head)


def target_law(target: CachedLM) -> dict[tuple[int, ...], float]:
    """P(first TOKENS tokens = s) under the target, by plain recomputes."""
    return recomputed_law(target, PROMPT, TOKENS, VOCAB, SAMPLING)


def loop_law(decoder: SpeculativeDecoder, node_policy: HaltingPolicy) -> tuple[dict, set[str]]:
    """(law of the first TOKENS tokens, the trees the loop drafted) over every run."""
    shapes: set[str] = set()

    def run(rng):
        generation = decoder.generate(PROMPT, TOKENS, node_policy, rng, SAMPLING)
        shapes.update(generation.stats.action_counts)
        return tuple(generation.tokens[:TOKENS])

    return outcome_law(enumerate_runs(run)), shapes


def law_error(got: dict, want: dict) -> float:
    return max(abs(got.get(s, 0.0) - p) for s, p in want.items())


def splitting_threshold(decoder: SpeculativeDecoder, signal: str, rule: HaltingRule) -> float:
    """A θ between signal values the loop meets at depths where the rule may halt: some paths halt, some grow."""
    Recorder.signals = []
    loop_law(decoder, policy(signal, HaltingRule(-np.inf, rule.floor, rule.cap, rule.k, rule.l2)))
    values = np.unique(np.round(Recorder.signals, 6))
    assert len(values) >= 2, "the loop met one signal value only: the test cannot split it"
    return float(np.median(values))


def _cases():
    """Per verifier: a branching terminal where it takes delayed trees, else stop (single paths)."""
    for name in verifier_names():
        verifier = get_verifier(name)
        branch = all(verifier.supports_action(2, d, 1) for d in range(2))
        k, l2 = (2, 1) if branch else (1, 0)
        for signal in ("top", "learned", "marginal"):
            yield pytest.param(name, signal, k, l2, id=f"{name}-{signal}-{'branch' if branch else 'stop'}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "signal", "k", "l2"), list(_cases()))
def test_halting_while_drafting_is_lossless_through_several_steps(name, signal, k, l2):
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    cap = 1 if k > 1 else 2
    shape = HaltingRule(0.0, 0, cap, k, l2)
    rule = HaltingRule(splitting_threshold(decoder, signal, shape), 0, cap, k, l2)
    got, shapes = loop_law(decoder, policy(signal, rule))
    assert len({Action.parse(s.strip("()")).l1 for s in shapes}) >= 2, f"the trunk never halted early: {shapes}"
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert law_error(got, target_law(target)) < TOL


def _draw_cases():
    """Per verifier, a rule on the trunk's earlier draws (decode/policies/signals.py): their running log-product, and
    the last draw's q over its law's top, decided at depth 1 (after one draw) or 2."""
    for name in verifier_names():
        verifier = get_verifier(name)
        branch = all(verifier.supports_action(2, d, 1) for d in range(3))
        for signal in ("path_logq", "draw_ratio"):
            yield pytest.param(name, signal, *((2, 1) if branch else (1, 0)),
                               id=f"{name}-{signal}-{'branch' if branch else 'stop'}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "signal", "k", "l2"), list(_draw_cases()))
def test_halting_on_the_earlier_draws_is_lossless(name, signal, k, l2):
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)
    shape = HaltingRule(0.0, 1, 2, k, l2)  # from depth 1 on, where one draw is known
    Recorder.signals = []
    loop_law(decoder, policy(signal, HaltingRule(-np.inf, 1, 2, k, l2)))
    at_depth_one = np.unique(np.round(Recorder.signals, 6))
    rule = HaltingRule(float(np.median(at_depth_one)), shape.floor, shape.cap, k, l2)
    got, shapes = loop_law(decoder, policy(signal, rule))
    assert len({Action.parse(s.strip("()")).l1 for s in shapes}) >= 2, f"the trunk never halted early: {shapes}"
    assert law_error(got, target_law(target)) < TOL


def _root_only(drafted: DraftedTree) -> DraftedTree:
    """The step's tree dropped: the root alone (the draft's speculative slots are dropped at the commit)."""
    return DraftedTree(TreeBuilder().build(Regime.IID, (1, 0, 0)), drafted.q[:1], drafted.slots[:1],
                       drafted.draft_calls)


def _first_trunk_token(drafted: DraftedTree) -> int | None:
    tree = drafted.tree
    first = next((v for v in range(1, tree.num_nodes) if tree.parents[v] == 0), None)
    return None if first is None else tree.tokens[first]


class PeekingStep(BatchDecoder):
    """Wrong: drafts with the policy, then drops the whole tree when the trunk's first draw was not the draft's
    favourite token: whether a drawn token is verified depends on the draw itself."""

    def _draft_trees(self, live, q_roots, actions):
        drafted = super()._draft_trees(live, q_roots, actions)
        for rid, tree in drafted.items():
            token = _first_trunk_token(tree)
            if token is not None and token != int(q_roots[rid].argmax()):
                drafted[rid] = _root_only(tree)
        return drafted


class PeekingDecoder(SpeculativeDecoder):
    step_class = PeekingStep


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_loop_that_peeks_at_the_trunk_draw_is_caught(name):
    target, draft = pair()
    rule = HaltingRule(-np.inf, 0, 1, 1, 0)  # a one-token chain: the peek alone must be caught
    got, _ = loop_law(PeekingDecoder(target, draft, get_verifier(name), latency=LATENCY), policy("top", rule))
    assert law_error(got, target_law(target)) > 100 * TOL


def target_likes_at_least(step: BatchDecoder, r, token: int, q_root) -> bool:
    """Whether the target's law at request ``r``'s root (a plain recompute of its context: what a peeking step reads)
    gives ``token`` at least the draft's probability ``q_root[token]``."""
    with torch.inference_mode():
        logits = step.target.lm.model(torch.tensor([[*r.job.prompt_ids, *r.tokens]])).logits[0, -1]
    return bool(distributions(logits.float(), r.job.sampling)[token] >= q_root[token])


class TargetPeekingStep(BatchDecoder):
    """Wrong: drops the step's tree when the target likes the trunk's first draw less than the draft does
    (p(x) < q(x)), p read from the target at the root: a halting decision that reads the current step's target law
    at a drawn token."""

    def _draft_trees(self, live, q_roots, actions):
        drafted = super()._draft_trees(live, q_roots, actions)
        for rid, r in live.items():
            token = _first_trunk_token(drafted[rid])
            if token is None:
                continue
            if not target_likes_at_least(self, r, token, q_roots[rid]):
                drafted[rid] = _root_only(drafted[rid])
        return drafted


class TargetPeekingDecoder(SpeculativeDecoder):
    step_class = TargetPeekingStep


@pytest.mark.parametrize("name", ["specinfer", "traversal"])
def test_a_marginal_expander_that_peeks_at_the_target_is_caught(name):
    target, draft = pair()
    prompt = PROMPT[-1:]
    rule = HaltingRule(-np.inf, 0, 1, 1, 0)
    decoder = TargetPeekingDecoder(target, draft, get_verifier(name), latency=LATENCY)
    honest = SpeculativeDecoder(target, draft, get_verifier(name), latency=LATENCY)

    def law(loop):
        return outcome_law(enumerate_runs(
            lambda rng: tuple(loop.generate(prompt, TOKENS, policy("marginal", rule), rng, SAMPLING).tokens)))

    want = recomputed_law(target, prompt, TOKENS, VOCAB, SAMPLING)
    assert law_error(law(honest), want) < TOL
    assert law_error(law(decoder), want) > 100 * TOL


def test_the_drafted_trees_are_what_the_rule_says():
    """With θ below every top probability the trunk grows to the cap; above all, it halts at the root, or at the floor.
    (Near the token budget the decoder clips a tree to (K, d, 0) shapes, which these checks leave aside.)"""
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, get_verifier("traversal"), latency=LATENCY)
    from decode.drafting.rng import TorchRandom

    runs = {name: decoder.generate(PROMPT, 12, policy("top", rule), TorchRandom(0), SAMPLING).stats.action_counts
            for name, rule in (("never", HaltingRule(-1.0, 0, 2, 2, 1)), ("always", HaltingRule(2.0, 0, 2, 2, 1)),
                               ("floor", HaltingRule(2.0, 1, 2, 2, 1)))}
    assert "(2,2,1)" in runs["never"] and not {"(2,1,1)", "(2,0,1)"} & set(runs["never"])
    assert "(2,0,1)" in runs["always"] and all(Action.parse(a.strip("()")).l1 == 0 for a in runs["always"])
    assert "(2,1,1)" in runs["floor"] and "(2,0,1)" not in runs["floor"]
