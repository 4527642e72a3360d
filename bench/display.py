"""How a decoding bench's rows are shown: the markdown table, the figure (one panel per temperature), and the flat
metrics logged to MLflow."""

from __future__ import annotations

from pathlib import Path

from bench.method import Method, by_method
from ddte_core.paths import staged_file


def mean_acceptance_length(row: dict) -> float | None:
    """A row's tokens per target pass; rows written before the key was the only one read as their
    ``block_efficiency``."""
    return row.get("mean_acceptance_length", row.get("block_efficiency"))


# one colour per verifier (and the two HF baselines), the same in every figure
COLOURS = {
    "ar": "#7f7f7f", "hf-assisted": "#bcbd22", "traversal": "#1f77b4", "specinfer": "#d62728", "spectr": "#ff7f0e",
    "nss": "#9467bd", "naive": "#8c564b", "rsd": "#e377c2", "block": "#17becf", "gbv": "#2ca02c",
}


def format_table(rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    # TPOT and mean acceptance length are vLLM's names (Spec-Bench's "mean accepted tokens" τ): block efficiency
    lines = [
        "| T | method | tokens/s | ± (prompts) | TPOT ms | speedup vs ar | mean acceptance length | acceptance rate "
        "| outside forwards | selector call µs | policy share |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('temperature', '-')} | {r['method']} | {r['tokens_per_s']:.1f} | "
            f"{num(r.get('tokens_per_s_stdev_over_prompts'), '.1f')} | {num(r.get('tpot_ms'), '.1f')} | "
            f"{num(r['speedup'], '.2f')}× | "
            f"{num(mean_acceptance_length(r), '.2f')} | {num(r['acceptance_rate'], '.2f')} | "
            f"{num(r['outside_forwards_share'], '.0%')} | {num(r.get('selector_call_us_median'), '.1f')} | "
            f"{num(r.get('policy_share'), '.1%')} |"
        )
    return "\n".join(lines)


def format_category_table(rows: list[dict]) -> str:
    """Per category rows (:func:`bench.decoding.category_rows`) as a markdown table."""
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = ["| T | category | prompts | method | tokens/s | TPOT ms | speedup vs ar | mean acceptance length |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["temperature"], r["category"])):
        lines.append(f"| {r['temperature']} | {r['category']} | {r['prompts']} | {r['method']} | "
                     f"{r['tokens_per_s']:.2f} | {num(r['tpot_ms'], '.1f')} | {num(r.get('speedup'), '.2f')}× | "
                     f"{num(r['mean_acceptance_length'], '.2f')} |")
    return "\n".join(lines)


def metric_name(method: Method) -> str:
    """A method as an MLflow metric prefix (file paths reduced to their file name; only the allowed characters)."""
    label = method.label.replace("@", "_").replace(",", "-").replace("=", "_")
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in label)


def bench_metrics(rows: list[dict], positions: int = 8) -> dict[str, float]:
    """Flat metrics of every row under vLLM's names, ``<method>/T<t>/<name>``: tokens_per_s, speedup,
    mean_acceptance_length (tokens per target pass, = block efficiency), acceptance_rate, draft_tokens,
    accepted_tokens, and acceptance_rate_pos<i>: the share of steps that accepted at least i draft tokens."""
    out: dict[str, float] = {}
    for r in rows:
        prefix = f"{metric_name(Method.parse(r['method']))}/T{r['temperature']:g}"
        values = {"tokens_per_s": r["tokens_per_s"], "speedup": r.get("speedup"), "tpot_ms": r.get("tpot_ms"),
                  "mean_acceptance_length": mean_acceptance_length(r), "acceptance_rate": r.get("acceptance_rate"),
                  "draft_tokens": r.get("draft_tokens"), "accepted_tokens": r.get("accepted_tokens"),
                  "tokens_per_s_stdev_over_prompts": r.get("tokens_per_s_stdev_over_prompts"),
                  "policy_share": r.get("policy_share")}
        histogram = {int(k): v for k, v in (r.get("accepted_length_histogram") or {}).items()}
        steps = sum(histogram.values())
        for i in range(1, positions + 1):
            if steps:
                values[f"acceptance_rate_pos{i}"] = sum(v for k, v in histogram.items() if k >= i) / steps
        out.update({f"{prefix}/{k}": float(v) for k, v in values.items() if v is not None})
    return out


# the HF baselines are drawn as reference lines: name, colour, line style
REFERENCES = {"ar": ("AR", "black", "--"), "hf-assisted": ("HF assisted", COLOURS["hf-assisted"], ":")}


def panels(rows: list[dict]) -> list[tuple[float, list[Method], dict[str, float]]]:
    """Per temperature of the figure: the methods drawn as bars (only those benched at it, grouped by verifier)
    and the reference rates (``ar``, ``hf-assisted``) drawn as lines."""
    out = []
    for temperature in sorted({r["temperature"] for r in rows}):
        at_t = by_method(rows, temperature)
        bars = sorted((m for m in at_t if m.kind not in REFERENCES), key=lambda m: (m.group, m.key))
        out.append((temperature, bars, {m.kind: at_t[m]["tokens_per_s"] for m in at_t if m.kind in REFERENCES}))
    return out


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    """Tokens/s per method, grouped by verifier and coloured by it, with the spread over prompts as error bars and
    the speed-up vs AR after each bar; AR and HF assisted as reference lines, not bars; one panel per temperature,
    each with only the methods benched at it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = panels(rows)
    most = max((len(bars) for _, bars, _ in layout), default=0)
    fig, axes = plt.subplots(1, len(layout), figsize=(5.6 * len(layout) + 1.8, 0.42 * max(most, 1) + 2.2),
                             squeeze=False)
    for ax, (temperature, bars, references) in zip(axes[0], layout, strict=True):
        at_t = by_method(rows, temperature)
        y = list(range(len(bars)))[::-1]
        values = [at_t[m]["tokens_per_s"] for m in bars]
        errors = [at_t[m].get("tokens_per_s_stdev_over_prompts") or 0.0 for m in bars]
        ax.barh(y, values, xerr=errors, color=[COLOURS.get(m.group, "#333333") for m in bars],
                error_kw={"elinewidth": 0.8, "capsize": 2})
        ax.set_yticks(y, [m.label for m in bars], fontsize=8)
        for kind, rate in references.items():
            name, colour, style = REFERENCES[kind]
            ax.axvline(rate, color=colour, lw=1.0, ls=style, label=f"{name} {rate:.0f} tok/s")
        ar = references.get("ar")
        right = max([v + e for v, e in zip(values, errors, strict=True)] + list(references.values()) + [1.0])
        if ar:
            for yi, value, error in zip(y, values, errors, strict=True):
                ax.text(value + error + 0.015 * right, yi, f"{value / ar:.2f}×", va="center", fontsize=7)
        if references:  # above the panel, right of its title: never over a bar or the axis label
            ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(references), frameon=False,
                      borderaxespad=0.1)
        ax.set_title(f"T = {temperature:g}", fontsize=9, loc="left")
        ax.set_xlabel("tokens/s (error bar: std over prompts)", fontsize=8)
        ax.set_xlim(0, right * 1.16)  # room for the error bars and the speed-up labels after them
        ax.set_ylim(-0.6, max(len(bars), 1) - 0.4)
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    with staged_file(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format=Path(path).suffix.lstrip(".").lower() or "png")
    plt.close(fig)
