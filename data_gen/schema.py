"""The data set contract shared by data_gen (writer) and selector (reader): columns, action order, metadata.

One parquet row per root. The action list, its order and every name below are part of the data set's
metadata (``dataset.json`` beside the shards) and of the exported selector's metadata. See docs/dataset.md.
"""

from __future__ import annotations

from decode.drafting import Action
from decode.features import SCALAR_NAMES

SCHEMA_VERSION = 1
METADATA_FILE = "dataset.json"
SHARD_GLOB = "shard-*.parquet"
HIDDEN_COLUMNS = ("target_hidden_prev", "draft_hidden_prev", "draft_hidden_root")
DEFAULT_VERIFIERS = ("nss", "naive", "specinfer", "spectr", "traversal", "gbv")


def action_grid(k_max: int = 4, l_max: int = 8) -> list[Action]:
    """Every (K, L1, L2) with K in 1..k_max and L1, L2 in 0..l_max, K outermost, then L1, then L2."""
    return [Action(k, l1, l2) for k in range(1, k_max + 1) for l1 in range(l_max + 1) for l2 in range(l_max + 1)]


def action_key(action: Action) -> str:
    """'K,L1,L2', the form actions take in metadata and on the command line."""
    return f"{action.k},{action.l1},{action.l2}"


def label_column(verifier: str) -> str:
    """Column holding Ê[τ+1] per action for one verifier."""
    return f"be_{verifier}"


def acceptance_column(verifier: str) -> str:
    """Column holding, per trunk depth d = 0..L_max, P(accept one of K_max draws at depth d) for a verifier."""
    return f"accept_{verifier}"


__all__ = ["SCALAR_NAMES", "action_grid", "action_key", "label_column", "acceptance_column"]
