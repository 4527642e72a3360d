"""The card's tables from a :func:`ddte.pair_card.card.measure` result, one small writer per section; a section the
result lacks (a pair that is no ``ddte train-pair`` folder has no training, held-out loss or calibration) is left
out. Results written before the card was one (``models/card.json``, ``models/smollm2-card.json``) read the same."""

from __future__ import annotations

from typing import Any

from distill.evaluate import PERCENTILES


def markdown(result: dict[str, Any]) -> str:
    """The card: the models, the loop's pass times, the kernel paths, acceptance and calibration."""
    sections = [model_lines(result), loop_lines(result), kernel_lines(result.get("kernels")),
                acceptance_lines(result), calibration_lines(result)]
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"


def model_lines(result: dict[str, Any]) -> list[str]:
    """Both models side by side: architecture, dtype, training, held-out loss, HF-forward pass times."""
    arch = result["architecture"]
    target, draft = arch["target"], arch["draft"]
    rows = ["| | target | draft | target / draft |", "|---|---|---|---|",
            "| layers × hidden (heads) | {layers} × {hidden} ({heads}) | ".format(**target)
            + "{layers} × {hidden} ({heads}) | |".format(**draft),
            f"| parameters | {target['parameters'] / 1e6:.2f} M | {draft['parameters'] / 1e6:.2f} M | "
            f"{target['parameters'] / draft['parameters']:.1f}× |"]
    if "dtype" in target:
        rows.append(f"| dtype | {target['dtype']} | {draft['dtype']} | |")
    train = result.get("training", {})
    if train.get("target", {}).get("tokens"):
        rows.append("| training tokens (wall) | {:.2f} M ({:.0f} s) | {:.2f} M ({:.0f} s) | |".format(
            train["target"]["tokens"] / 1e6, train["target"]["wall_s"], train["draft"]["tokens"] / 1e6,
            train["draft"]["wall_s"]))
    held, lat = result.get("heldout"), result.get("latency")
    if held:
        rows += [f"| held-out loss (nats/token) | {held['target']['loss']:.3f} | {held['draft']['loss']:.3f} | |",
                 f"| held-out perplexity | {held['target']['perplexity']:.2f} | {held['draft']['perplexity']:.2f} | |"]
    if lat:
        rows += [f"| HF forward, 1 token after a {lat['cache_len']}-token KV cache, ms | "
                 f"{lat['target']['one_token_ms']:.2f} | {lat['draft']['one_token_ms']:.2f} | "
                 f"{lat['ratio_one_token']:.1f}× |",
                 f"| HF forward, {lat['tree_nodes']}-token block (target: a tree, draft: a level), ms | "
                 f"{lat['target']['tree_ms']:.2f} | {lat['draft']['tree_ms']:.2f} | {lat['ratio_tree']:.1f}× |"]
    if held:
        rows += ["", f"Held-out: {held['blocks']} blocks of {held['seq_len']} tokens."]
    return rows


def loop_lines(result: dict[str, Any]) -> list[str]:
    """The pass times of the decoding loop and their ratios to a one-token target pass."""
    loop = result.get("loop_latency")
    if not loop:
        return []
    hf = result.get("latency", {})
    nodes, repeats = loop.get("tree_nodes", hf.get("tree_nodes")), loop.get("repeats", hf.get("repeats"))
    one = loop["target_one_token_ms"]
    where = ", ".join(str(part) for part in (f"{result['threads']} thread(s)", result.get("cpu")) if part)
    rows = [f"Pass times in the decoding loop after {loop['cache_len']} tokens (median of {repeats}, {where}, load "
            f"average {result['load_average_at_start']:.2f} at start):", "",
            "| pass | ms | / one-token target pass |", "|---|---:|---:|",
            f"| target, 1 token | {one:.2f} | 1 |",
            f"| target, {nodes}-token tree | {loop['target_tree_ms']:.2f} | {loop['target_tree_ms'] / one:.2f} |",
            f"| draft ({loop['draft_wrapper']}), 1 token, warm | {loop['draft_one_token_ms']:.3f} | "
            f"{loop['draft_one_token_ms'] / one:.3f} |"]
    level = loop.get("draft_tree_level_ms", loop.get("draft_tree_ms"))
    if level is not None:
        rows.append(f"| draft, {nodes}-token level | {level:.3f} | {level / one:.3f} |")
    if "draft_first_pass_ms" in loop:
        rows.append(f"| draft, a step's first pass (cache-cold) | {loop['draft_first_pass_ms']:.3f} | "
                    f"{loop['draft_first_pass_ms'] / one:.3f} |")
    return rows


