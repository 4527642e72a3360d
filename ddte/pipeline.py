"""The main job, end to end on one machine: collect → train → export → bench, ending with the results table.

  ddte pipeline --config configs/pipeline/default.yaml
  ddte pipeline --config configs/pipeline/default.yaml collect.overrides='[prompts.limit=8]' bench.num_prompts=4

1. collect: `ddte collect` with the pipeline's collect config (training prompts of the prompt builder);
2. train: one selector per verifier in `train.verifiers` (LightningCLI, tracked in MLflow under the run folder);
3. export: each selector to `<output>/selectors/<verifier>.onnx` (parity-checked, logged to MLflow);
4. bench: on held-out prompts, for each temperature: AR, each verifier with its best static actions (the
   data set's top `bench.static_candidates` by the latency model) and with its selector, in one `ddte bench` run.

Everything goes to the `output` folder: data/, mlflow.db, selectors/, bench.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddte.cli import UserError
from ddte.yamlconfig import load_yaml_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "pipeline" / "default.yaml"


@dataclass
class CollectStage:
    config: str = "configs/collect/default.yaml"
    overrides: list[str] = field(default_factory=list)
    reuse: str | None = None  # an existing data set folder: skip collection


@dataclass
class TrainStage:
    config: str = "configs/train/default.yaml"
    verifiers: list[str] = field(default_factory=lambda: ["specinfer", "traversal"])
    overrides: list[str] = field(default_factory=list)


@dataclass
class BenchStage:
    num_prompts: int = 10
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.6, 1.0])
    static_candidates: int = 2  # best static actions per verifier and temperature (from the data set) to bench
    repeats: int = 1
    threads: int | None = None
    seed: int = 0


@dataclass
class PipelineConfig:
    output: str = "runs/pipeline"
    collect: CollectStage = field(default_factory=CollectStage)
    train: TrainStage = field(default_factory=TrainStage)
    bench: BenchStage = field(default_factory=BenchStage)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. bench.num_prompts=4")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="pipeline YAML (default: the shipped one)")
    parser.add_argument("--output", default=None, help="output folder (overrides the config's output)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f"output={args.output}"] if args.output else [])
    try:
        config = load_yaml_config(PipelineConfig, args.config, overrides)
    except ValueError as err:
        raise UserError(str(err)) from err
    results = run_pipeline(config)
    print(results)
    return 0


def _stage(number: int, title: str) -> float:
    print(f"\n=== [{number}/4] {title}", flush=True)
    return time.perf_counter()


def run_pipeline(config: PipelineConfig) -> str:
    """Run the four stages; returns the results table (also written to ``<output>/results.md``)."""
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    timings = {}
    started = _stage(1, "collect")
    data_dir = _collect(config, out)
    timings["collect"] = time.perf_counter() - started
    started = _stage(2, f"train ({', '.join(config.train.verifiers)})")
    trained = {v: _train(config, out, data_dir, v) for v in config.train.verifiers}
    timings["train"] = time.perf_counter() - started
    started = _stage(3, "export")
    selectors = {v: _export(out, v, result, data_dir) for v, result in trained.items()}
    timings["export"] = time.perf_counter() - started
    started = _stage(4, "bench on held-out prompts")
    bench = _bench(config, out, data_dir, selectors)
    timings["bench"] = time.perf_counter() - started
    text = results_markdown(bench, trained, timings, data_dir)
    (out / "results.md").write_text(text + "\n", encoding="utf-8")
    return text


def _collect(config: PipelineConfig, out: Path) -> Path:
    from data_gen.cli import collect
    from data_gen.config import load_collect_config
    from data_gen.store import list_shards

    if config.collect.reuse:
        data = Path(config.collect.reuse)
        if not list_shards(data):
            raise UserError(f"collect.reuse: {data} holds no shards")
        print(f"reusing the data set in {data}")
        return data
    data = out / "data"
    try:
        collect_config = load_collect_config(config.collect.config, [*config.collect.overrides, f"output={data}"])
    except ValueError as err:
        raise UserError(f"collect config: {err}") from err
    summary = collect(collect_config, resume=data.exists())
    print(summary.line())
    return data


def _train(config: PipelineConfig, out: Path, data_dir: Path, verifier: str):
    from selector.train import train_selector

    overrides = [
        f"data.data_dir={data_dir}", f"data.verifier={verifier}", f"run.output_dir={out / 'selectors' / 'runs'}",
        f"run.tracking_uri=sqlite:///{(out / 'mlflow.db').resolve()}", *config.train.overrides,
    ]
    try:
        return train_selector(config.train.config, overrides)
    except ValueError as err:
        raise UserError(f"train {verifier}: {err}") from err


def _export(out: Path, verifier: str, trained, data_dir: Path) -> Path:
    from selector.export import export_selector

    path = out / "selectors" / f"{verifier}.onnx"
    try:
        result = export_selector(
            trained.checkpoint_path, path, tracking_uri=trained.tracking_uri, run_id=trained.run_id, data_dir=data_dir
        )
    except ValueError as err:
        raise UserError(f"export {verifier}: {err}") from err
    print(f"{path}: parity max |Δ| = {result.max_abs_diff:.1e}")
    return path


def static_candidates(data_dir: Path, verifier: str, count: int) -> list[str]:
    """The data set's best static actions for a verifier: the top ``count`` per sampling configuration."""
    import numpy as np

    from data_gen.analyze import load_columns, static_throughput
    from data_gen.schema import label_column

    metadata, columns = load_columns(data_dir)
    chosen: list[str] = []
    for s in range(len(metadata["sampling"])):
        rows = columns["sampling_index"] == s
        throughput = static_throughput(columns[label_column(verifier)][rows], columns["step_ms"][rows])
        for index in np.argsort(-throughput)[:count]:
            if metadata["actions"][index] not in chosen:
                chosen.append(metadata["actions"][index])
    return chosen


