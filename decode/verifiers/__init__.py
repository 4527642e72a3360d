"""Lossless verifiers for drafted trees; see :func:`get_verifier`."""

from decode.verifiers.base import UnsupportedTreeError, Verifier, VerifyResult, get_verifier, verifier_names

__all__ = ["UnsupportedTreeError", "Verifier", "VerifyResult", "get_verifier", "verifier_names"]
