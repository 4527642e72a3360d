"""Look at a collected data set: the paper's Figure-1 view, the best static actions and the honest head-room.

Per sampling configuration: the mean ‖p − q‖₁ by trunk depth and each top-down verifier's acceptance rate by depth
(with K_max draws at that depth), then per verifier the best static action (highest throughput Σ Ê[τ+1] / Σ T̂
over the data set's roots) with its block efficiency, and the head-room of data_gen/headroom.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_gen.headroom import head_room
from data_gen.schema import SHARD_GLOB, acceptance_column, label_column, trees_column
from data_gen.throughput import harmonic_block_efficiency, stream_throughput


def load_columns(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The data set's metadata and its columns as numpy arrays (lists become 2-D arrays)."""
    from data_gen.store import read_metadata

    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a data set folder (the folder `ddte collect` wrote)")
    if not folder.is_dir():
        raise ValueError(f"no data set folder at {folder}")
    shards = sorted(folder.glob(SHARD_GLOB))
    if not shards:
        raise ValueError(f"{folder} holds no shards ({SHARD_GLOB})")
    metadata = read_metadata(folder)
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    names = [n for n in pq.read_schema(shards[0]).names if n not in SKIPPED]
    table = pa.concat_tables([pq.read_table(s, columns=names) for s in shards])
    columns = {}
    for name in names:
        column = table.column(name).combine_chunks()
        if name == "prompt_id":
            columns[name] = np.array(column.to_pylist(), dtype=object)
        elif pa.types.is_list(column.type):  # fixed-length lists -> (N, width)
            flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float64)
            columns[name] = flat.reshape(len(column), -1) if len(column) else flat.reshape(0, 0)
        else:
            columns[name] = column.to_numpy(zero_copy_only=False).astype(np.float64)
    return metadata, columns


SKIPPED = ("trunk_draft_hidden",)  # per-node hidden states: large, and nothing here reads them


def per_tree_labels(metadata: dict, columns: dict[str, np.ndarray], verifier: str) -> np.ndarray | None:
    """``(N, s, A)`` per-tree labels of a schema-2 data set, None for schema 1."""
    name = trees_column(verifier)
    if name not in columns:
        return None
    return columns[name].reshape(len(columns[name]), int(metadata["trees_per_root"]), len(metadata["actions"]))


def analyze(metadata: dict, columns: dict[str, np.ndarray], trees: int | None = None) -> dict:
    """Per sampling configuration: depth profiles, best static actions and the honest head-room.

    ``trees``: use only each root's first ``trees`` union trees (schema 2), as if the data set had been collected
    with that many: how the same-tree oracle's bias and the labels' noise shrink with ``trees_per_root``.
    """
    out = {"roots": int(len(columns["seed"])), "by_sampling": [], "trees": trees or metadata.get("trees_per_root")}
    actions = metadata["actions"]
    for s, conf in enumerate(metadata["sampling"]):
        rows = columns["sampling_index"] == s
        if not rows.any():
            continue
        entry = {
            "sampling": conf,
            "roots": int(rows.sum()),
            "l1_by_depth": columns["l1_by_depth"][rows].mean(0).round(4).tolist(),
            "accept_by_depth": {},
            "best_static": {},
            "head_room": {},
        }
        for v in metadata["verifiers"]:
            if acceptance_column(v) in columns:
                entry["accept_by_depth"][v] = columns[acceptance_column(v)][rows].mean(0).round(4).tolist()
            be, step = columns[label_column(v)][rows], columns["step_ms"][rows]
            per_tree = per_tree_labels(metadata, columns, v)
            if per_tree is not None and trees is not None:
                per_tree = per_tree[:, :trees]
                be = per_tree[rows].mean(axis=1)
            room = head_room(None if per_tree is None else per_tree[rows], be, step, columns["prompt_id"][rows])
            best = room.best_static
            throughput = stream_throughput(be, step, np.full(len(be), best))
            entry["best_static"][v] = {
                "action": actions[best], "tokens_per_s": round(1000 * throughput, 1),
                "block_efficiency": round(harmonic_block_efficiency(be[:, best]), 3),  # tokens per step in the loop
            }
            entry["head_room"][v] = room.as_dict()
        out["by_sampling"].append(entry)
    return out


def format_report(result: dict) -> str:
    lines = [f"{result['roots']} roots"]
    for entry in result["by_sampling"]:
        conf = entry["sampling"]
        lines.append(f"\n## T = {conf['temperature']}, top-p = {conf['top_p']} ({entry['roots']} roots)")
        depths = len(entry["l1_by_depth"])
        lines.append("| depth | " + " | ".join(str(d) for d in range(depths)) + " |")
        lines.append("|---" * (depths + 1) + "|")
        lines.append("| ‖p−q‖₁ | " + " | ".join(f"{x:.2f}" for x in entry["l1_by_depth"]) + " |")
        for v, acc in entry["accept_by_depth"].items():
            lines.append(f"| accept {v} | " + " | ".join(f"{x:.2f}" for x in acc) + " |")
        lines.append("\n| verifier | best static (K,L1,L2) | Ê[τ+1] | tokens/s (latency model) | same-tree oracle "
                     "(biased) | cross-fitted oracle | cross-fitted per-prompt static |")
        lines.append("|---|---|---|---|---|---|---|")
        for v, best in entry["best_static"].items():
            room = entry["head_room"][v]
            lines.append(f"| {v} | {_tree(best['action'])} | {best['block_efficiency']:.2f} | "
                         f"{best['tokens_per_s']:.1f} | "
                         f"{room['same_tree_oracle']:.3f}× | {_ratio(room['cross_fitted_oracle'])} | "
                         f"{_ratio(room['cross_fitted_prompt_static'])} |")
    lines.append("\nHead-room columns are per-root (or per-prompt) choices as a ratio to the best static action. The "
                 "same-tree oracle chooses and scores on the same trees, so label noise inflates it; the cross-fitted "
                 "figures choose on one half of each root's trees and score on the other, both ways, averaged.")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "n/a (needs 2+ trees per root)" if value is None else f"{value:.3f}×"


def _tree(key: str) -> str:
    """An action as the tree it drafts: (1,0,7) and (1,7,0) are one path of 7 and print the same, (1,7,0)."""
    from decode.drafting.actions import Action

    return str(Action.parse(key).canonical())


def plot(result: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for entry in result["by_sampling"]:
        label = f"T={entry['sampling']['temperature']}, p={entry['sampling']['top_p']}"
        axes[0].plot(entry["l1_by_depth"], marker="o", label=label)
        for v, acc in entry["accept_by_depth"].items():
            axes[1].plot(acc, marker=".", label=f"{v} ({label})")
    axes[0].set(title="‖p − q‖₁ by trunk depth", xlabel="depth", ylabel="L1 distance")
    axes[1].set(title="acceptance at the branching node (K_max draws)", xlabel="depth", ylabel="P(accept)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(folder / "depth_profile.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    verifiers = list(result["by_sampling"][0]["best_static"]) if result["by_sampling"] else []
    width = 0.8 / max(1, len(result["by_sampling"]))
    for i, entry in enumerate(result["by_sampling"]):
        values = [entry["best_static"][v]["tokens_per_s"] for v in verifiers]
        ax.bar(np.arange(len(verifiers)) + i * width, values, width, label=f"T={entry['sampling']['temperature']}")
    ax.set_xticks(np.arange(len(verifiers)) + width * (len(result["by_sampling"]) - 1) / 2, verifiers)
    ax.set(title="best static action per verifier", ylabel="tokens/s (latency model)")
    ax.legend()
    fig.tight_layout()
    paths.append(folder / "best_static.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
