"""Fit and export an expander: per sampling configuration, the per-node halting rule that wins offline, cross-fitted.

For each sampling configuration of a schema-2 data set with trunk states,
:func:`selector.expander.expansion.evaluate_expansion` scores every signal's best rule on prompts it was not fitted on
(cross-fitted by prompt) against the best static action. The signal with the highest such ratio is kept if it beats the
static action by ``min_gain``; otherwise the configuration falls back to the static action (the never-lose guard). The
kept rule and the acceptance head are then refitted on every prompt, since the cross-fitted figure is the estimate of
what that procedure delivers on new ones.

The acceptance head is the ridge regression of selector/expander/expansion_fit.py (standardised features, closed form:
a gradient loop would only approximate it). Its graph is one affine map ``[batch, F] → [batch, C]``, with the
standardisation folded into the weights, written with ``onnx.helper``; decode/policies/files/expander_file.py owns
the file's names and metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decode.policies.files.expander_file import (
    INPUT_NAME,
    NO_RULE,
    OUTPUT_NAME,
    ExpanderMetadata,
    HaltingRule,
    NodeRule,
    node_feature_width,
)
from decode.policies.fit.machine_fit import FitSet
from decode.policies.fit.rule_fit import terminals
from decode.policies.halting import marginal_gain
from decode.policies.signals import SIGNALS
from selector.acceptance.acceptance_file import AcceptanceMetadata
from selector.expander.expansion import evaluate_expansion, load_episodes
from selector.expander.expansion_fit import (
    EpisodeData,
    _Index,
    best_rule,
    candidate_rules,
    fit_beta_head,
    out_of_fold_beta,
    rule_profile,
    static_best,
    static_profile,
)

ACCEPTANCE_SIGNALS = ("acceptance", "marginal")  # with an acceptance model (selector/acceptance/acceptance.py)


def rule_signals(data: EpisodeData, acceptance: bool) -> tuple[str, ...]:
    """The signals a rule may halt on over ``data``: every registered per-node signal it stores
    (decode/policies/signals.py), then the ridge head's ``learned`` β̂, or with an acceptance model its two."""
    return (*data.node_signals(), *(ACCEPTANCE_SIGNALS if acceptance else ("learned",)))


@dataclass
class FittedExpander:
    """What :func:`fit_expander` returns: the metadata, the head's affine map and the offline report.

    Attributes:
        weight: ``(F, C)`` and bias ``(C,)``: β̂ = node @ weight + bias, one column per sampling configuration.
        report: per configuration, the cross-fitted figures of :func:`evaluate_expansion` (ratios to static).
        graph: the acceptance model's ONNX bytes when the file embeds it (its β̂ the head), else None (the ridge).
    """

    metadata: ExpanderMetadata
    weight: np.ndarray
    bias: np.ndarray
    report: dict[str, dict]
    graph: bytes | None = None


class AcceptanceFile:
    """An exported acceptance model (selector/acceptance/acceptance_train.py) read for the offline fit: β̂ on a
    collection's trunk nodes, checked against the collection's pair and prompts.

    Raises:
        ValueError: not an acceptance model, another pair or draft, or one that saw the collection's prompts (its
            β̂ there would be in-sample and every offline figure optimistic).
    """

    def __init__(self, path: str | Path, pair_fingerprint: str, draft_hidden: int, prompts: set[str]) -> None:
        from decode.policies.onnx_session import policy_session

        self.path = Path(path)
        self.session = policy_session(self.path, "acceptance model")
        props = dict(self.session.get_modelmeta().custom_metadata_map)
        self.metadata = AcceptanceMetadata.from_props(props, str(self.path))
        self.metadata.check_for(str(self.path), pair_fingerprint, draft_hidden, prompts)
        self.width = draft_hidden + 3

    def column(self, temperature: float) -> int:
        """The output column of the temperature nearest ``temperature``."""
        return self.metadata.column(temperature)

    def beta(self, data: EpisodeData, temperature: float) -> np.ndarray:
        """``(N, s, D)`` β̂ at every trunk node of ``data``."""
        nodes = np.ascontiguousarray(data.features[..., :self.width].reshape(-1, self.width), dtype=np.float32)
        out = self.session.run(None, {INPUT_NAME: nodes})[0][:, self.column(temperature)]
        return out.reshape(data.features.shape[:-1]).astype(np.float64)

    def signals(self, data: EpisodeData, temperature: float) -> dict[str, np.ndarray]:
        """The ``acceptance`` (β̂) and ``marginal`` signals ``(N, s, D)`` on ``data`` (its T̂ the chains' times)."""
        beta = self.beta(data, temperature)
        chain = chain_times(data)
        return {"acceptance": beta, "marginal": marginal_gain(beta, chain[:, None, :])}

    def graph(self) -> bytes:
        return self.path.read_bytes()


