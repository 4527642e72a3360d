"""The main job, end to end on one machine: collect → train → export → bench → decide.

1. collect: `ddte collect` with the pipeline's collect config (training prompts of the prompt builder);
2. train: one selector per verifier in `train.verifiers` (Lightning, tracked in MLflow under the run folder), with
   the never-lose guard fitted on validation prompts;
3. export: each selector to `<output>/selectors/<verifier>.onnx` (parity-checked, logged to MLflow), and, where the
   collection has trunk states and `expander.enabled`, an expander per verifier to `<output>/expanders/<verifier>.onnx`
   (`ddte expander`: per-node halting rules chosen cross-fitted, with a static fallback);
4. bench: on held-out prompts, for each temperature, in one interleaved run: AR, each verifier's static
   candidates (the `bench.candidates` best distinct trees of the training split at that temperature, its selector's
   fallback first), its selector (left out where its guard never leaves the fallback at any temperature, because
   it then drafts exactly the fallback) and its expander (left out where it is static at every temperature);
5. decide: per verifier and temperature, deploy the training split's static choice unless a runner-up beat it
   beyond the bench's noise (a paired bootstrap interval wholly above 1), or the faster of the selector and the
   expander where it beat that static beyond the same noise.
   The choice goes to `<output>/policy.json` (`--policy-file` of `ddte generate` and `ddte bench`).

Why bench several statics, and why a test before leaving the offline choice: the offline ranking can be wrong by more
than the candidates differ, and the bench catches a gross error; but near-tied rows of a small bench differ by noise,
so chasing its fastest row costs more than it gains (docs/selector.md, "What the pipeline deploys", has the runs).

Every stage's config is read once and checked before the first stage starts (:func:`load_pipeline`). Everything
goes to the `output` folder: data/, mlflow.db, selectors/, expanders/, bench.json, bench.png, policy.json and
results.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.compare import SWITCH_LEVEL, choose_static, paired_ratio_interval
from bench.decoding import BenchSettings, bench_prompts, encode_prompts, environment, run_bench
from bench.display import bench_metrics, format_table, plot
from bench.method import AR, Method, by_method, static_rows
from data_gen.config import CollectConfig, load_collect_config
from ddte.pipeline_results import results_markdown
from ddte_core.paths import refuse_file_in_the_way
from ddte_core.yamlconfig import load_yaml_config
from decode.drafting.sampling import SamplingConfig, nearest_setting
from decode.policies.selector_file import read_selector_metadata
from selector.train import TrainConfig, TrainResult, load_train_config, train


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
    num_prompts: int = 16
    candidates: int = 3  # static trees per verifier and temperature: the training split's best distinct trees
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.6, 1.0])
    repeats: int = 1
    threads: int | None = 1
    seed: int = 0


@dataclass
class ExpanderStage:
    enabled: bool = True  # fit and bench an expander per verifier (needs a collection with trunk states)
    folds: int = 5  # prompt folds of the cross-fitting that chooses each configuration's rule
    min_gain: float = 0.01  # offline gain over the best static tree a rule needs (else the expander stays static)
    # an acceptance model (ddte acceptance) trained on other prompts than the collection's: adds its β̂ and the
    # marginal rule on it to the signals, and the expanders embed its graph
    acceptance: str | None = None


@dataclass
class PipelineConfig:
    output: str = "runs/pipeline"
    tracking_uri: str | None = None  # MLflow (any URI, e.g. http://host:5000); null: <output>/mlflow.db
    collect: CollectStage = field(default_factory=CollectStage)
    train: TrainStage = field(default_factory=TrainStage)
    bench: BenchStage = field(default_factory=BenchStage)
    expander: ExpanderStage = field(default_factory=ExpanderStage)


@dataclass
class PipelinePlan:
    """A checked pipeline config and the stage configs it names, each read once."""

    config: PipelineConfig
    collect: CollectConfig  # the collection's config, writing to <output>/data
    train: TrainConfig  # train.config with train.overrides; each verifier's run sets its data and tracking keys


def load_pipeline(path: str | Path | None, overrides: list[str], resume: bool = False) -> PipelinePlan:
    """The pipeline config and its stages' configs, every setting checked (ValueError naming the first bad one)."""
    return plan_pipeline(load_yaml_config(PipelineConfig, path, overrides, required=("collect", "train", "bench")),
                         resume)