def _bench(config: PipelineConfig, out: Path, data_dir: Path, selectors: dict[str, Path]) -> dict:
    from decode import bench

    stage = config.bench
    methods = ["ar"]
    for verifier, path in selectors.items():
        methods += [f"{verifier}@{a}" for a in static_candidates(data_dir, verifier, stage.static_candidates)]
        methods.append(f"{verifier}@selector={path}")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = [
        "--methods", *methods, "--num-prompts", str(stage.num_prompts), "--max-new-tokens", str(stage.max_new_tokens),
        "--temperature", *[str(t) for t in stage.temperatures], "--repeats", str(stage.repeats),
        "--seed", str(stage.seed), "--output", str(out / "bench.json"),
    ]
    if stage.threads:
        argv += ["--threads", str(stage.threads)]
    bench.run(parser.parse_args(argv))
    return json.loads((out / "bench.json").read_text())


def results_markdown(bench: dict, trained: dict, timings: dict[str, float], data_dir: Path) -> str:
    """Per temperature: each verifier's best measured static action vs its selector, and the paper's comparisons."""
    rows = bench["rows"]
    lines = [
        f"Data set: {data_dir} · stage times: "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()),
        "",
        "| T | verifier | best static (measured) | tokens/s | selector tokens/s | selector / static | "
        "selector BE | selector call µs (median) | policy share |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for t in sorted({r["temperature"] for r in rows}):
        at_t = [r for r in rows if r["temperature"] == t]
        for verifier in trained:
            statics = [r for r in at_t if r["method"].startswith(f"{verifier}@") and "selector=" not in r["method"]]
            sel = next(r for r in at_t if r["method"].startswith(f"{verifier}@selector="))
            best = max(statics, key=lambda r: r["tokens_per_s"])
            summary[(t, verifier)] = (best, sel)
            lines.append(
                f"| {t:g} | {verifier} | {best['method'].split('@')[1]} | {best['tokens_per_s']:.1f} | "
                f"{sel['tokens_per_s']:.1f} | {sel['tokens_per_s'] / best['tokens_per_s']:.3f} | "
                f"{sel['block_efficiency']:.2f} | {_fmt(sel.get('selector_call_us_median'))} | "
                f"{_fmt(sel.get('policy_share'), '.1%')} |"
            )
    if all((t, v) in summary for t in {k[0] for k in summary} for v in ("specinfer", "traversal")):
        lines += [
            "", "| T | SpecInfer + selector / Traversal best static | Traversal + selector / Traversal best static |",
            "|---|---:|---:|",
        ]
        for t in sorted({k[0] for k in summary}):
            trav_static = summary[(t, "traversal")][0]["tokens_per_s"]
            lines.append(
                f"| {t:g} | {summary[(t, 'specinfer')][1]['tokens_per_s'] / trav_static:.3f} | "
                f"{summary[(t, 'traversal')][1]['tokens_per_s'] / trav_static:.3f} |"
            )
    ar = [r for r in rows if r["method"] == "ar"]
    if ar:
        lines += ["", "AR tokens/s: " + ", ".join(f"T={r['temperature']:g}: {r['tokens_per_s']:.1f}" for r in ar)]
    lines += ["", "Offline (test prompts of the data set): " + "; ".join(
        f"{v}: {res.metrics.get('ratio_vs_static', float('nan')):.3f}× best static, "
        f"{res.metrics.get('ratio_vs_oracle', float('nan')):.3f}× oracle"
        for v, res in trained.items()
    )]
    return "\n".join(lines)


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)