def chain_times(data: EpisodeData) -> np.ndarray:
    """``(N, D)`` T̂ of the chains (1, d, 0), d = 0..D-1, at each root."""
    index = _Index(data.actions)
    return data.step[:, [index(1, d, 0) for d in range(data.beta.shape[-1])]]


ORACLES = ("beta", "oracle")  # figures a policy cannot reach (the exact β, hindsight): never chosen


def choose_signal(offline: dict[str, float], min_gain: float, signals=None) -> str:
    """The signal of ``signals`` (default: every one ``offline`` scores but the oracles) whose cross-fitted ratio to
    the static action is highest, if it clears ``1 + min_gain``; else ``static``."""
    signals = [name for name in offline if name not in ORACLES] if signals is None else signals
    best = max(signals, key=lambda name: offline[name])
    return best if offline[best] >= 1.0 + min_gain else "static"


def folded_head(data: EpisodeData) -> tuple[np.ndarray, float]:
    """The ridge head fitted on every node of ``data``, as one affine map on raw features: ``(F,)`` weights, bias."""
    pipeline = fit_beta_head(data)
    scaler, ridge = pipeline[0], pipeline[-1]
    weight = ridge.coef_ / scaler.scale_
    return weight, float(ridge.intercept_ - scaler.mean_ @ weight)


def fit_rule(data: EpisodeData, signal: str, l_max: int, k_max: int, extra: dict[str, np.ndarray] | None = None
             ) -> tuple[HaltingRule, np.ndarray]:
    """The best rule of the grid on every episode of ``data`` for ``signal`` (the learned one on out-of-fold β̂,
    as noisy as at decode time; one of ``extra`` as given), and the signal ``(N, s, D)`` it was chosen on."""
    values = {**data.node_signals(), **(extra or {})}.get(signal)
    if values is None:
        values = out_of_fold_beta(data)
    return best_rule(data, values, candidate_rules(values, l_max, k_max), _Index(data.actions)), values


