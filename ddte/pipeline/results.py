"""The pipeline's results.md: what to deploy and why, the honest head-room, and the offline figures (the table
``ddte pipeline`` prints and writes beside policy.json)."""

from __future__ import annotations

from pathlib import Path

from bench.compare import cross_fitted_choice_ratio
from bench.display import mean_acceptance_length
from bench.method import AR, Method, by_method, static_rows
from decode.drafting.actions import Action


def results_markdown(bench: dict, trained: dict, candidates: dict, kept: dict, choices: list,
                     timings: dict[str, float], data_dir: Path, parent_run: str = "") -> str:
    """The decision table (static candidates, selector and expander, measured), the head-room, and the offline
    figures.

    ``kept``: per (verifier, temperature), the kept static candidate's index and the reason (``keep_statics``).
    """

    rows = bench["rows"]
    lines = [*_preamble(bench, timings, data_dir, parent_run)]
    for choice in choices:
        lines.append(_decision_row(rows, choice, candidates[choice.verifier][choice.temperature],
                                   kept[choice.verifier, choice.temperature][0]))
    ar = {r["temperature"]: r["tokens_per_s"] for r in rows if Method.parse(r["method"]) == AR}
    if ar:
        lines += ["", "AR tokens/s: " + ", ".join(f"T={t:g}: {v:.1f}" for t, v in sorted(ar.items()))]
    lines += ["", *head_room_lines(data_dir, list(trained)), "",
              "Offline, on the data set's test prompts (the selector never saw their trees; the guard's margin was "
              "fitted on the validation prompts):"]
    for verifier, result in trained.items():
        m = result.metrics
        lines.append(
            f"- {verifier}: selector {m.get('ratio_vs_static', float('nan')):.3f}× best static, guarded "
            f"{m.get('guarded_ratio_vs_static', float('nan')):.3f}×; MLflow run {result.run_id}"
        )
    return "\n".join(lines)


def budget(settings: dict) -> str:
    """How many prompts the bench asked for: a count, or the most that fit a time budget."""
    if settings.get("minutes") is None:
        return f"{settings['num_prompts']} "
    return f"as many of {settings['num_prompts']} as fit in {settings['minutes']:g} minutes: "


def _preamble(bench: dict, timings: dict[str, float], data_dir: Path, parent_run: str) -> list[str]:
    """What was run and how to read the decision table, and the table's header."""
    rows = bench["rows"]
    settings = bench["settings"]["bench"]
    n_runs = len(rows[0]["per_prompt"]) if rows else 0
    return [
        f"Data set: {data_dir} · stage times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()),
        f"Bench: {budget(settings)}held-out prompts × {settings['repeats']} repeat(s) = {n_runs} runs per "
        f"method, {settings['max_new_tokens']} new tokens each, methods interleaved; ± is the std over runs; "
        f"speed-ups are vs AR (HF generate) in the same run. MLflow: parent run {parent_run}, bench run "
        f"{bench.get('mlflow_run_id', '-')}.",
        "",
        "Static candidates: the training split's best distinct trees, its choice first. The kept static is that "
        "choice unless a runner-up beat it beyond this bench's noise (see policy.json's reasons). Cross-fitted: the "
        "fastest row chosen on half of the prompts against the training split's choice on the other half (the "
        "in-sample fastest row is the maximum of noisy rates and reads high).",
        "",
        "| T | verifier | static candidates | kept static | tokens/s | vs AR | BE | fastest / training choice | "
        "cross-fitted | selector tokens/s | selector / kept static | selector policy share | expander tokens/s | "
        "expander / kept static | deploy |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]


def _decision_row(rows: list[dict], choice, actions: list, index: int) -> str:
    """One (verifier, temperature)'s row: its static candidates, the kept one (``actions[index]``), the selector's
    and the expander's measured rates against it, and what was deployed."""
    statics = static_rows(rows, choice.verifier, choice.temperature, actions)
    static = statics[index]
    fastest = max(row["tokens_per_s"] for row in statics)
    at_t = by_method(rows, choice.temperature).items()
    selector = next((r for m, r in at_t if m.kind == "selector" and m.verifier == choice.verifier), None)
    expander = next((r for m, r in at_t if m.kind == "expander" and m.verifier == choice.verifier), None)
    if selector is None:
        measured = "= fallback (its guard never leaves it here: not benched) | - | 0 %"
    else:
        measured = (f"{selector['tokens_per_s']:.1f} | {selector['tokens_per_s'] / static['tokens_per_s']:.3f} | "
                    f"{_fmt(selector.get('policy_share'), '.1%')}")
    measured += (" | - | -" if expander is None else
                 f" | {expander['tokens_per_s']:.1f} | {expander['tokens_per_s'] / static['tokens_per_s']:.3f}")
    deployed = {"static": f"({choice.action})", "selector": f"selector ({choice.selector})",
                "expander": f"expander ({choice.expander})"}[choice.policy]
    return (f"| {choice.temperature:g} | {choice.verifier} | {' '.join(f'({a})' for a in actions)} | "
            f"({actions[index]}) | {static['tokens_per_s']:.1f} ± "
            f"{_fmt(static.get('tokens_per_s_stdev_over_prompts'))} | {_fmt(static.get('speedup'), '.2f')}× | "
            f"{_fmt(mean_acceptance_length(static), '.2f')} | "
            f"{fastest / statics[0]['tokens_per_s']:.3f} | "
            f"{_fmt(cross_fitted_choice_ratio(statics), '.3f')} | {measured} | {deployed} |")


def head_room_lines(data_dir: Path, verifiers: list[str]) -> list[str]:
    """How much any per-root choice could win over the best static action on the collected data (honest figures)."""
    from data_gen.analyze import analyze, load_columns

    result = analyze(*load_columns(data_dir))
    lines = ["Head-room on the collected roots, vs the best static action (data_gen/headroom.py; the same-tree oracle "
             "chooses and scores on the same trees and is biased upward by label noise; the cross-fitted figures "
             "choose on half of each root's trees and score on the other half):", "",
             "| T | verifier | best static | same-tree oracle (biased) | cross-fitted oracle | "
             "cross-fitted per-prompt static |", "|---|---|---|---:|---:|---:|"]
    for entry in result["by_sampling"]:
        for verifier in verifiers:
            room = entry["head_room"][verifier]
            lines.append(f"| {entry['sampling']['temperature']:g} | {verifier} | "
                         f"{Action.parse(entry['best_static'][verifier]['action']).canonical()} | "
                         f"{room['same_tree_oracle']:.3f} | "
                         f"{_fmt(room['cross_fitted_oracle'], '.3f')} | "
                         f"{_fmt(room['cross_fitted_prompt_static'], '.3f')} |")
    return lines


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)