def plan_pipeline(config: PipelineConfig, resume: bool = False) -> PipelinePlan:
    """Everything that can be checked before the first stage: a 6-minute collection must not end in a refusal.
    ``resume``: the output folder may hold an earlier run of this pipeline, whose collected shards are kept and
    whose selectors, policy.json and results are redone; without it the folder must be new or empty."""
    from data_gen.collection import check_output, check_verifiers
    from ddte_core.paths import folder_is_writable
    from ddte_core.tracking import resolve_tracking_uri

    refuse_file_in_the_way(config.output)
    out = Path(config.output)
    if not folder_is_writable(out):
        raise ValueError(f"output {out}: no file can be written there; choose another output=")
    if config.tracking_uri:
        resolve_tracking_uri(config.tracking_uri)  # its scheme and folder, before the first stage
    if resume and not (out / "data").is_dir() and not (out / "mlflow.db").is_file():
        raise ValueError(f"--resume: {out} holds no pipeline run to continue; drop --resume to start one there")
    if not resume and out.is_dir() and any(out.iterdir()):
        held = ("a finished pipeline run (policy.json)" if (out / "policy.json").is_file()
                else "an unfinished pipeline run" if (out / "data").is_dir() or (out / "mlflow.db").is_file()
                else "other files")
        raise ValueError(f"{out} already holds {held}: pass --resume to continue or redo it (its collected data is "
                         "kept; selectors, policy.json and results are rewritten), or choose another --output")
    try:
        collect = load_collect_config(config.collect.config,
                                      [*config.collect.overrides, f"output={Path(config.output) / 'data'}"])
    except ValueError as err:
        raise ValueError(f"collect config: {err}") from err
    if not config.collect.reuse:
        check_output(Path(collect.output), resume=True)
    if config.collect.reuse and not (Path(config.collect.reuse) / "dataset.json").is_file():
        raise ValueError(f"collect.reuse: {config.collect.reuse} is not a collected data set")
    labelled = _labelled_verifiers(config, collect)
    trained = check_verifiers(config.train.verifiers)
    missing = [v for v in trained if v not in labelled]
    if missing:
        raise ValueError(f"train.verifiers {missing} have no labels in the collection (it labels "
                         f"{', '.join(labelled)}): add them to collect verifiers or drop them")
    try:
        train_config = load_train_config(config.train.config, config.train.overrides)
    except ValueError as err:
        raise ValueError(f"train config: {err}") from err
    bench = config.bench
    if min(bench.num_prompts, bench.max_new_tokens, bench.repeats, bench.candidates) < 1 or not bench.temperatures:
        raise ValueError("bench: num_prompts, max_new_tokens, repeats and candidates must be >= 1 and temperatures "
                         "non-empty")
    if any(not t >= 0 for t in bench.temperatures):
        raise ValueError(f"bench.temperatures must be >= 0, got {bench.temperatures}")
    cores = os.cpu_count() or 1
    if bench.threads is not None and not 0 <= bench.threads <= cores:
        raise ValueError(f"bench.threads must be null or in [0, {cores}] (0: torch's choice), got {bench.threads}")
    if config.collect.reuse:  # every shard readable, with labels for every verifier to train, before stage 1
        from selector.data import inspect_dataset

        for verifier in trained:
            inspect_dataset(config.collect.reuse, verifier)
    if config.expander.folds < 2 or not 0.0 <= config.expander.min_gain < 1.0:
        raise ValueError(f"expander: folds must be >= 2 and min_gain in [0, 1), got {config.expander.folds} and "
                         f"{config.expander.min_gain}")
    if config.expander.acceptance and not Path(config.expander.acceptance).is_file():
        raise ValueError(f"expander.acceptance: no file {config.expander.acceptance}")
    return PipelinePlan(config, collect, train_config)