def fit_expander(folder: str | Path, verifier: str, folds: int = 5, min_gain: float = 0.01,
                 signals=None, progress=None, acceptance: str | Path | None = None) -> FittedExpander:
    """Fit an expander for ``verifier`` on a data set (ValueError for one without trunk states or this verifier).

    ``signals``: the signals it may choose among (default: every one available; ``learned``, the ridge head, only
    without ``acceptance``, whose graph then is the file's); ``acceptance``: an acceptance model trained on other
    prompts (selector/acceptance/acceptance_train.py), which adds the ``acceptance`` and ``marginal`` signals;
    ``progress``: called with a line per sampling configuration."""
    from selector.root.root_data import data_fingerprint, inspect_dataset

    folder = Path(folder)
    metadata, episodes, _ = load_episodes(folder, verifier)
    available = rule_signals(next(iter(episodes.values())), acceptance is not None)
    signals = tuple(signals or available)
    if not signals or not set(signals) <= set(available):
        raise ValueError(f"signals must be among {', '.join(available)}, got {list(signals)}")
    prompts = {str(p) for data in episodes.values() for p in data.prompts.tolist()}
    model = None if acceptance is None else AcceptanceFile(
        acceptance, metadata["pair"]["fingerprint"], int(metadata["hidden_sizes"]["draft_hidden_root"]), prompts)
    if folds > len(prompts):  # cross-fitting by prompt: a fold per prompt at most
        raise ValueError(f"{folds} folds: the data set holds {len(prompts)} prompts; at most that many folds")
    draft_hidden = int(metadata["hidden_sizes"]["draft_hidden_root"])
    width = node_feature_width(draft_hidden)
    weight = np.zeros((width, len(episodes)), dtype=np.float64)
    bias = np.zeros(len(episodes), dtype=np.float64)
    rules, report, fit_sets = [], {}, []
    for column, (c, data) in enumerate(sorted(episodes.items())):
        if data.features.shape[-1] != width:
            raise ValueError(f"{folder}: node features are {data.features.shape[-1]} wide, expected {width}")
        weight[:, column], bias[column] = folded_head(data)
        rule, figures, fit_set = _node_rule(data, metadata, c, column, folds, min_gain, signals, model)
        rules.append(rule)
        fit_sets.append(fit_set.as_dict())
        report[f"T{rule.temperature:g}"] = figures
        if progress is not None:
            chosen = "static" if rule.rule is None else f"{rule.signal}: {rule.rule.describe()}"
            progress(f"T={rule.temperature:g}: " + ", ".join(f"{k} {v:.3f}" for k, v in rule.offline.items())
                     + f" -> {chosen} (fallback {rule.fallback})")
    meta = ExpanderMetadata(verifier, draft_hidden, rules, pair_fingerprint=metadata["pair"]["fingerprint"],
                            data_fingerprint=data_fingerprint(inspect_dataset(folder, verifier)),
                            fit_prompts=sorted(prompts), head_inputs="node" if model else "node+root",
                            fit_sets=fit_sets, min_gain=min_gain)
    return FittedExpander(meta, weight.astype(np.float32), bias.astype(np.float32), report,
                          model.graph() if model else None)


def _node_rule(data: EpisodeData, metadata: dict, config: int, column: int, folds: int, min_gain: float,
               signals, model: AcceptanceFile | None) -> tuple[NodeRule, dict, FitSet]:
    """One sampling configuration's rule: the signal whose cross-fitted rule wins by ``min_gain`` (else static),
    refitted on every episode; the cross-fitted figures that chose it; and the episodes with every signal it may
    halt on, for a decoder to refit it on its own machine (decode/policies/fit/machine_fit.py)."""
    sampling = metadata["sampling"][config]
    temperature = float(sampling["temperature"])
    l_max, k_max = int(metadata["l_max"]), int(metadata["k_max"])
    extra = model.signals(data, temperature) if model else None
    figures = evaluate_expansion(data, l_max, k_max, folds, extra=extra)
    offline = {name: float(figures[name]) for name in (*data.node_signals(), "learned", *(extra or {}), "beta",
                                                        "oracle")}
    signal = choose_signal(offline, min_gain, signals)
    rule, profile, chain = None, None, None
    if signal != NO_RULE:
        rule, values = fit_rule(data, signal, l_max, k_max, extra)
        profile = rule_profile(data, values, rule, min_gain).as_dict()
    if rule is not None and SIGNALS[signal].reads_chain_ms:
        chain = [float(t) for t in np.median(chain_times(data), axis=0)]
    head_column = model.column(temperature) if model else column
    online = {**data.node_signals(), **({"acceptance": extra["acceptance"]} if extra else {"learned": None})}
    online = {name: values for name, values in online.items() if name in signals or any(
        SIGNALS[chosen].marginal_of == name for chosen in signals if chosen in SIGNALS)}  # a β̂ its marginal rule reads
    fit_set = machine_fit_set(data, online, l_max, k_max)
    return NodeRule(temperature, float(sampling["top_p"]), signal, data.actions[static_best(data)].key, rule,
                    offline, head_column, static_profile(data).as_dict(), profile, chain), figures, fit_set


