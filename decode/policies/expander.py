"""Expansion decided while drafting, at decode time: an exported expander halts the trunk node by node.

The file (decode/policies/files/expander_file.py) holds, per sampling configuration, a halting rule on one signal of the
draft's state at each trunk node (its top probability, minus its entropy, β̂ from the acceptance head in the graph, or
the marginal rule on β̂ and the machine's step times) and the static action to fall back on.
:class:`ExpanderSource` is the loaded file, with one :class:`DeployedRule` per configuration (what this machine runs
there, :func:`deploy_rule`), its entries in the file's sampling table; :meth:`ExpanderSource.start` gives each
generation the runner of its configuration: the static fallback (no features, no network) where the deployed rule
says so, else a :class:`HaltingPolicy`, which returns the rule's widest tree at
the root and answers the drafting loop's question at every trunk node.

The decision at a node reads only the draft's law and hidden state there and at the trunk's earlier nodes, its depth,
the root scalars (computed before drafting from earlier steps) and the machine's step times: a stopping time of the
draft's own draws, never the target's current outputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.delayed import TrunkNode
from decode.drafting.sampling import SamplingConfig, law_entropy
from decode.policies.base import Policy, PolicySource, RootState, StaticPolicy, StepOutcome
from decode.policies.calibration import AcceptanceCalibration
from decode.policies.files.expander_file import (
    INPUT_NAME,
    OUTPUT_NAME,
    ExpanderFileError,
    ExpanderMetadata,
    NodeRule,
    node_feature_width,
)
from decode.policies.files.guard import machine_note
from decode.policies.files.sampling_table import SamplingTable
from decode.policies.fit.machine_fit import FitSet, MachineRule, refit
from decode.policies.halting import marginal_gain
from decode.policies.onnx_session import policy_session
from decode.policies.signals import SIGNALS as NODE_SIGNALS

ExpanderError = ExpanderFileError  # the name callers catch


class AcceptanceHead:
    """The graph of an expander file: β̂ of one node's feature vector, through fixed bound buffers (no per-call
    allocation). The root scalars, where the graph reads them (``reads_root``), are written once per step
    (:meth:`set_root`), the node's own features per call."""

    def __init__(self, session, width: int, columns: int, column: int = 0, reads_root: bool = True) -> None:
        import onnxruntime as ort

        self.session, self.column, self.reads_root = session, column, reads_root
        self.input = np.zeros((1, width), dtype=np.float32)
        self.output = np.zeros((1, columns), dtype=np.float32)
        self.binding = session.io_binding()
        self.binding.bind_ortvalue_input(INPUT_NAME, ort.OrtValue.ortvalue_from_numpy(self.input))
        self.binding.bind_ortvalue_output(session.get_outputs()[0].name, ort.OrtValue.ortvalue_from_numpy(self.output))

    def set_root(self, hidden_size: int, scalars: np.ndarray) -> None:
        """The step's root scalars ``(S,)``, after the node's hidden state ``(H,)`` and its three scalars."""
        self.input[0, hidden_size + 3:] = scalars

    def __call__(self, hidden: torch.Tensor, entropy: float, top: float, depth: int) -> float:
        """β̂ for a node: its hidden state ``(H,)``, entropy, top probability and depth (root scalars as set)."""
        width = hidden.numel()
        np.copyto(self.input[0, :width], hidden.float().numpy(), casting="same_kind")
        self.input[0, width:width + 3] = (entropy, top, depth)
        self.session.run_with_iobinding(self.binding)
        return float(self.output[0, self.column])

    def at(self, column: int) -> AcceptanceHead:
        """The same session and buffers, reading ``column``."""
        head = copy.copy(self)
        head.column = column
        return head


