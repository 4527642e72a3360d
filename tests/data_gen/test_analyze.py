"""`ddte analyze`'s report: one spelling per tree, and a missing figure says what it needs."""

from __future__ import annotations

import re

from ddte.cli import main
from decode.drafting.actions import Action


def test_the_report_spells_each_tree_one_way_and_says_what_a_missing_figure_needs(tiny_collected, tmp_path, capsys):
    assert main(["analyze", "--data", str(tiny_collected), "--output", str(tmp_path), "--trees", "1"]) == 0
    report = capsys.readouterr().out
    trees = re.findall(r"^\| (?:specinfer|traversal|gbv) \| \((\d+),(\d+),(\d+)\) \|", report, flags=re.M)
    assert trees
    for k, l1, l2 in trees:  # (1,0,7) and (1,7,0) are one path: always printed (1,7,0)
        action = Action(int(k), int(l1), int(l2))
        assert action == action.canonical()
    assert "n/a (needs 2+ trees per root)" in report and "schema 1" not in report


def test_the_four_findings_are_measured_per_sampling_configuration(tiny_collected):
    from data_gen.analyze import format_findings, load_columns, paper_findings

    metadata, columns = load_columns(tiny_collected)
    findings = paper_findings(metadata, columns)
    assert [f["sampling"] for f in findings] == metadata["sampling"]
    for entry in findings:
        assert 0.0 <= entry["traversal_vs_ot"]["specinfer"]["share_at_least"] <= 1.0
        assert len(entry["depth"]["l1_first_last"]) == 2
        sizes = entry["delayed_vs_root"]["specinfer"]["sizes"]
        assert sizes and all(d >= 1.0 and r >= 1.0 for _, d, r in sizes)  # tokens per step
        assert entry["specinfer_oracle_vs_traversal_static"] > 0
    text = format_findings(findings)
    assert text.count("1. Traversal >=") == len(findings) and "4. SpecInfer's cross-fitted" in text


def test_a_steps_collection_is_analysed_with_the_step_estimator(tiny_collected):
    """The same labels read as step roots: the best static tree maximises Σ Ê / Σ T̂ and its block efficiency is the
    plain mean of Ê (decode/cost/throughput.py), where position roots give the harmonic mean."""
    import numpy as np

    from data_gen.analyze import analyze, format_report, load_columns
    from data_gen.schema import label_column
    from decode.cost.throughput import block_efficiency, static_throughputs

    metadata, columns = load_columns(tiny_collected)
    assert "roots" not in metadata or metadata["roots"] == "positions"
    by_placement = {roots: analyze(metadata | {"roots": roots}, columns) for roots in ("positions", "steps")}
    for roots, result in by_placement.items():
        steps = roots == "steps"
        assert result["root_placement"] == roots
        assert ("step starts" in format_report(result).splitlines()[0]) == steps
        for s, entry in enumerate(result["by_sampling"]):
            rows = columns["sampling_index"] == s
            for verifier, best in entry["best_static"].items():
                be, step = columns[label_column(verifier)][rows], columns["step_ms"][rows]
                index = metadata["actions"].index(best["action"])
                assert index == int(np.argmax(static_throughputs(be, step, steps)))
                assert best["block_efficiency"] == round(block_efficiency(be[:, index], steps), 3)
                assert entry["head_room"][verifier]["same_tree_oracle"] >= 1.0 - 1e-9
    assert by_placement["steps"] != by_placement["positions"]
