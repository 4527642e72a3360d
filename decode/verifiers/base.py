"""The verifier interface and its result type.

A verifier declares, besides its rule, what its callers need to know about it, so that no caller tests its name or
type (after HF's ``CandidateGenerator``, whose subclasses declare their capabilities):

* ``draft_regime``: how the decoder must draft for it (i.i.d. draws, or per-node without replacement for RSD);
* ``label_rule``: how data collection computes its exact labels from shared union trees (:class:`LabelRule`).

The registry of verifiers by name is :data:`decode.verifiers.VERIFIERS`; this module imports no verifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from decode.drafting.rng import RandomSource
from decode.drafting.tree import DraftTree, Regime, probe_tree


class LabelRule(StrEnum):
    """How exact labels of every action come out of a root's union trees (data_gen/labels.py).

    ``REACH``: a top-down verifier; reach probabilities from its solver's exact branching, shared by all actions.
    ``TRAVERSAL``: Traversal's fold walk with folds cached across a root's trees.
    ``PATHS``: GBV's path nodes (order, q̃, BV sums) cached across a root's trees.
    ``TREE``: the verifier's own exact expectation on each action tree, built explicitly (always correct).
    ``NONE``: union trees do not sample this verifier's draft regime; it cannot be labelled from them.
    """

    REACH = "reach"
    TRAVERSAL = "traversal"
    PATHS = "paths"
    TREE = "tree"
    NONE = "none"


class UnsupportedTreeError(ValueError):
    """The verifier is not lossless on this tree regime."""


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification round.

    Attributes:
        path: accepted nodes from the root's child down to the last accepted node (root excluded); τ = len(path).
        tokens: the accepted draft tokens along ``path``.
        extra_token: the correction token (after a rejection) or the bonus token (after a full acceptance).
    """

    path: tuple[int, ...]
    tokens: tuple[int, ...]
    extra_token: int

    @property
    def accepted(self) -> int:
        """τ, the number of accepted draft tokens."""
        return len(self.path)

    @property
    def emitted(self) -> tuple[int, ...]:
        """All tokens this round emits: accepted tokens then the extra token (τ + 1 of them)."""
        return self.tokens + (self.extra_token,)


def make_result(tree: DraftTree, node: int, extra_token: int) -> VerifyResult:
    path = tuple(tree.path_to(node))
    return VerifyResult(path, tuple(tree.tokens[v] for v in path), int(extra_token))


class Verifier:
    """A lossless verification rule.

    ``p`` and ``q`` are ``(n, V)`` tensors over the tree's n nodes (root first): row u is the target's and the
    draft's next-token distribution after node u's prefix, exactly as used for sampling (after temperature and
    top-p). Rows of q at leaves are never read.
    """

    name: str = ""
    draft_regime: Regime = Regime.IID
    label_rule: LabelRule = LabelRule.TREE
    _INHERITED_RULES = (LabelRule.REACH, LabelRule.TREE, LabelRule.NONE)

    def __init_subclass__(cls, **kwargs) -> None:
        # A fast label rule leans on the internals of the class that declares it. A subclass that changes a hook
        # (the exact suite's negative controls do) must not inherit it silently: unless it declares its own rule,
        # it gets the always-correct per-tree rule. REACH goes through the subclass's own solver, so it carries over.
        super().__init_subclass__(**kwargs)
        if "label_rule" not in cls.__dict__ and cls.label_rule not in cls._INHERITED_RULES:
            cls.label_rule = LabelRule.TREE

    def supports(self, tree: DraftTree) -> bool:
        """Whether this verifier is lossless on the tree's drafting regime."""
        raise NotImplementedError

    def check_tree(self, tree: DraftTree) -> None:
        if not self.supports(tree):
            raise UnsupportedTreeError(
                f"verifier '{self.name}' is not lossless on a {tree.regime.value} tree of shape {tree.shape}; "
                f"it supports: {self.regime_help}"
            )

    regime_help: str = ""

    def supports_action(self, k: int, l1: int, l2: int) -> bool:
        """Whether this verifier is lossless on the (K, L1, L2) trees the decoder drafts for it."""
        return self.supports(probe_tree(k, l1, l2, self.draft_regime))

    def check_action(self, action) -> None:
        """A clear ValueError, before any decoding, when this verifier is not lossless on ``action``'s trees (an
        :class:`~decode.drafting.actions.Action`)."""
        if not self.supports_action(action.k, action.l1, action.l2):
            raise ValueError(f"verifier '{self.name}' is not lossless on {action} trees; it supports "
                             f"{self.regime_help}")

    def verify(self, tree: DraftTree, p: torch.Tensor, q: torch.Tensor, rng: RandomSource) -> VerifyResult:
        """Run one verification round."""
        self.check_tree(tree)
        _check_shapes(tree, p, q)
        return self._verify(tree, p, q, rng)

    def expected_block_efficiency(self, tree: DraftTree, p: torch.Tensor, q: torch.Tensor) -> float:
        """E[τ + 1 | tree]: the verifier's own randomness summed out exactly."""
        self.check_tree(tree)
        _check_shapes(tree, p, q)
        return self._expected(tree, p, q)

    def _verify(self, tree, p, q, rng) -> VerifyResult:
        raise NotImplementedError

    def _expected(self, tree, p, q) -> float:
        raise NotImplementedError


def _check_shapes(tree: DraftTree, p: torch.Tensor, q: torch.Tensor) -> None:
    if p.dim() != 2 or p.shape != q.shape or p.shape[0] != tree.num_nodes:
        raise ValueError(f"p and q must both be (n={tree.num_nodes}, V); got {tuple(p.shape)} and {tuple(q.shape)}")