class ExpanderSource(PolicySource):
    """A loaded expander file, checked against its verifier and pair; it serves every generation through
    :meth:`start`.

    Args:
        path: the ``.onnx`` file.
        verifier: the decoder's verifier (the rules were chosen on its labels).
        draft_hidden: the draft's hidden size.
        pair_fingerprint: the pair's fingerprint; None skips that check.
    """

    name = "expander"

    def __init__(self, path: str | Path, *, verifier: str, draft_hidden: int,
                 pair_fingerprint: str | None = None, machine: LatencyTable | None = None,
                 calibrate: bool = False) -> None:
        self.path = Path(path)
        self.name = "calibrated" if calibrate else "expander"
        self.machine = machine
        self.session = policy_session(self.path, "expander", ExpanderError)
        props = dict(self.session.get_modelmeta().custom_metadata_map)
        self.metadata = ExpanderMetadata.from_props(props, str(self.path))
        self.metadata.check_compatible(str(self.path), verifier, draft_hidden, pair_fingerprint)
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        reads_root = self.metadata.reads_root
        width, columns = node_feature_width(draft_hidden, reads_root), len(self.metadata.rules)
        if [i.name for i in inputs] != [INPUT_NAME] or inputs[0].shape[-1] != width:
            raise ExpanderError(f"{self.path}: input {[(i.name, i.shape) for i in inputs]}, expected "
                                f"{INPUT_NAME} [batch, {width}]")
        if [o.name for o in outputs] != [OUTPUT_NAME] or outputs[0].shape[-1] != columns:
            raise ExpanderError(f"{self.path}: output {[(o.name, o.shape) for o in outputs]}, expected "
                                f"{OUTPUT_NAME} [batch, {columns}]")
        self.head = AcceptanceHead(self.session, width, columns, reads_root=reads_root)
        # refitted here, not at the first generation: a bench times that one (about a second per configuration)
        table = self.metadata.rule_table()
        deployed = [deploy_rule(self.metadata, index, machine) for index in range(len(table))]
        if calibrate:  # one calibration per configuration, shared by every generation it serves
            deployed = [replace(rule, calibration=calibration_of(self.metadata, index, rule))
                        for index, rule in enumerate(deployed)]
        self.rules: SamplingTable[DeployedRule] = table.with_entries(deployed)

    @classmethod
    def for_pair(cls, path: str | Path, verifier: str, pair, machine: LatencyTable | None = None,
                 calibrate: bool = False) -> ExpanderSource:
        """The expander checked against a loaded pair (draft hidden size, fingerprint); ``machine``: the running
        machine's latency table, which picks the fallback and whether the rule runs (decode/policies/files/guard.py);
        ``calibrate``: each rule's threshold follows the acceptance its steps realize (policies/calibration.py)."""
        return cls(path, verifier=verifier, draft_hidden=int(pair.draft.config.hidden_size),
                   pair_fingerprint=pair.fingerprint(), machine=machine, calibrate=calibrate)

    def start(self, sampling: SamplingConfig) -> Policy:
        """The policy of the configuration nearest ``sampling``: its halting rule where it beats the static fallback
        on this machine, else that fallback."""
        deployed = self.deployed(sampling)
        if not deployed.runs:
            return StaticPolicy(deployed.fallback)
        node_rule = deployed.node_rule
        head = self.head.at(node_rule.column) if node_rule.reads_head else None
        return HaltingPolicy(node_rule, head, self.machine, deployed.calibration)

    def deployed(self, sampling: SamplingConfig) -> DeployedRule:
        """The rule this machine runs at the configuration nearest ``sampling``."""
        return self.rules.nearest(sampling)

    def describe(self, sampling: SamplingConfig) -> str:
        deployed = self.deployed(sampling)
        online = "" if deployed.calibration is None else f"; {deployed.calibration.describe()}"
        return f"{self.name} {self.path} ({deployed.describe(self.machine)}{online})"

    def sampling_note(self, sampling: SamplingConfig) -> str | None:
        return self.rules.note(sampling)


