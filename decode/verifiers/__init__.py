"""Lossless verifiers for drafted trees, by name: :func:`get_verifier`, :data:`VERIFIERS`.

Importing this package is cheap: the registry names every verifier without importing one (``--help`` texts and
argument checks need the names, not torch). The interface types are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddte_core.registry import Registry

if TYPE_CHECKING:
    from decode.verifiers.base import Verifier

VERIFIERS = Registry(
    "verifier",
    {
        "nss": "decode.verifiers.ot:NSSVerifier",
        "naive": "decode.verifiers.ot:NaiveTreeVerifier",
        "specinfer": "decode.verifiers.ot:SpecInferVerifier",
        "spectr": "decode.verifiers.ot:SpecTrVerifier",
        "rsd": "decode.verifiers.ot:RSDVerifier",
        "block": "decode.verifiers.block:BlockVerifier",
        "traversal": "decode.verifiers.traversal:TraversalVerifier",
        "gbv": "decode.verifiers.gbv:GreedyBlockVerifier",
    },
)


def verifier_names() -> list[str]:
    """Names of all registered verifiers."""
    return VERIFIERS.names()


def get_verifier(name: str) -> Verifier:
    """A verifier instance by name (case-insensitive); raises KeyError listing the known names."""
    return VERIFIERS.get(name)()


_LAZY = {"UnsupportedTreeError", "Verifier", "VerifyResult", "LabelRule"}


def __getattr__(name: str):
    if name in _LAZY:
        from decode.verifiers import base

        return getattr(base, name)
    raise AttributeError(f"module 'decode.verifiers' has no attribute {name!r}")


__all__ = ["VERIFIERS", "LabelRule", "UnsupportedTreeError", "Verifier", "VerifyResult", "get_verifier",
           "verifier_names"]
