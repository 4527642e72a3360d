"""Look at a collected data set: the paper's Figure-1 view, the best static actions and the honest head-room.

Prints, per sampling configuration: the mean ‖p − q‖₁ by trunk depth and each top-down verifier's acceptance
rate by depth (with K_max draws at that depth), then per verifier the best static action (highest throughput
Σ Ê[τ+1] / Σ T̂ over the roots) with its block efficiency. Writes analysis.json and PNG plots.

With --expansion it also measures expansion decided while drafting (selector/expander/expansion.py): per-node threshold
rules on the draft's confidence, a learned per-node acceptance head, a rule that knows each node's exact β, a
root-time selector (--selector) and the per-tree oracle, all cross-fitted by prompt, as ratios to the best static
action.

Examples:
  ddte analyze --data data/collect/default --output results/analyze
  ddte analyze --data data/collect/default --expansion --selector specinfer=models/selectors/specinfer.onnx
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddte.commands.common import UserError, user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=None, help="a folder written by ddte collect")
    parser.add_argument("--output", default=None, help="folder for analysis.json and plots (default: DATA/analysis)")
    parser.add_argument("--trees", type=int, default=None,
                        help="use only each root's first N union trees, as if collected with trees_per_root=N")
    parser.add_argument("--expansion", action="store_true",
                        help="also measure per-node expansion rules offline (needs trunk states: schema 2)")
    parser.add_argument("--selector", action="append", default=[], metavar="VERIFIER=FILE.onnx",
                        help="a root-time selector to compare with (repeatable)")
    parser.add_argument("--folds", type=int, default=5, help="prompt folds of the cross-fitting (--expansion)")
    parser.add_argument("--acceptance", default=None, metavar="FILE.onnx",
                        help="an acceptance model (ddte acceptance) trained on other prompts: adds the rules on its "
                             "β̂ and the marginal rule on it to the expansion table (--expansion)")


def run(args: argparse.Namespace) -> int:
    from data_gen.analyze import analyze, format_findings, format_report, load_columns, paper_findings, plot

    folder, out = check_places(args)
    selectors = check_options(args, folder)
    with user_errors():
        metadata, columns = load_columns(folder)
    categories = check_counts(args, metadata, columns)
    result = analyze(metadata, columns, args.trees, categories)
    result["findings"] = paper_findings(metadata, columns)
    expansion = None
    if args.expansion:  # before anything is written: a selector it cannot read leaves no half of the analysis
        with user_errors():
            expansion = expansion_report(folder, metadata, selectors, args.folds, args.acceptance, categories)
    print(format_report(result))
    print(format_findings(result["findings"]))
    if expansion is not None:
        print("\n" + expansion[0])
    with user_errors(OSError, prefix=f"cannot write to {out}: "):
        out.mkdir(parents=True, exist_ok=True)
        (out / "analysis.json").write_text(json.dumps(result, indent=1))
        paths = plot(result, out)
        if expansion is not None:
            (out / "expansion.json").write_text(json.dumps(expansion[1], indent=1))
            paths.append(out / "expansion.json")
    print(f"\nwrote {out / 'analysis.json'} and {', '.join(str(p) for p in paths)}")
    return 0


def check_places(args: argparse.Namespace) -> tuple[Path, Path]:
    """(data folder, output folder), refused before any work: --data that is no data set folder (blamed on --data,
    also where --output defaults under it), an --output under a file or where nothing can be written."""
    from data_gen.analyze import data_set_shards
    from ddte_core.paths import folder_is_writable, refuse_file_in_the_way

    if args.data is None:
        raise UserError("give --data DIR (a folder written by ddte collect)")
    folder = Path(args.data)
    with user_errors(prefix="--data: "):
        data_set_shards(folder)
    out = Path(args.output) if args.output else folder / "analysis"
    with user_errors(prefix="--output: "):
        refuse_file_in_the_way(out)  # the analysis would be lost at the end
    if not folder_is_writable(out):
        raise UserError(f"--output {out}: nothing can be written there")
    return folder, out


def check_options(args: argparse.Namespace, folder: Path) -> dict[str, str]:
    """The --selector files by verifier, each checked against the data set as the decoder checks it (its pair,
    hidden sizes and verifier), and the expansion options, before any work."""
    from data_gen.store import read_metadata
    from selector.expander.expansion import checked_root_selector

    if (args.selector or args.acceptance) and not args.expansion:
        raise UserError("--selector and --acceptance score policies in the expansion table: give --expansion as well")
    if not args.expansion:
        return {}
    if args.folds < 2:
        raise UserError("--folds must be >= 2")
    if any("=" not in item for item in args.selector):
        raise UserError("--selector takes VERIFIER=FILE.onnx")
    selectors = dict(item.split("=", 1) for item in args.selector)
    if selectors:
        with user_errors():
            metadata = read_metadata(folder)
            for verifier, path in selectors.items():
                checked_root_selector(path, metadata, verifier)
    return selectors


def check_counts(args: argparse.Namespace, metadata: dict, columns: dict) -> dict[str, str] | None:
    """The prompt categories, once --folds and --trees are known to fit the data set."""
    from data_gen.analyze import prompt_categories

    prompts = len(set(columns["prompt_id"].tolist()))
    if args.expansion and args.folds > prompts:
        raise UserError(f"--folds {args.folds}: the data set holds {prompts} prompts; at most that many folds")
    if args.trees is not None and not 1 <= args.trees <= int(metadata.get("trees_per_root", 1)):
        raise UserError(f"--trees must be in 1..{metadata.get('trees_per_root', 1)} (the data set's trees per root)")
    with user_errors():
        return prompt_categories(metadata)


def expansion_report(folder: Path, metadata: dict, selectors: dict[str, str], folds: int,
                     acceptance: str | None = None, categories: dict[str, str] | None = None) -> tuple[str, dict]:
    """The per-node expansion table (markdown) for the verifiers with a root-time selector, or all verifiers; with
    ``acceptance``, the rules on an acceptance model's β̂ and the marginal rule on it as well; with ``categories``
    (prompt id → category), a table per category and the share of episodes each rule takes off the static tree."""
    import numpy as np

    from selector.expander.expander import AcceptanceFile
    from selector.expander.expansion import evaluate_expansion, load_episodes, selector_root_choices

    verifiers = list(selectors) or list(metadata["verifiers"])
    extra_names = ["acceptance", "marginal"] if acceptance else []
    result, model, rows_text, signals = {}, None, [], None
    for verifier in verifiers:
        _, episodes, rows = load_episodes(folder, verifier)
        signals = signals or list(next(iter(episodes.values())).node_signals())  # the registry's, as stored
        if acceptance and model is None:
            prompts = {str(p) for data in episodes.values() for p in data.prompts.tolist()}
            model = AcceptanceFile(acceptance, metadata["pair"]["fingerprint"],
                                   int(metadata["hidden_sizes"]["draft_hidden_root"]), prompts)
        choices = selector_root_choices(selectors[verifier], folder, verifier) if verifier in selectors else None
        for c, data in episodes.items():
            root = None if choices is None else choices[rows[c]]
            temperature = metadata["sampling"][c]["temperature"]
            extra = model.signals(data, float(temperature)) if model else None
            groups = None if categories is None else np.array([categories.get(str(p), "?") for p in data.prompts])
            r = evaluate_expansion(data, metadata["l_max"], metadata["k_max"], folds, root, extra, groups)
            result[f"{verifier}/T{temperature:g}"] = r
            root_text = ("-" if root is None or not r["root_time_roots"]
                         else f"{r['root_time']:.3f} ({r['root_time_roots']} roots)")
            rows_text.append(f"| {temperature:g} | {verifier} | 1.000 | {root_text} | "
                             + "".join(f"{r[name]:.3f} | " for name in (*signals, "learned", *extra_names))
                             + f"{r['beta']:.3f} | {r['oracle']:.3f} | {r['corr_with_beta']['top']:.2f} | "
                             f"{r['corr_with_beta']['learned']:.2f} |"
                             + (f" {r['corr_with_beta']['acceptance']:.2f} |" if acceptance else ""))
    lines = ["| T | verifier | best static | root-time selector | "
             + "".join(f"{name} rule | " for name in (*signals, "learned per-node", *extra_names))
             + "exact-β rule (oracle) | per-tree oracle (hindsight) | corr(top, β) | corr(learned, β) |"
             + (" corr(acceptance, β) |" if acceptance else ""),
             "|---|---|" + "---:|" * (7 + len(signals) + len(extra_names) + bool(acceptance)), *rows_text]
    rules = [*signals, "learned", *extra_names, "beta"]
    lines += ["", "Share of episodes each rule drafts another tree than the static one on: "
              + "; ".join(f"{key}: " + ", ".join(f"{name} {r['leaves_static'][name]:.0%}" for name in rules)
                          for key, r in result.items())]
    if categories is not None:
        lines += ["", "| verifier/T | category | roots | " + " | ".join(rules) + " |",
                  "|---|---|---:|" + "---:|" * len(rules)]
        for key, r in result.items():
            for category, g in r["by_group"].items():
                lines.append(f"| {key} | {category} | {g['roots']:.0f} | "
                             + " | ".join(f"{g[name]:.3f}" for name in rules) + " |")
    if selectors:
        lines += ["", "The root-time selector is scored only on the roots of prompts it was not fitted on (its "
                  "`fit_prompts`), against the best static action on the same roots."]
    return "\n".join(lines), result