@dataclass(frozen=True)
class DeployedRule:
    """What a machine runs at one sampling configuration of an expander file.

    Attributes:
        node_rule: the rule (the file's, or refitted on the machine's table where the file carries its fit set).
        fallback: the static tree drafted every step where the rule does not run.
        runs: whether the rule runs.
        refit: the refit's choice and cross-fitted ratios on this machine (None where nothing was refitted).
        min_gain: the held-out gain the refit asked of a rule.
        unrefitted: a machine's table was given but the file carries no fit sets, so the rule is the file's as
            fitted elsewhere: its line says so rather than pass for a choice made here.
        calibration: the realized acceptance the rule follows online, shared by the generations of this
            configuration (None: the fitted rule as it is).
    """

    node_rule: NodeRule
    fallback: Action
    runs: bool
    refit: MachineRule | None = None
    min_gain: float = 0.0
    unrefitted: bool = False
    calibration: AcceptanceCalibration | None = None

    def describe(self, machine: LatencyTable | None) -> str:
        fallback = self.fallback.key
        if self.refit is not None:
            ratio = self.refit.ratios.get(self.refit.signal)
            gain = "" if ratio is None else f", cross-fitted {ratio:.3f}x it"
            if not self.runs or self.node_rule.rule is None:  # a refit that runs has its rule
                best = max(self.refit.ratios.values(), default=float("nan"))
                return (f"static {fallback}, refitted on this machine's latency table: no rule beat it by "
                        f"{self.min_gain:.0%} held out (best {best:.3f}x)")
            return (f"{self.node_rule.signal}: {self.node_rule.rule.describe()}; refitted on this machine's latency "
                    f"table against static {fallback}{gain}")
        where = machine_note(machine, self.node_rule.profile is not None)
        unrefitted = "; not refitted on this machine: the file carries no fit sets (ddte expander writes them)" \
            if self.unrefitted else ""
        if self.node_rule.rule is None:
            return f"static {fallback}{where}: no rule beat it where the file was fitted{unrefitted}"
        if not self.runs:
            return f"static {fallback}{where}: it beats the file's rule on this machine{unrefitted}"
        return f"{self.node_rule.signal}: {self.node_rule.rule.describe()}; fallback {fallback}{where}{unrefitted}"


def deploy_rule(metadata: ExpanderMetadata, index: int, machine: LatencyTable | None) -> DeployedRule:
    """Rule ``index`` of ``metadata`` as ``machine`` runs it: refitted on the machine's table where the file carries
    the rule's fit set (decode/policies/fit/machine_fit.py), else the file's rule behind its machine-free profiles
    (decode/policies/files/guard.py)."""
    node_rule = metadata.rules[index]
    if machine is None or not metadata.fit_sets:
        fallback, runs = node_rule.on_machine(machine)
        return DeployedRule(node_rule, fallback, runs, unrefitted=machine is not None)
    fit_set = FitSet.from_dict(metadata.fit_sets[index])
    choice = refit(fit_set, machine, metadata.min_gain)
    chain = None
    if choice.rule is not None and NODE_SIGNALS[choice.signal].reads_chain_ms:
        # the file format wants the fit's chain times; the loop reads the table's
        length = int(np.median(fit_set.lengths))
        chain = [float(t) for t in machine.step_ms_many(length, [Action(1, d, 0) for d in range(fit_set.l_max + 1)])]
    refitted = replace(node_rule, signal=choice.signal, rule=choice.rule, fallback=choice.fallback.key, chain_ms=chain)
    return DeployedRule(refitted, choice.fallback, choice.rule is not None, choice, metadata.min_gain)


def calibration_of(metadata: ExpanderMetadata, index: int, deployed: DeployedRule) -> AcceptanceCalibration | None:
    """The online calibration of a deployed threshold rule, binned on its fit set's signal at the rule's decision
    depths; None where nothing runs, the rule is the marginal one (its β̂ is the head's) or no fit set is carried."""
    rule = deployed.node_rule.rule
    if not deployed.runs or rule is None or deployed.node_rule.reads_chain_ms or not metadata.fit_sets:
        return None
    values = FitSet.from_dict(metadata.fit_sets[index]).signals.get(deployed.node_rule.signal)
    if values is None:
        return None
    return AcceptanceCalibration.around(values[..., rule.floor:rule.cap], rule.theta)


