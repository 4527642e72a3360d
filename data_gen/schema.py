"""The data set contract shared by data_gen (writer) and selector (reader): files, columns and metadata keys.

One parquet row per root (docs/dataset.md). Feature names come from :mod:`decode.policies.features` and the action grid
from :mod:`decode.drafting.actions`; this module names the rest: the folder's files, the label columns and the schema
version.
"""

from __future__ import annotations

from decode.cost.throughput import ROOT_PLACEMENTS

SCHEMA_VERSION = 3  # 3: the trunk's draws; 2: per-tree labels and trunk acceptances (1: means over the trees only)
# a schema-1 folder still trains a selector (its cross-fitted figures are unavailable); a schema-2 one has no draws,
# so the signals that read them (decode/policies/signals.py) are left out of its fits
READABLE_VERSIONS = (1, 2, 3)
METADATA_FILE = "dataset.json"
SHARD_GLOB = "shard-*.parquet"
DEFAULT_VERIFIERS = ("nss", "naive", "specinfer", "spectr", "traversal", "gbv")


def label_column(verifier: str) -> str:
    """Column holding Ê[τ+1] per action for one verifier."""
    return f"be_{verifier}"


def trees_column(verifier: str) -> str:
    """Column holding Ê[τ+1] of every action on each of the s union trees: ``s·A`` floats, tree-major (schema 2)."""
    return f"be_trees_{verifier}"


TRUNK_COLUMNS = ("trunk_accept", "trunk_beta")  # s·2·L_max floats each, tree-major (schema 2)
# the draft's state at trunk depths 0..L_max of each tree (schema 2): hidden s·(L_max+1)·H_d, entropy and top
# probability s·(L_max+1) each, tree-major
TRUNK_STATE_COLUMNS = ("trunk_draft_hidden", "trunk_draft_entropy", "trunk_draft_top")
# the trunk's draws (schema 3): at depth d the token drawn from the law at depth d - 1, its q there, its rank there and
# that law's top probability (depth 0: 1, 0, 1); s·(L_max+1) each, tree-major
TRUNK_DRAW_COLUMNS = ("trunk_draw_q", "trunk_draw_rank", "trunk_draw_top")


def acceptance_column(verifier: str) -> str:
    """Column holding, per trunk depth d = 0..L_max, P(accept one of K_max draws at depth d) for a verifier."""
    return f"accept_{verifier}"


# dataset.json's "roots": where the collector put the roots (data_gen/collector.py), which sets how each one stands for
# a decoding stream (decode/cost/throughput.py, the owner of the names); a folder written before the key: positions


def roots_per_step(metadata: dict) -> bool:
    """Whether a data set's roots sample a reference loop's step starts (``"roots": "steps"``) rather than trajectory
    positions (``"positions"``, or no key); ValueError for any other value."""
    roots = metadata.get("roots", "positions")
    if roots not in ROOT_PLACEMENTS:
        raise ValueError(f"{METADATA_FILE}: roots must be one of {', '.join(ROOT_PLACEMENTS)}, not {roots!r}")
    return roots == "steps"
