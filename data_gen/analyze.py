"""Look at a collected data set: the paper's Figure-1 view, the best static actions and the honest head-room.

Per sampling configuration: the mean ‖p − q‖₁ by trunk depth and each top-down verifier's acceptance rate by depth
(with K_max draws at that depth), then per verifier the best static action (highest stream throughput over the data
set's roots: decode/cost/throughput.py, reading the roots as the collection placed them, data_gen/schema.py
``roots_per_step``) with its block efficiency, and the head-room of data_gen/headroom.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_gen.headroom import head_room
from data_gen.schema import SHARD_GLOB, acceptance_column, label_column, roots_per_step, trees_column
from decode.cost.throughput import best_static, block_efficiency, per_root_best, stream_throughput


def data_set_shards(folder: Path) -> list[Path]:
    """The shards of a data set folder, cheaply (no column is read); ValueError for a file, a missing folder or a
    folder without shards."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a data set folder (the folder `ddte collect` wrote)")
    if not folder.is_dir():
        raise ValueError(f"no data set folder at {folder}")
    shards = sorted(folder.glob(SHARD_GLOB))
    if not shards:
        raise ValueError(f"{folder} holds no shards ({SHARD_GLOB})")
    return shards


def load_columns(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The data set's metadata and its columns as numpy arrays (lists become 2-D arrays)."""
    from data_gen.store import read_metadata

    shards = data_set_shards(folder)
    metadata = read_metadata(folder)
    import pyarrow as pa
    import pyarrow.compute as pc

    from data_gen.store import read_shards, shard_columns

    names = [n for n in shard_columns(shards[0]) if n not in SKIPPED]
    table = read_shards(shards, names)
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


def prompt_categories(metadata: dict) -> dict[str, str] | None:
    """Each prompt id's category where the collection's prompts came from a chat or mixed set (their records name
    one: code, math, writing, ...); None for any other source."""
    from data_gen.chat_prompts import build_chat_prompts, split_source
    from decode.pair_spec import read_pair_config, resolve_pair_path

    config = metadata.get("config") or {}
    prompts = config.get("prompts") or {}
    source = prompts.get("source")
    if source is None and config.get("pair"):
        try:
            source = read_pair_config(resolve_pair_path(config["pair"])).train_prompts
        except ValueError:  # the pair config is gone: no categories to report
            return None
    parsed = split_source(str(source)) if source else None
    if parsed is None:
        return None
    workload, chat_set = parsed
    records = build_chat_prompts(chat_set, count=prompts.get("limit"), workload=workload)
    return {str(i): record["category"] for i, record in enumerate(records)}


def analyze(metadata: dict, columns: dict[str, np.ndarray], trees: int | None = None,
            categories: dict[str, str] | None = None) -> dict:
    """Per sampling configuration: depth profiles, best static actions and the honest head-room.

    ``trees``: use only each root's first ``trees`` union trees (schema 2), as if the data set had been collected
    with that many: how the same-tree oracle's bias and the labels' noise shrink with ``trees_per_root``.
    ``categories``: each prompt id's category (:func:`prompt_categories`): then also, per category, its roots'
    mean 1 − TV at the root, its own best static tree and what that tree gains there over the overall best
    (same-tree, biased), and the cross-fitted per-category static overall.
    """
    out = {"roots": int(len(columns["seed"])), "by_sampling": [], "trees": trees or metadata.get("trees_per_root"),
           "root_placement": metadata.get("roots", "positions")}
    actions = metadata["actions"]
    steps = roots_per_step(metadata)
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
        groups = None if categories is None else np.array(
            [categories.get(str(p), "?") for p in columns["prompt_id"][rows]], dtype=object)
        if groups is not None:
            entry["by_category"] = {}
        for v in metadata["verifiers"]:
            if acceptance_column(v) in columns:
                entry["accept_by_depth"][v] = columns[acceptance_column(v)][rows].mean(0).round(4).tolist()
            be, step = columns[label_column(v)][rows], columns["step_ms"][rows]
            per_tree = per_tree_labels(metadata, columns, v)
            if per_tree is not None and trees is not None:
                per_tree = per_tree[:, :trees]
                be = per_tree[rows].mean(axis=1)
            room = head_room(None if per_tree is None else per_tree[rows], be, step, columns["prompt_id"][rows],
                             groups, steps)
            best = room.best_static
            throughput = stream_throughput(be, step, np.full(len(be), best), steps)
            entry["best_static"][v] = {
                "action": actions[best], "tokens_per_s": round(1000 * throughput, 1),
                "block_efficiency": round(block_efficiency(be[:, best], steps), 3),  # tokens per step in the loop
            }
            entry["head_room"][v] = room.as_dict()
            if groups is not None:
                beta = _root_beta(metadata, columns)
                entry["by_category"][v] = category_table(be, step, groups, best, actions,
                                                         None if beta is None else beta[rows], steps)
        out["by_sampling"].append(entry)
    return out


def _root_beta(metadata: dict, columns: dict[str, np.ndarray]) -> np.ndarray | None:
    """``(N,)`` 1 − TV(p, q) at each root (trunk depth 0), averaged over its trees; None without trunk columns."""
    if "trunk_beta" not in columns:
        return None
    per_tree = columns["trunk_beta"].reshape(len(columns["trunk_beta"]), int(metadata["trees_per_root"]), -1)
    return per_tree[:, :, 0].mean(axis=1)


def category_table(be: np.ndarray, step: np.ndarray, groups: np.ndarray, overall: int, actions: list[str],
                   beta: np.ndarray | None, per_step: bool = False) -> list[dict]:
    """Per category of ``groups`` ``(N,)``: roots, mean root 1 − TV, the category's own best static tree and its
    throughput there as a ratio to the overall best static tree ``overall`` (chosen and scored on the same roots:
    biased up, the cross-fitted per-category figure is in the head-room). ``per_step``: the roots sample a loop's
    steps (decode/cost/throughput.py)."""
    out = []
    for category in sorted(set(groups)):
        rows = groups == category
        own = best_static(be[rows], step[rows], per_step)
        ratio = stream_throughput(be[rows], step[rows], np.full(rows.sum(), own), per_step) / stream_throughput(
            be[rows], step[rows], np.full(rows.sum(), overall), per_step)
        out.append({"category": str(category), "roots": int(rows.sum()),
                    "root_beta": None if beta is None else round(float(beta[rows].mean()), 3),
                    "best_static": actions[own], "ratio_to_overall_static": round(float(ratio), 3)})
    return out


def format_report(result: dict) -> str:
    placed = ("a reference loop's step starts" if result.get("root_placement") == "steps"
              else "trajectory positions")
    lines = [f"{result['roots']} roots at {placed}"]
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
        for v, table in entry.get("by_category", {}).items():
            room = entry["head_room"][v]
            lines.append(f"\n{v} by category (cross-fitted per-category static overall: "
                         f"{_ratio(room.get('cross_fitted_group_static'))}):")
            lines.append("| category | roots | root 1 − TV | its best static | vs the overall best there (biased) |")
            lines.append("|---|---:|---:|---|---:|")
            for row in table:
                beta = "n/a" if row["root_beta"] is None else f"{row['root_beta']:.3f}"
                lines.append(f"| {row['category']} | {row['roots']} | {beta} | {_tree(row['best_static'])} | "
                             f"{row['ratio_to_overall_static']:.3f}× |")
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


def paper_findings(metadata: dict, columns: dict[str, np.ndarray]) -> list[dict]:
    """The paper's four findings, measured on this data set, per sampling configuration (each needs the verifiers it
    compares; a missing one leaves its entry out):

    1. Traversal's block efficiency against the OT verifiers' (SpecInfer, NSS) on the same static trees: the share of
       multi-path trees (K > 1, L2 > 0) where it is at least as high, and each verifier's best tree;
    2. acceptance and ‖p − q‖₁ by trunk depth (first against last depth);
    3. delayed trees (L1 >= 1) against root branching (L1 = 0) for the OT verifiers: per tree size L1 + K·L2 that
       both shapes reach, the best block efficiency of each, and the share of sizes the delayed tree wins;
    4. SpecInfer with a per-root choice against Traversal's best static tree under the data set's step times: the
       cross-fitted per-root oracle (chosen on one half of each root's trees, scored on the other), the ceiling of
       any SpecInfer selector.
    """
    from decode.drafting.actions import Action

    actions = [Action.parse(a) for a in metadata["actions"]]
    steps = roots_per_step(metadata)
    out = []
    for s, conf in enumerate(metadata["sampling"]):
        rows = columns["sampling_index"] == s
        if not rows.any():
            continue
        be = {v: columns[label_column(v)][rows] for v in metadata["verifiers"] if label_column(v) in columns}
        efficiency = {v: np.array([block_efficiency(b[:, a], steps) if np.isfinite(b[:, a]).all() else np.nan
                                   for a in range(len(actions))]) for v, b in be.items()}
        entry = {"sampling": conf}
        if "traversal" in efficiency:
            entry["traversal_vs_ot"] = _traversal_vs_ot(efficiency, actions, metadata["actions"])
        entry["depth"] = _depth_first_last(columns, rows, list(be))
        entry["delayed_vs_root"] = {v: _delayed_vs_root(efficiency[v], actions)
                                    for v in ("specinfer", "nss") if v in efficiency}
        oracle = _specinfer_oracle_vs_traversal(metadata, columns, rows)
        if oracle is not None:
            entry["specinfer_oracle_vs_traversal_static"] = oracle
        out.append(entry)
    return out


def _traversal_vs_ot(efficiency: dict[str, np.ndarray], actions: list, names: list[str]) -> dict:
    """Finding 1: per OT verifier, the share of multi-path trees where Traversal's block efficiency (each ``(A,)``)
    is at least as high, and each one's best tree."""
    multipath = np.array([a.k > 1 and a.l2 > 0 for a in actions])
    return {v: {"share_at_least": round(float(np.mean(efficiency["traversal"][multipath]
                                                      >= efficiency[v][multipath] - 1e-9)), 3),
                "best": {name: (names[int(np.nanargmax(efficiency[name]))],
                                round(float(np.nanmax(efficiency[name])), 3)) for name in (v, "traversal")}}
            for v in ("specinfer", "nss") if v in efficiency}


def _depth_first_last(columns: dict[str, np.ndarray], rows: np.ndarray, verifiers: list[str]) -> dict:
    """Finding 2: ‖p − q‖₁ and each verifier's acceptance at the first and the last trunk depth."""
    depth = {"l1_first_last": [round(float(x), 3) for x in columns["l1_by_depth"][rows].mean(0)[[0, -1]]]}
    for v in verifiers:
        if acceptance_column(v) in columns:
            depth[f"accept_{v}_first_last"] = [
                round(float(x), 3) for x in columns[acceptance_column(v)][rows].mean(0)[[0, -1]]]
    return depth


def _delayed_vs_root(efficiency: np.ndarray, actions: list) -> dict:
    """Finding 3 for one verifier: per tree size L1 + K·L2 both shapes reach, the best block efficiency (of ``(A,)``)
    of a delayed tree and of root branching, and the share of sizes the delayed tree wins."""
    wins, sizes = 0, []
    for size in sorted({a.l1 + a.k * a.l2 for a in actions if a.k > 1 and a.l2 > 0}):
        delayed = [efficiency[i] for i, a in enumerate(actions)
                   if a.k > 1 and a.l2 > 0 and a.l1 >= 1 and a.l1 + a.k * a.l2 == size]
        rooted = [efficiency[i] for i, a in enumerate(actions)
                  if a.k > 1 and a.l2 > 0 and a.l1 == 0 and a.k * a.l2 == size]
        if delayed and rooted and np.isfinite(delayed).any() and np.isfinite(rooted).any():
            sizes.append((size, round(float(np.nanmax(delayed)), 3), round(float(np.nanmax(rooted)), 3)))
            wins += np.nanmax(delayed) > np.nanmax(rooted)
    return {"sizes": sizes, "share_delayed_wins": round(wins / max(len(sizes), 1), 3)}


def _specinfer_oracle_vs_traversal(metadata: dict, columns: dict[str, np.ndarray], rows: np.ndarray) -> float | None:
    """Finding 4: SpecInfer's cross-fitted per-root oracle against Traversal's best static tree, chosen on one half
    of each root's trees and scored on the other; None without two per-tree labels of each."""
    per_tree = {v: per_tree_labels(metadata, columns, v) for v in ("specinfer", "traversal")}
    if not all(t is not None and t.shape[1] >= 2 for t in per_tree.values()):
        return None
    step, steps = columns["step_ms"][rows], roots_per_step(metadata)
    spec, trav = per_tree["specinfer"][rows], per_tree["traversal"][rows]
    half = spec.shape[1] // 2
    ratios = []
    for choose, score in ((slice(0, half), slice(half, 2 * half)), (slice(half, 2 * half), slice(0, half))):
        chosen = per_root_best(spec[:, choose].mean(axis=1), step, steps)
        static = np.full(len(step), best_static(trav[:, choose].mean(axis=1), step, steps))
        ratios.append(stream_throughput(spec[:, score].mean(axis=1), step, chosen, steps)
                      / stream_throughput(trav[:, score].mean(axis=1), step, static, steps))
    return round(float(np.mean(ratios)), 3)


def format_findings(findings: list[dict]) -> str:
    """The four findings as short lines per sampling configuration."""
    lines = ["\n## The paper's four findings on this data set"]
    for entry in findings:
        conf = entry["sampling"]
        lines.append(f"\nT = {conf['temperature']}, top-p = {conf['top_p']}:")
        for v, f in entry.get("traversal_vs_ot", {}).items():
            (ot_tree, ot_be), (tr_tree, tr_be) = f["best"][v], f["best"]["traversal"]
            lines.append(f"1. Traversal >= {v} in block efficiency on {100 * f['share_at_least']:.0f} % of multi-path "
                         f"trees; best trees: {v} {_tree(ot_tree)} {ot_be:.2f}, traversal {_tree(tr_tree)} "
                         f"{tr_be:.2f} tokens/step")
        depth = entry["depth"]
        parts = [f"‖p−q‖₁ {depth['l1_first_last'][0]:.2f} → {depth['l1_first_last'][1]:.2f}"] + [
            f"{k.removeprefix('accept_').removesuffix('_first_last')} acceptance {a:.2f} → {b:.2f}"
            for k, (a, b) in depth.items() if k.startswith("accept_")]
        lines.append("2. first → last trunk depth: " + "; ".join(parts))
        for v, f in entry.get("delayed_vs_root", {}).items():
            shown = ", ".join(f"{n}: {d:.2f} vs {r:.2f}" for n, d, r in f["sizes"][:6])
            lines.append(f"3. {v}: delayed beats root branching at {100 * f['share_delayed_wins']:.0f} % of tree sizes "
                         f"(size: delayed vs root, tokens/step: {shown})")
        if "specinfer_oracle_vs_traversal_static" in entry:
            lines.append(f"4. SpecInfer's cross-fitted per-root oracle / Traversal's best static tree: "
                         f"{entry['specinfer_oracle_vs_traversal_static']:.3f}× (the ceiling of a SpecInfer selector)")
    return "\n".join(lines)
