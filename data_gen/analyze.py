"""Look at a collected data set: the paper's Figure-1 view and the best static actions.

  ddte analyze data/collect/default --output results/analyze

Prints, per sampling configuration: the mean ‖p − q‖₁ by trunk depth and each top-down verifier's acceptance
rate by depth (with K_max draws at that depth), then the best static action per verifier (highest throughput
Σ Ê[τ+1] / Σ T̂ over the data set's roots) with its block efficiency. Writes analysis.json and two PNG plots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from data_gen.schema import SHARD_GLOB, acceptance_column, label_column
from ddte.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", help="a folder written by ddte collect")
    parser.add_argument("--output", default=None, help="folder for analysis.json and plots (default: DATA/analysis)")


def load_columns(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The data set's metadata and its columns as numpy arrays (lists become 2-D arrays)."""
    from data_gen.store import read_metadata

    if not folder.is_dir():
        raise UserError(f"no data set folder at {folder}")
    shards = sorted(folder.glob(SHARD_GLOB))
    if not shards:
        raise UserError(f"{folder} holds no shards ({SHARD_GLOB})")
    try:
        metadata = read_metadata(folder)
    except ValueError as err:
        raise UserError(str(err)) from err
    import pyarrow.parquet as pq

    tables = [pq.read_table(s) for s in shards]
    columns = {}
    for name in tables[0].column_names:
        values = [v for t in tables for v in t.column(name).to_pylist()]
        columns[name] = np.array(values, dtype=object if name == "prompt_id" else np.float64)
    return metadata, columns


def static_throughput(be: np.ndarray, step_ms: np.ndarray) -> np.ndarray:
    """``(A,)`` stream throughput Σ be / Σ step_ms (tokens/ms) of each action used at every root ``(N, A)``;
    -inf for actions without a label on some root (a static shape must be usable at every step)."""
    valid = ~np.isnan(be).any(axis=0)
    return np.where(valid, np.nansum(be, axis=0) / step_ms.sum(axis=0), -np.inf)


def best_static(be: np.ndarray, step_ms: np.ndarray) -> tuple[int, float]:
    """Index and throughput (tokens/ms) of the best static action."""
    throughput = static_throughput(be, step_ms)
    best = int(np.argmax(throughput))
    return best, float(throughput[best])


def analyze(metadata: dict, columns: dict[str, np.ndarray]) -> dict:
    """Per sampling configuration: depth profiles and best static actions."""
    out = {"roots": int(len(columns["seed"])), "by_sampling": []}
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
        }
        for v in metadata["verifiers"]:
            if acceptance_column(v) in columns:
                entry["accept_by_depth"][v] = columns[acceptance_column(v)][rows].mean(0).round(4).tolist()
            be, step = columns[label_column(v)][rows], columns["step_ms"][rows]
            best, tput = best_static(be, step)
            entry["best_static"][v] = {
                "action": actions[best], "tokens_per_s": round(1000 * tput, 1),
                "block_efficiency": round(float(np.mean(be[:, best])), 3),
            }
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
        lines.append("\n| verifier | best static (K,L1,L2) | Ê[τ+1] | tokens/s (latency model) |")
        lines.append("|---|---|---|---|")
        for v, best in entry["best_static"].items():
            lines.append(f"| {v} | {best['action']} | {best['block_efficiency']:.2f} | {best['tokens_per_s']:.1f} |")
    return "\n".join(lines)


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


def run(args: argparse.Namespace) -> int:
    folder = Path(args.data)
    metadata, columns = load_columns(folder)
    result = analyze(metadata, columns)
    print(format_report(result))
    out = Path(args.output) if args.output else folder / "analysis"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "analysis.json").write_text(json.dumps(result, indent=1))
        paths = plot(result, out)
    except OSError as err:
        raise UserError(f"cannot write to {out} ({err.strerror or err})") from err
    print(f"\nwrote {out / 'analysis.json'} and {', '.join(str(p) for p in paths)}")
    return 0
