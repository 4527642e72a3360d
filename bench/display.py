"""How a decoding bench's rows are shown: the markdown table, the figure (one panel per temperature), and the flat
metrics logged to MLflow."""

from __future__ import annotations

import os
from pathlib import Path

from bench.method import AR, Method, by_method

# one colour per verifier (and the two HF baselines), the same in every figure
COLOURS = {
    "ar": "#7f7f7f", "hf-assisted": "#bcbd22", "traversal": "#1f77b4", "specinfer": "#d62728", "spectr": "#ff7f0e",
    "nss": "#9467bd", "naive": "#8c564b", "rsd": "#e377c2", "block": "#17becf", "gbv": "#2ca02c",
}


def format_table(rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [
        "| T | method | tokens/s | ± (prompts) | TPOT ms | speedup vs ar | block efficiency | acceptance rate "
        "| outside forwards | selector call µs | policy share |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('temperature', '-')} | {r['method']} | {r['tokens_per_s']:.1f} | "
            f"{num(r.get('tokens_per_s_stdev_over_prompts'), '.1f')} | {num(r.get('tpot_ms'), '.1f')} | "
            f"{num(r['speedup'], '.2f')}× | "
            f"{num(r['block_efficiency'], '.2f')} | {num(r['acceptance_rate'], '.2f')} | "
            f"{num(r['outside_forwards_share'], '.0%')} | {num(r.get('selector_call_us_median'), '.1f')} | "
            f"{num(r.get('policy_share'), '.1%')} |"
        )
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
                  "mean_acceptance_length": r.get("block_efficiency"), "acceptance_rate": r.get("acceptance_rate"),
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


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    """Tokens/s per method, grouped by verifier and coloured by it, with the spread over prompts as error bars,
    the AR rate as a reference line and the speed-up vs AR on each bar; one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    methods = sorted({Method.parse(r["method"]) for r in rows}, key=lambda m: (m != AR, m.group, m.key))
    height = 0.42 * len(methods) + 1.6
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.2 * len(temperatures) + 1.6, height), squeeze=False,
                             sharey=True)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        at_t = by_method(rows, temperature)
        y = list(range(len(methods)))[::-1]
        values = [at_t[m]["tokens_per_s"] if m in at_t else 0.0 for m in methods]
        errors = [at_t.get(m, {}).get("tokens_per_s_stdev_over_prompts") or 0.0 for m in methods]
        colours = [COLOURS.get(m.group, "#333333") for m in methods]
        ax.barh(y, values, xerr=errors, color=colours, error_kw={"elinewidth": 0.8, "capsize": 2})
        ar = at_t.get(AR, {}).get("tokens_per_s")
        if ar:
            ax.axvline(ar, color="black", lw=0.8, ls="--", label=f"AR {ar:.0f} tok/s")
            for yi, m in zip(y, methods, strict=True):
                if m in at_t and m != AR:
                    ax.text(values[methods.index(m)] * 1.01, yi, f"{at_t[m]['tokens_per_s'] / ar:.2f}×",
                            va="center", fontsize=7)
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(f"T = {temperature:g}", fontsize=9)
        ax.set_xlabel("tokens/s (error bar: std over prompts)")
        ax.set_xlim(0, max(values + [1.0]) * 1.18)
    axes[0][0].set_yticks(list(range(len(methods)))[::-1], [m.label for m in methods], fontsize=8)
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