def machine_fit_set(data: EpisodeData, signals: dict[str, np.ndarray | None], l_max: int, k_max: int) -> FitSet:
    """The episodes of ``data`` a decoder refits a rule on: Ê of every tree a rule of the grid may draft, the roots'
    lengths and prompts, and each of ``signals`` ``(N, s, D)`` (None: the ridge head's out-of-fold β̂)."""
    index = _Index(data.actions)
    trees = [(k, d, l2) for d in range(l_max + 1) for k, l2 in terminals(l_max, k_max)]
    columns = sorted({index(*tree) for tree in trees})
    _, groups = np.unique(data.prompts.astype(str), return_inverse=True)
    values = {name: out_of_fold_beta(data) if v is None else v for name, v in signals.items()}
    return FitSet([data.actions[c].key for c in columns], data.be[:, :, columns], data.lengths, groups, values,
                  l_max, k_max, "steps" if data.per_step else "positions")


def write_expander(fitted: FittedExpander, path: str | Path) -> None:
    """The ONNX file: the acceptance model's graph where the fit embeds one, else ``beta = node @ weight + bias``;
    the metadata in its ``metadata_props``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if fitted.graph is not None:
        model = onnx.load_from_string(fitted.graph)
        del model.metadata_props[:]
        for key, value in fitted.metadata.to_props().items():
            model.metadata_props.add(key=key, value=value)
        onnx.save(model, str(path))
        return
    width, columns = fitted.weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", [INPUT_NAME, "weight"], ["projected"]),
         helper.make_node("Add", ["projected", "bias"], [OUTPUT_NAME])],
        "ddte_expander_head",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", columns])],
        [numpy_helper.from_array(fitted.weight, "weight"), numpy_helper.from_array(fitted.bias, "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ddte")
    model.ir_version = 8  # read by every onnxruntime this project supports
    for key, value in fitted.metadata.to_props().items():
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def expander_params(fitted: FittedExpander) -> dict[str, str]:
    """What was chosen, per sampling configuration (MLflow params)."""
    out = {"verifier": fitted.metadata.verifier}
    for rule in fitted.metadata.rules:
        tag = f"T{rule.temperature:g}"
        out[f"{tag}/signal"] = rule.signal
        out[f"{tag}/rule"] = rule.rule.describe() if rule.rule else f"static {rule.fallback}"
    return out


def expander_metrics(fitted: FittedExpander) -> dict[str, float]:
    """The cross-fitted offline ratios to the best static tree that chose each rule (MLflow metrics)."""
    return {f"T{rule.temperature:g}/offline_{name}": value
            for rule in fitted.metadata.rules for name, value in rule.offline.items()}


def log_expander(fitted: FittedExpander, path: Path, tracking_uri: str, data: str) -> str:
    """One MLflow run in the ``expander`` experiment: the chosen rules as params, the cross-fitted ratios as
    metrics, the file as an artifact; returns the run id."""
    import mlflow

    from ddte_core.tracking import artifact_location, open_store

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(open_store(tracking_uri))
    try:
        name = "expander"
        if mlflow.get_experiment_by_name(name) is None:
            mlflow.create_experiment(name, artifact_location=artifact_location(tracking_uri))
        mlflow.set_experiment(name)
        with mlflow.start_run(run_name=f"{fitted.metadata.verifier}-{Path(data).name}") as run:
            mlflow.log_params({"data": data, **expander_params(fitted)})
            mlflow.log_metrics(expander_metrics(fitted))
            mlflow.log_artifact(str(path))
            return run.info.run_id
    finally:
        mlflow.set_tracking_uri(previous)
