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