class HaltingPolicy(Policy):
    """One generation's per-node policy: a halting rule on one signal (``head`` given: a β̂ signal).

    ``choose`` keeps what the step's signals need and returns the widest tree; ``halts`` computes the node's signal
    and applies the rule. A head that reads root scalars needs root features (the decoder then computes them); every
    head needs the draft's hidden states, and nothing else. The marginal signal keeps the step's β̂ at every node it
    has met (so β̂ is computed at every node, the floor's included) and the step times of chains at the root's
    context length: from ``machine`` (the running machine's latency table) or the root's table, else the fit's."""

    decides_per_node = True
    stateful = True  # it keeps the step's root scalars and β̂ between choose and halts

    def __init__(self, node_rule: NodeRule, head: AcceptanceHead | None = None,
                 machine: LatencyTable | None = None, calibration: AcceptanceCalibration | None = None) -> None:
        if node_rule.rule is None:
            raise ValueError(f"the expander's {node_rule.signal} choice has no halting rule to run")
        self.node_rule, self.rule, self.head, self.machine = node_rule, node_rule.rule, head, machine
        self.name = f"expander:{node_rule.signal}"
        self.needs_root_features = head is not None and head.reads_root
        self.needs_draft_hidden = head is not None
        self.marginal = node_rule.reads_chain_ms
        self._betas: list[float] = []
        self._chain_ms: np.ndarray | None = None
        self._chain_cache: dict[tuple[int, int], np.ndarray] = {}
        self.calibration = None if self.marginal else calibration
        self._signals: dict[int, float] = {}  # the step's signal by trunk depth, for the calibration

    def choose(self, root: RootState) -> Action:
        if self.head is not None and self.head.reads_root:
            if root.features is None:
                raise ValueError("the learned expander needs root features (the decoder computes them when asked)")
            self.head.set_root(root.features.draft_hidden_root.numel(), root.features.scalars.numpy())
        if self.marginal:
            self._betas = []
            self._chain_ms = self.chain_ms(root.context_length, self.machine or root.latency)
        if self.calibration is not None:
            self._signals = {}
            table = self.machine or root.latency
            self._chain_ms = None if table is None else self.chain_ms(root.context_length, table)
        return self.rule.widest

    def chain_ms(self, context_length: int, table: LatencyTable | None) -> np.ndarray:
        """``(cap + 1,)`` step times of the chains (1, d, 0), d = 0..cap: ``table``'s at this context length (per
        16-token bucket, cached), else the fit's."""
        if table is None:
            if self.node_rule.chain_ms is None:
                raise ValueError("the marginal signal needs a latency table or the fit's chain_ms")
            return np.asarray(self.node_rule.chain_ms[:self.rule.cap + 1], dtype=np.float64)
        key = (id(table), context_length // 16 * 16)
        if key not in self._chain_cache:
            chains = [Action(1, d, 0) for d in range(self.rule.cap + 1)]
            self._chain_cache[key] = np.asarray(table.step_ms_many(key[1], chains), dtype=np.float64)
        return self._chain_cache[key]

    def halts(self, node: TrunkNode) -> bool:
        if self.marginal:  # β̂ at every node: the product runs over the whole trunk
            self._betas.append(self.beta(node))
            return self.rule.halts(node.depth, lambda: self.marginal_signal(node.depth))
        depth = node.depth
        if self.calibration is None or not self.rule.floor <= depth < self.rule.cap:
            return self.rule.halts(depth, lambda: self.signal(node))  # no signal where the depth decides
        signal = self._signals[depth] = self.signal(node)
        calibrated = None if self._chain_ms is None else self.calibration.halts(depth, self._signals, self._chain_ms)
        return self.rule.halts(depth, signal) if calibrated is None else calibrated

    def observe(self, outcome: StepOutcome) -> None:
        """The step's outcome into the calibration (after every tree of the step was drafted)."""
        if self.calibration is not None:
            self.calibration.record(self._signals, outcome.action.l1, outcome.accepted)

    def marginal_signal(self, depth: int) -> float:
        """The marginal rule's signal at ``depth`` (< cap) from the step's β̂ so far (decode/policies/halting.py
        ``marginal_gain``, the function the offline fit runs; β̂ past ``depth`` does not enter it)."""
        chain_ms = self._chain_ms
        if chain_ms is None:
            raise ValueError("the marginal signal reads the step's chain times, which choose() keeps")
        betas = np.asarray(self._betas[:depth + 1], dtype=np.float64)
        padded = np.pad(betas, (0, len(chain_ms) - len(betas)), mode="edge")
        return float(marginal_gain(padded, chain_ms)[depth])

    def beta(self, node: TrunkNode) -> float:
        """β̂ at ``node`` from the head."""
        if self.head is None:
            raise ValueError(f"the {self.node_rule.signal} signal reads no head")
        if node.hidden is None:
            raise ValueError("the learned expander needs the draft's hidden states (the decoder keeps them when asked)")
        return self.head(node.hidden, law_entropy(node.q), float(node.q.max()), node.depth)

    def signal(self, node: TrunkNode) -> float:
        """The rule's signal at ``node``: higher means the draft is surer there."""
        online = NODE_SIGNALS[self.node_rule.signal].online
        return self.beta(node) if online is None else online(node)  # no online form: the head reads it

    def describe(self, sampling: SamplingConfig) -> str:
        return f"expander ({self.node_rule.signal}: {self.rule.describe()})"
