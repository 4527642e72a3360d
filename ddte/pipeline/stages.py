"""The pipeline's stages (collect, train, export and expanders, bench, decide) and their MLflow runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench.decoding import BenchSettings, bench_prompts, encode_prompts, environment, open_bench, run_bench
from bench.display import bench_metrics, format_table, plot
from bench.method import AR, Method
from data_gen.config import CollectConfig
from ddte.pipeline.config import BenchStage, ExpanderStage, PipelineConfig, PipelinePlan
from ddte.pipeline.decide import decide, keep_statics, static_candidates
from ddte.pipeline.results import results_markdown
from decode.policies.files.selector_file import read_selector_metadata
from selector.root.train import TrainResult, train
from selector.root.train_config import TrainConfig


def _stage(number: int, title: str) -> float:
    print(f"\n=== [{number}/5] {title}", flush=True)
    return time.perf_counter()


@dataclass
class PipelineResult:
    results_markdown: str
    deployment_path: Path
    bench: dict


class _Tracking:
    """The pipeline as one MLflow parent run, with a child run per stage (collect, train per verifier, bench)."""

    EXPERIMENT = "ddte-pipeline"

    def __init__(self, out: Path, config: PipelineConfig) -> None:
        from mlflow.tracking import MlflowClient

        from ddte_core.tracking import experiment_id, log_environment, open_store, resolve_tracking_uri, start_child_run

        self.uri = (resolve_tracking_uri(config.tracking_uri) if config.tracking_uri
                    else f"sqlite:///{(out / 'mlflow.db').resolve()}")
        self.client = MlflowClient(open_store(self.uri))
        self.experiment = experiment_id(self.client, self.EXPERIMENT, self.uri)
        self.parent = start_child_run(self.client, self.experiment, None, "pipeline")
        log_environment(self.client, self.parent)
        for key, value in {"output": config.output, "collect.config": config.collect.config,
                           "collect.overrides": json.dumps(config.collect.overrides),
                           "train.verifiers": ",".join(config.train.verifiers),
                           "train.overrides": json.dumps(config.train.overrides),
                           **{f"bench.{k}": v for k, v in config.bench.__dict__.items()}}.items():
            self.client.log_param(self.parent, key, str(value)[:500])

    def child(self, name: str) -> str:
        from ddte_core.tracking import start_child_run

        return start_child_run(self.client, self.experiment, self.parent, name)

    def log_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
        for start in range(0, len(items), 900):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(run_id, metrics=items[start : start + 900])

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)


def run_pipeline(plan: PipelinePlan) -> PipelineResult:
    """Run the stages; returns the results table (also written to ``<output>/results.md``) and the policy file."""
    from ddte_core.tracking import quiet_lightning

    out = Path(plan.config.output)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_lightning():  # MLflow's store set-up and registry lines, Lightning's tips: the stages print their own
        tracking = _Tracking(out, plan.config)
        try:
            result = _run_stages(plan, out, tracking)
        except BaseException:
            tracking.finish(tracking.parent, "FAILED")
            raise
        tracking.finish(tracking.parent)
    return result


def _run_stages(plan: PipelinePlan, out: Path, tracking: _Tracking) -> PipelineResult:
    from decode.policies.files.deployment import Deployment

    config = plan.config
    timings = {}
    started = _stage(1, "collect")
    data_dir = _collect(plan, out, tracking)
    timings["collect"] = time.perf_counter() - started
    started = _stage(2, f"train ({', '.join(config.train.verifiers)})")
    trained = {v: _train(plan.train, out, data_dir, v, tracking) for v in config.train.verifiers}
    timings["train"] = time.perf_counter() - started
    started = _stage(3, "export" + (" and fit expanders" if config.expander.enabled else ""))
    selectors = {v: _export(out, v, result, data_dir) for v, result in trained.items()}
    expanders = _fit_expanders(config.expander, out, data_dir, list(trained), tracking)
    timings["export"] = time.perf_counter() - started
    started = _stage(4, "bench on held-out prompts")
    metadata = {v: read_selector_metadata(path) for v, path in selectors.items()}
    candidates = {v: static_candidates(metadata[v], trained[v].info.data.sampling, trained[v].info.data.static_ranking,
                                       config.bench.temperatures, config.bench.candidates) for v in selectors}
    active = {v: path for v, path in selectors.items()
              if any(m.margin is not None for m in metadata[v].fallbacks)}
    benched_expanders = {v: path for v, (path, meta) in expanders.items() if any(r.rule for r in meta.rules)}
    bench = _bench(config.bench, plan.collect, out, candidates, active, benched_expanders, tracking)
    timings["bench"] = time.perf_counter() - started
    _stage(5, "decide")
    kept = keep_statics(bench["rows"], candidates)
    choices = decide(bench["rows"], candidates, metadata, selectors, out, kept, benched_expanders)
    best_verifier = max(choices, key=lambda c: c.tokens_per_s or 0.0).verifier
    deployment = Deployment(choices, best_verifier, bench["pair_fingerprint"],
                            {"bench": "bench.json", "data": _beside(data_dir, out), "machine": bench["machine"]})
    deployment.check()  # the readers' validator: nothing generate, bench or serve would refuse is written
    path = deployment.write(out / "policy.json")
    text = results_markdown(bench, trained, candidates, kept, choices, timings, data_dir, tracking.parent)
    (out / "results.md").write_text(text + "\n", encoding="utf-8")
    for name in ("results.md", "policy.json"):
        tracking.client.log_artifact(tracking.parent, str(out / name))
    tracking.log_metrics(tracking.parent, {
        **{f"stage_minutes/{k}": v / 60 for k, v in timings.items()},
        **{f"deploy/{c.verifier}/T{c.temperature:g}/tokens_per_s_vs_static": (c.tokens_per_s or 0) /
           (c.static_tokens_per_s or 1) for c in choices},
    })
    for c in choices:
        tracking.client.set_tag(tracking.parent, f"deploy/{c.verifier}/T{c.temperature:g}",
                                f"static {c.action}" if c.policy == "static" else c.policy)
    return PipelineResult(text, path, bench)


def _beside(path: Path, out: Path) -> str:
    """``path`` as policy.json's ``source`` names it: relative to the output folder (policy.json's own) when inside
    it, like its bench.json, else absolute."""
    path, out = path.resolve(), out.resolve()
    return str(path.relative_to(out)) if path.is_relative_to(out) else str(path)


def _collect(plan: PipelinePlan, out: Path, tracking: _Tracking) -> Path:
    from data_gen.collection import collect
    from data_gen.config import config_to_dict
    from ddte_core.tracking import log_data_set_input

    run = tracking.child("collect")
    reuse = plan.config.collect.reuse
    if reuse:
        print(f"reusing the data set in {reuse}")
        data = Path(reuse)
    else:
        data = Path(plan.collect.output)
        for key, value in config_to_dict(plan.collect).items():
            tracking.client.log_param(run, key, str(value)[:500])
        summary = collect(plan.collect, resume=(data / "dataset.json").exists())
        print(summary.line())
        tracking.log_metrics(run, {"roots": summary.roots, "seconds": summary.seconds,
                                   "roots_per_s": summary.roots / max(summary.seconds, 1e-9),
                                   "shards_written": summary.shards_written})
    digest = hashlib.sha256((data / "dataset.json").read_bytes()).hexdigest()
    log_data_set_input(tracking.client, run, data, digest, context="collected")
    tracking.finish(run)
    return data


def _train(base: TrainConfig, out: Path, data_dir: Path, verifier: str, tracking: _Tracking) -> TrainResult:
    """One selector: the stage's train config with this verifier's data, and tracked as a child of the pipeline."""
    config = dataclasses.replace(
        base, data=dataclasses.replace(base.data, data_dir=str(data_dir), verifier=verifier),
        run=dataclasses.replace(base.run, output_dir=str(out / "selectors" / "runs"), tracking_uri=tracking.uri,
                                experiment=tracking.EXPERIMENT, parent_run_id=tracking.parent,
                                run_name=f"train-{verifier}"))
    try:
        return train(config)
    except ValueError as err:
        raise ValueError(f"train {verifier}: {err}") from err


def _export(out: Path, verifier: str, trained, data_dir: Path) -> Path:
    from selector.root.export import export_selector

    path = out / "selectors" / f"{verifier}.onnx"
    try:
        result = export_selector(
            trained.checkpoint_path, path, tracking_uri=trained.tracking_uri, run_id=trained.run_id, data_dir=data_dir
        )
    except ValueError as err:
        raise ValueError(f"export {verifier}: {err}") from err
    print(f"{path}: parity max |Δ| = {result.max_abs_diff:.1e}")
    return path


def _bench(stage: BenchStage, collect: CollectConfig, out: Path, candidates: dict[str, dict[float, list[str]]],
           selectors: dict[str, Path], expanders: dict[str, Path], tracking: _Tracking) -> dict:
    """One interleaved bench per temperature of AR, the static candidates, the selectors and the expanders;
    bench.json/png."""
    run = tracking.child("bench")  # started now, so that its duration is the bench's
    for key, value in stage.__dict__.items():
        tracking.client.log_param(run, key, str(value))
    try:
        payload = _bench_rows(stage, collect, out, candidates, selectors, expanders)
    except BaseException:
        tracking.finish(run, "FAILED")
        raise
    tracking.log_metrics(run, bench_metrics(payload["rows"]))
    for name in ("bench.json", "bench.png"):
        tracking.client.log_artifact(run, str(out / name))
    tracking.finish(run)
    payload["mlflow_run_id"] = run
    return payload


def _bench_rows(stage: BenchStage, collect: CollectConfig, out: Path, candidates: dict[str, dict[float, list[str]]],
                selectors: dict[str, Path], expanders: dict[str, Path]) -> dict:
    """The bench itself: its rows, printed and written to bench.json and bench.png; the payload of bench.json."""
    from decode.models.machine_cache import machine_identity
    from decode.pair import load_pair_config
    from decode.session import Hooks

    if stage.threads:
        import torch

        torch.set_num_threads(stage.threads)
    pair = load_pair_config(collect.pair)
    methods = _bench_methods(stage, candidates, selectors, expanders)
    # every method opened at once: the pair on the kernels the collection ran on, as the loop does, and each file's
    # policy as fitted (the decision compares them as the pipeline made them)
    session = open_bench(pair, list(dict.fromkeys(m for at_t in methods.values() for m in at_t)), latency="fitted",
                         hooks=Hooks(progress=True))
    print(session.kernel_choice.line())
    prompts = encode_prompts(pair, bench_prompts(None, "prompt", stage.num_prompts, tokenizer=pair.tokenizer,
                                                 default=pair.spec.heldout_prompts), stage.max_new_tokens)
    seconds = None if stage.minutes is None else 60.0 * stage.minutes / len(stage.temperatures)
    settings = BenchSettings(stage.max_new_tokens, stage.repeats, stage.seed, seconds=seconds)
    rows = []
    for temperature in stage.temperatures:
        rows += run_bench(methods[temperature], session, prompts, settings, [temperature])
    timed = len({(p["prompt"], p["repeat"]) for row in rows for p in row.get("per_prompt", [])})
    title = (f"{timed} held-out prompts × {stage.repeats}, {stage.max_new_tokens} new tokens, "
             f"T = {', '.join(f'{t:g}' for t in stage.temperatures)}")
    print(title)
    print(format_table(rows))
    payload = {"settings": {"bench": stage.__dict__, "candidates": candidates}, "rows": rows,
               "environment": environment(pair.target.device) | {"kernels": pair.kernel_choice.line()},
               "pair_fingerprint": pair.fingerprint(),
               "machine": machine_identity(pair.target, pair.draft)}
    (out / "bench.json").write_text(json.dumps(payload, indent=2, default=str))
    plot(rows, out / "bench.png", title)
    return payload


def _bench_methods(stage: BenchStage, candidates: dict[str, dict[float, list[str]]], selectors: dict[str, Path],
                   expanders: dict[str, Path]) -> dict[float, list[Method]]:
    """The methods benched at each temperature: AR, each verifier's static candidates there, its selector and its
    expander; each once."""
    by_temperature = {}
    for temperature in stage.temperatures:
        methods = [AR]
        for verifier, actions in candidates.items():
            methods += [Method.static(verifier, action) for action in actions[temperature]]
            if verifier in selectors:
                methods.append(Method.selector(verifier, selectors[verifier]))
            if verifier in expanders:
                methods.append(Method.expander(verifier, expanders[verifier]))
        by_temperature[temperature] = list(dict.fromkeys(methods))
    return by_temperature


def _fit_expanders(stage: ExpanderStage, out: Path, data_dir: Path, verifiers: list[str],
                   tracking: _Tracking) -> dict[str, tuple[Path, object]]:
    """Per verifier, the expander fitted on the collection and its metadata, each tracked as a child run; none when
    the stage is off or the collection has no trunk states (said in one line)."""
    from selector.expander.expander import expander_metrics, expander_params, fit_expander, write_expander

    if not stage.enabled:
        return {}
    fitted = {}
    for verifier in verifiers:
        try:
            expander = fit_expander(data_dir, verifier, stage.folds, stage.min_gain, progress=print,
                                    acceptance=stage.acceptance)
        except ValueError as err:
            print(f"expander {verifier}: not fitted ({err})")
            continue
        path = out / "expanders" / f"{verifier}.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_expander(expander, path)
        run = tracking.child(f"expander-{verifier}")
        for key, value in expander_params(expander).items():
            tracking.client.log_param(run, key, value)
        tracking.log_metrics(run, expander_metrics(expander))
        tracking.client.log_artifact(run, str(path))
        tracking.finish(run)
        fitted[verifier] = (path, expander.metadata)
    return fitted
