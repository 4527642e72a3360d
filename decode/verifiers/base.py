"""The verifier interface, its result type and the registry of verifiers by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode.rng import RandomSource
from decode.tree import DraftTree


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


_REGISTRY: dict[str, type[Verifier]] = {}


def register(cls: type[Verifier]) -> type[Verifier]:
    _REGISTRY[cls.name] = cls
    return cls


def verifier_names() -> list[str]:
    """Names of all registered verifiers."""
    _load_all()
    return list(_REGISTRY)


def get_verifier(name: str) -> Verifier:
    """A verifier instance by name (case-insensitive); raises KeyError listing the known names."""
    _load_all()
    key = name.lower()
    if key not in _REGISTRY:
        raise KeyError(f"unknown verifier '{name}'; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[key]()


def _load_all() -> None:
    # Importing the modules registers their verifiers.
    from decode.verifiers import block, gbv, ot, traversal  # noqa: F401