def kernel_lines(kernels: dict | None) -> list[str]:
    """The kernel paths' pass times per block size (decode/models/kernel_choice.py) and which each model runs."""
    if not kernels or not kernels.get("times"):
        chosen = f"target {kernels['target']}, draft {kernels['draft']}" if kernels else "default"
        return [f"Kernel paths: {chosen} (given, not measured)."]
    lines = ["Kernel paths, ms per pass (median; blocks over a cache of the prefill's tokens; * = chosen):", ""]
    for role, times in kernels["times"].items():
        shapes = times["shapes"]
        lines += [f"| {role} path | " + " | ".join(f"{m} token{'s' if m > 1 else ''}" for m in shapes)
                  + f" | prefill {times['prefill_tokens']} | {max(shapes)} ÷ 1 |",
                  "|---|" + "---:|" * (len(shapes) + 2)]
        for path, ms in times["block_ms"].items():
            mark = "*" if path == kernels[role] else ""
            lines.append(f"| {path}{mark} | " + " | ".join(f"{v:.1f}" for v in ms)
                         + f" | {times['prefill_ms'][path]:.0f} | {ms[-1] / ms[0]:.2f} |")
        lines.append("")
    return lines[:-1]


def acceptance_by_group(result: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """``{group: {"0.6": figures, "1": figures}}`` from the ``acceptance_{group}_T{t}`` keys; a result written
    before the card had groups (``acceptance_T{t}``) holds the one group ``heldout``."""
    out: dict[str, dict[str, dict]] = {}
    for key, figures in result.items():
        if not key.startswith("acceptance_"):
            continue
        name = key[len("acceptance_"):]  # heldout_T1, like_T0.6; T1 in a result without groups
        group, grouped, t = name.rpartition("_T")
        out.setdefault(group if grouped else "heldout", {})[t if grouped else name[1:]] = figures
    return dict(sorted(out.items()))


def acceptance_lines(result: dict[str, Any]) -> list[str]:
    """Acceptance per prompt group at T = 0.6 and 1, then its spread at T = 1 (percentiles over contexts, the
    per-prompt means)."""
    groups = acceptance_by_group(result)
    if not groups:
        return []
    lines = ["| acceptance 1 − TV(p, q), held-out prompts | T = 0.6 | T = 1 |", "|---|---:|---:|"]
    for group, by_t in groups.items():
        shape = next(iter(by_t.values()))
        cells = [f"{by_t[t]['mean']:.3f} ± {by_t[t]['std']:.3f}" if t in by_t else "–" for t in ("0.6", "1")]
        lines.append(f"| {group} ({shape['prompts']} prompts × {shape['new_tokens_per_prompt']} tokens) | "
                     + " | ".join(cells) + " |")
    spread = {group: by_t["1"] for group, by_t in groups.items() if "percentiles" in by_t.get("1", {})}
    if spread:
        lines += ["", "| at T = 1 | contexts | " + " / ".join(f"p{k}" for k in PERCENTILES)
                  + " | per-prompt mean: min / max / std |", "|---|---:|---|---|"]
        for group, acc in spread.items():
            per_prompt = acc["per_prompt_mean"]
            lines.append(f"| {group} | {acc['contexts']} | "
                         + " / ".join(f"{acc['percentiles'][f'p{k}']:.2f}" for k in PERCENTILES)
                         + f" | {per_prompt['min']:.3f} / {per_prompt['max']:.3f} / {per_prompt['std']:.3f} |")
    return lines


def calibration_lines(result: dict[str, Any]) -> list[str]:
    """The draft's calibration at drafted-chain nodes, per temperature (a ``ddte train-pair`` folder's card)."""
    calibration = [result[k] for k in ("calibration_T1", "calibration_T0.6") if k in result]
    if not calibration:
        return []
    lines = ["| draft calibration at drafted-chain nodes | T = " + " | T = ".join(
        f"{c['temperature']:g}" for c in calibration) + " |", "|---|" + "---|" * len(calibration)]
    for key, label in (("nodes", "nodes"), ("mean_accept", "mean min(1, p/q) of the drawn token"),
                       ("corr_top_accept", "corr(top probability, min(1, p/q))"),
                       ("corr_top_beta", "corr(top probability, 1 − TV)"),
                       ("auc_top_accept", "AUC of top probability for acceptance")):
        lines.append(f"| {label} | " + " | ".join(
            str(c[key]) if key == "nodes" else f"{c[key]:.3f}" for c in calibration) + " |")
    return lines