def _labelled_verifiers(config: PipelineConfig, collect) -> list[str]:
    if config.collect.reuse:
        metadata = json.loads((Path(config.collect.reuse) / "dataset.json").read_text())
        return list(metadata["verifiers"])
    from data_gen.collection import check_verifiers

    return check_verifiers(collect.verifiers)


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
    from decode.policies.deployment import Deployment

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
    from selector.export import export_selector

    path = out / "selectors" / f"{verifier}.onnx"
    try:
        result = export_selector(
            trained.checkpoint_path, path, tracking_uri=trained.tracking_uri, run_id=trained.run_id, data_dir=data_dir
        )
    except ValueError as err:
        raise ValueError(f"export {verifier}: {err}") from err
    print(f"{path}: parity max |Δ| = {result.max_abs_diff:.1e}")
    return path


def static_candidates(metadata, sampling: list[SamplingConfig], ranking: dict[int, list[str]],
                      temperatures: list[float], count: int) -> dict[float, list[str]]:
    """Per bench temperature, the static trees to bench: the selector's fallback (the best static action of its
    training split, what it drafts wherever its guard holds) first, then the split's runners-up, ``count`` distinct
    trees in all, canonical keys.

    ``sampling`` and ``ranking``: the training run's sampling configurations and, per configuration index, its
    static ranking (:class:`selector.info.DataFacts`); the ranking of the configuration nearest each temperature is
    used. Without a ranking, the fallback alone.
    """
    from decode.drafting.actions import distinct_trees

    out = {}
    for temperature in temperatures:
        nearest = nearest_setting(range(len(sampling)), temperature,
                                  setting=lambda i: (sampling[i].temperature, sampling[i].top_p)) if sampling else None
        runners_up = ranking.get(nearest, []) if nearest is not None else []
        out[temperature] = distinct_trees([metadata.fallback_for(temperature, 1.0).action, *runners_up], count)
    return out


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
    from decode.models.kernel_choice import machine_identity
    from decode.pair import load_pair_config

    if stage.threads:
        import torch

        torch.set_num_threads(stage.threads)
    pair = load_pair_config(collect.pair)
    from ddte_core.paths import latency_cache

    print(pair.use_kernels(None, latency_cache()).line())  # the kernels the collection ran on, as the loop does
    prompts = encode_prompts(pair, bench_prompts(None, "prompt", stage.num_prompts, tokenizer=pair.tokenizer,
                                                 default=pair.heldout_prompts), stage.max_new_tokens)
    settings = BenchSettings(stage.max_new_tokens, stage.repeats, stage.seed)
    rows = []
    for temperature in stage.temperatures:
        methods = [AR]
        for verifier, actions in candidates.items():
            methods += [Method.static(verifier, action) for action in actions[temperature]]
            if verifier in selectors:
                methods.append(Method.selector(verifier, selectors[verifier]))
            if verifier in expanders:
                methods.append(Method.expander(verifier, expanders[verifier]))
        rows += run_bench(list(dict.fromkeys(methods)), pair, prompts, settings, [temperature])
    title = (f"{len(prompts)} held-out prompts × {stage.repeats}, {stage.max_new_tokens} new tokens, "
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


def keep_statics(rows: list[dict], candidates: dict[str, dict[float, list[str]]]) -> dict[tuple[str, float], tuple]:
    """Per (verifier, temperature): the index of the static candidate to keep and why
    (``choose_static`` in bench/compare.py)."""
    return {(verifier, temperature): choose_static(static_rows(rows, verifier, temperature, actions), actions)
            for verifier, by_temperature in candidates.items() for temperature, actions in by_temperature.items()}


def decide(rows: list[dict], candidates: dict[str, dict[float, list[str]]], metadata: dict,
           selectors: dict[str, Path], out: Path, kept: dict[tuple[str, float], tuple] | None = None,
           expanders: dict[str, Path] | None = None):
    """Per verifier and temperature: the static candidate :func:`keep_statics` keeps (computed here when ``kept`` is
    not given), or the faster of the selector (where its guard is on) and the expander (where it was benched) among
    those that beat that static beyond this bench's noise: a paired bootstrap interval over prompts wholly above 1, at
    :data:`~bench.compare.SWITCH_LEVEL` split over the rivals. A policy a few per cent ahead inside the noise is not
    deployed: the static tree it would replace cannot lose to itself."""
    from decode.policies.deployment import Choice

    kept = keep_statics(rows, candidates) if kept is None else kept
    expanders = expanders or {}
    choices = []
    for verifier, path in selectors.items():
        for temperature, actions in candidates[verifier].items():
            index, measured = kept[verifier, temperature]
            at_t = by_method(rows, temperature)
            static = at_t[Method.static(verifier, actions[index])]
            rivals = {}
            selector = at_t.get(Method.selector(verifier, path))
            if metadata[verifier].fallback_for(temperature, 1.0).margin is not None and selector is not None:
                rivals["selector"] = selector
            if verifier in expanders and Method.expander(verifier, expanders[verifier]) in at_t:
                rivals["expander"] = at_t[Method.expander(verifier, expanders[verifier])]
            ratios = {name: row["tokens_per_s"] / static["tokens_per_s"] for name, row in rivals.items()}
            level = 1 - (1 - SWITCH_LEVEL) / max(len(rivals), 1)  # Bonferroni over the rivals, as for runners-up
            intervals = {name: paired_ratio_interval(row, static, level=level) for name, row in rivals.items()}
            clear = [name for name, interval in intervals.items() if interval is not None and interval[0] > 1.0]
            policy = max(clear, key=ratios.get, default="static")
            reason = measured + "".join(f"; the {name} ran at {ratios[name]:.3f}× ({actions[index]}), "
                                        + _interval_clause(intervals[name], level) for name in rivals)
            if "selector" not in rivals:
                reason += ("; the selector's guard never leaves its fallback here (on validation prompts the selector "
                           "never beat it by the policy phase's cost), so it drafts the fallback")
            chosen = rivals[policy] if policy != "static" else static
            choices.append(Choice(
                verifier, float(temperature), 1.0, policy, actions[0] if policy == "selector" else actions[index],
                str(path.relative_to(out)) if policy == "selector" else None,
                chosen["tokens_per_s"], static["tokens_per_s"], reason,
                str(expanders[verifier].relative_to(out)) if policy == "expander" else None,
                metadata[verifier].fallback_for(temperature, 1.0).profile if policy == "static" else None,
            ))
    return choices


def _interval_clause(interval: tuple[float, float] | None, level: float) -> str:
    """How a policy's paired interval against the kept static reads: beyond this bench's noise or within it."""
    if interval is None:
        return "no interval (under two prompts): not deployable"
    verdict = "beyond this bench's noise" if interval[0] > 1.0 else "within this bench's noise"
    return f"{level:.0%} interval [{interval[0]:.3f}, {interval[1]:.3f}]: {verdict}"


def _fit_expanders(stage: ExpanderStage, out: Path, data_dir: Path, verifiers: list[str],
                   tracking: _Tracking) -> dict[str, tuple[Path, object]]:
    """Per verifier, the expander fitted on the collection and its metadata, each tracked as a child run; none when
    the stage is off or the collection has no trunk states (said in one line)."""
    from selector.expander import expander_metrics, expander_params, fit_expander, write_expander

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
