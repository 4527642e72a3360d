"""How a bench is shown: the figure's panels hold only what was benched at their temperature, AR and HF assisted
are reference lines, and the table and metrics use the names vLLM and Spec-Bench users know."""

from __future__ import annotations

from bench.display import bench_metrics, format_table, panels, plot
from bench.method import Method


def _row(method: str, temperature: float, rate: float, **extra) -> dict:
    return {"method": method, "temperature": temperature, "tokens_per_s": rate, "speedup": None,
            "tokens_per_s_stdev_over_prompts": 0.2 * rate, "block_efficiency": 2.0, "acceptance_rate": 0.5,
            "outside_forwards_share": 0.1, "tpot_ms": 1000 / rate, **extra}


ROWS = [_row("ar", 0.6, 10.0), _row("hf-assisted", 0.6, 12.0), _row("traversal@2,1,2", 0.6, 15.0),
        _row("ar", 1.0, 10.0), _row("traversal@2,1,2", 1.0, 14.0), _row("traversal@1,3,0", 1.0, 13.0)]


def test_each_panel_holds_only_its_own_bars_and_the_baselines_are_lines():
    (t1, bars1, refs1), (t2, bars2, refs2) = panels(ROWS)
    assert (t1, t2) == (0.6, 1.0)
    assert bars1 == [Method.parse("traversal@2,1,2")]  # (1,3,0) was benched at T = 1 only: no empty row here
    assert refs1 == {"ar": 10.0, "hf-assisted": 12.0} and refs2 == {"ar": 10.0}
    assert {m.key for m in bars2} == {"traversal@2,1,2", "traversal@1,3,0"}


def test_the_figure_is_written(tmp_path):
    plot(ROWS, tmp_path / "bench.png", "title")
    assert (tmp_path / "bench.png").stat().st_size > 1000 and not list(tmp_path.glob("*.tmp.png"))


def test_the_figure_is_written_in_the_format_its_name_says(tmp_path):
    """--plot takes .png, .svg and .pdf (ddte/commands/bench.py refuses other names): each in its own format."""
    for name, head in (("b.png", b"\x89PNG"), ("b.svg", b"<?xml"), ("b.PDF", b"%PDF")):
        plot(ROWS, tmp_path / name, "title")
        assert (tmp_path / name).read_bytes().startswith(head), name


def test_tpot_and_mean_acceptance_length_under_their_usual_names():
    header = format_table(ROWS).splitlines()[0]
    assert "| tokens/s | ± (prompts) | TPOT ms |" in header and "mean acceptance length" in header
    metrics = bench_metrics(ROWS)
    assert metrics["traversal_2-1-2/T0.6/tpot_ms"] == 1000 / 15.0
    assert metrics["traversal_2-1-2/T0.6/mean_acceptance_length"] == 2.0
