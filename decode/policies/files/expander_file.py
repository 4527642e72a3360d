"""The expander's file contract: the per-node halting rules and the acceptance head, in one ONNX file.

An expander decides the tree while the trunk is drafted (decode/policies/expander.py). At every trunk node d it
computes one *signal* from the draft's own state there and halts the trunk at the first node where
``d >= cap`` or (``d >= floor`` and ``signal < θ``); at the halting depth it drafts its terminal: stop (the single
path (1, d, 0)) or K i.i.d. branches of L2 tokens (the tree (K, d, L2)). The signals:

* a signal of the registry (decode/policies/signals.py): ``top``, the draft's top probability at the node;
  ``entropy``, minus its entropy (nats), so that higher means surer for every signal; and the trunk's earlier draws
  (``draw_q``, ``draw_logq``, ``draw_rank``, ``draw_ratio``, ``path_logq``);
* ``learned``: β̂, the acceptance head's prediction of 1 − TV(p, q) at the node from the draft's state alone;
* ``acceptance``: β̂ from an acceptance model trained on dense labels (selector/acceptance/acceptance.py), the graph's
  input then the node's own features only (``head_inputs: node``);
* ``marginal``: the marginal rule on that β̂ (decode/policies/halting.py ``marginal_gain``): what one more trunk
  token adds in expected tokens per unit of the time it adds, relative to the step's tokens per unit time if the
  trunk stopped here, with the step times of the running machine's latency table (else the fit's, ``chain_ms``);
* ``static``: no rule; the decoder drafts the configuration's ``fallback`` action every step.

The graph is the acceptance head: input ``node`` ``[batch, F]`` float32, output ``beta`` ``[batch, C]``, one column
per sampling configuration (each rule names its ``column``), with the standardisation folded into its weights. A
node's feature vector, in this order (:func:`node_feature_width`): the draft's final hidden state at the node
(``H_d``), its entropy and top probability, the depth, then the root scalars of decode.policies.features
(``SCALAR_NAMES``; the head's weights on the pass times are zero: selector/expander/expansion.py
``acceptance_scalars``).
The metadata holds one :class:`NodeRule` per sampling configuration it was fitted at, each with its fallback static
action and the cross-fitted offline figures that chose it: the never-lose guard is ``signal: static`` wherever no
rule beat the fallback offline.

:class:`ExpanderMetadata` is the one owner of the ``ddte.expander.*`` keys: the exporter (selector/expander/expander.py)
fills it and the decoder reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.features import FEATURE_SCHEMA_VERSION, SCALAR_NAMES
from decode.policies.files.guard import RuleProfile, StaticProfile
from decode.policies.files.policy_file import PolicyFileMetadata, read_props
from decode.policies.files.sampling_table import SamplingTable, static_on_machine
from decode.policies.halting import HaltingRule
from decode.policies.signals import SIGNALS as NODE_SIGNALS
from decode.policies.signals import model_signals, signal_names

INPUT_NAME = "node"
OUTPUT_NAME = "beta"
METADATA_VERSION = 1
PREFIX = "ddte.expander."
NO_RULE = "static"  # a configuration's signal where no rule beat the fallback: the fallback every step
# the head's, every per-node signal of the registry (decode/policies/signals.py), and no rule at all
SIGNALS = (*model_signals(), *signal_names(), NO_RULE)


class ExpanderFileError(ValueError):
    """An expander file that cannot be used: unreadable, not a ddte expander, or for another pair or verifier."""


def node_feature_width(draft_hidden: int, with_root: bool = True) -> int:
    """F: the draft's hidden state, entropy, top probability, depth and (``with_root``) the root scalars."""
    return int(draft_hidden) + 3 + (len(SCALAR_NAMES) if with_root else 0)


@dataclass
class NodeRule:
    """What the expander does at one sampling configuration.

    Attributes:
        temperature, top_p: the configuration it was fitted at (others use the nearest).
        signal: one of :data:`SIGNALS`; ``static`` drafts ``fallback`` every step.
        rule: the halting rule (None for ``static``).
        fallback: the best static action of the fitting data (``K,L1,L2``).
        offline: the cross-fitted offline throughput ratios to ``fallback`` that chose the signal, by signal name.
        column: the head's output column fitted at this configuration (``learned`` reads it).
        profile: what every static tree earned on the fitting roots (decode/policies/files/guard.py ``StaticProfile``):
            under the
            running machine's latency table it names that machine's fallback. None in files fitted before it.
        rule_profile: what the rule earned there (``RuleProfile``): the rule runs only where it beats that
            fallback under the running machine's table.
        chain_ms: for ``marginal``, the fit's step times of the chains (1, d, 0), d = 0..cap, at its median context
            length: used where the decoder has no latency table of its own.
    """

    temperature: float
    top_p: float
    signal: str
    fallback: str
    rule: HaltingRule | None = None
    offline: dict[str, float] = field(default_factory=dict)
    column: int = 0
    profile: dict | None = None
    rule_profile: dict | None = None
    chain_ms: list[float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rule, dict):
            self.rule = HaltingRule(**self.rule)
        if self.profile is not None:
            StaticProfile.from_dict(self.profile)  # ValueError now, not at the first generation
        if self.rule_profile is not None:
            RuleProfile.from_dict(self.rule_profile)
        if self.signal not in SIGNALS:
            raise ValueError(f"unknown signal {self.signal!r} (one of {', '.join(SIGNALS)})")
        if (self.rule is None) != (self.signal == NO_RULE):
            raise ValueError(f"signal {self.signal!r} {'needs' if self.rule is None else 'takes no'} halting rule")
        Action.parse(self.fallback)
        if self.reads_chain_ms and self.rule is not None and (self.chain_ms is None
                                                              or len(self.chain_ms) < self.rule.cap + 1):
            raise ValueError("the marginal signal needs chain_ms, the step times of chains 0..cap")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p)

    @property
    def reads_head(self) -> bool:
        """Its signal runs the file's graph (decode/policies/signals.py ``NodeSignal.reads_head``)."""
        return self.signal != NO_RULE and NODE_SIGNALS[self.signal].reads_head

    @property
    def reads_chain_ms(self) -> bool:
        """Its signal reads the step times of chains: the marginal rule."""
        return self.signal != NO_RULE and NODE_SIGNALS[self.signal].reads_chain_ms

    def on_machine(self, table: LatencyTable | None) -> tuple[Action, bool]:
        """(the static fallback, whether the rule runs) on the machine ``table`` measured: the profile's best static
        tree there, and the rule only where its profile beats it there. Without a table or profiles: the fitting
        machine's choice."""
        fallback = static_on_machine(self.fallback, self.profile, table)
        if table is None or self.profile is None or self.rule is None or self.rule_profile is None:
            return fallback, self.rule is not None
        return fallback, RuleProfile.from_dict(self.rule_profile).beats(StaticProfile.from_dict(self.profile), table)


@dataclass
class ExpanderMetadata(PolicyFileMetadata):
    """Everything a decoder needs besides the head's weights; serialised to ONNX ``metadata_props``
    (decode/policies/files/policy_file.py)."""

    PREFIX: ClassVar[str] = PREFIX
    ERROR: ClassVar[type[ValueError]] = ExpanderFileError
    NOUN: ClassVar[str] = "expander"
    MADE: ClassVar[str] = "fitted"

    verifier: str
    draft_hidden: int
    rules: list[NodeRule]
    scalar_names: list[str] = field(default_factory=lambda: list(SCALAR_NAMES))
    feature_schema: int = FEATURE_SCHEMA_VERSION
    metadata_version: int = METADATA_VERSION
    pair_fingerprint: str = ""
    data_fingerprint: str = ""
    # prompt ids whose roots fitted the head and chose the rules: a bench or an offline score must leave them out
    fit_prompts: list[str] = field(default_factory=list)
    # what the graph reads: "node+root" (the ridge head: node features and root scalars) or "node" (an acceptance
    # model: the node's hidden state, entropy, top probability and depth only)
    head_inputs: str = "node+root"
    # per rule (same order), the episodes it was fitted on without step times (decode/policies/fit/machine_fit.py
    # ``FitSet.as_dict``): a decoder with a latency table refits the rule on them; empty in files before them
    fit_sets: list[dict] = field(default_factory=list)
    min_gain: float = 0.01  # the gain over the best static tree a rule needs, cross-fitted, to run

    @property
    def reads_root(self) -> bool:
        return self.head_inputs == "node+root"

    def rule_table(self) -> SamplingTable[NodeRule]:
        """The rules by the sampling configuration they were fitted at (the others use the nearest), each with its
        static fallback (:meth:`SamplingTable.statics`)."""
        return SamplingTable.of(self.rules, "the expander", "was fitted for", static=lambda r: (r.fallback, r.profile))

    @classmethod
    def from_props(cls, props: dict[str, str], where: str = "expander") -> ExpanderMetadata:
        """Rebuild from ``metadata_props``; ExpanderFileError names what is missing or malformed."""
        if PREFIX + "rules" not in props:
            raise ExpanderFileError(f"{where}: not a ddte expander (no {PREFIX}rules in its metadata)")
        values = cls.values_from_props(props, where)  # a field added since the file was written: its default
        if values["metadata_version"] != METADATA_VERSION:
            raise ExpanderFileError(f"{where}: expander metadata version {values['metadata_version']}, this decoder "
                                    f"reads {METADATA_VERSION}")
        try:
            values["rules"] = [NodeRule(**r) for r in values["rules"]]
            meta = cls(**values)
        except (TypeError, ValueError) as err:
            raise ExpanderFileError(f"{where}: malformed metadata ({err})") from err
        if meta.head_inputs not in ("node+root", "node"):
            raise ExpanderFileError(f"{where}: head_inputs {meta.head_inputs!r}, expected 'node+root' or 'node'")
        if not meta.rules:
            raise ExpanderFileError(f"{where}: no rules")
        if meta.fit_sets and len(meta.fit_sets) != len(meta.rules):
            raise ExpanderFileError(f"{where}: {len(meta.fit_sets)} fit sets for {len(meta.rules)} rules")
        return meta

    def check_compatible(self, where: str, verifier: str, draft_hidden: int, pair_fingerprint: str | None) -> None:
        """Refuse an expander fitted for another feature schema, verifier, draft or pair."""
        self.check_schema_verifier_pair(where, verifier, pair_fingerprint)
        if self.draft_hidden != int(draft_hidden):
            raise ExpanderFileError(f"{where}: fitted on a draft of hidden size {self.draft_hidden}, this draft has "
                                    f"{draft_hidden}")


def read_expander_metadata(path) -> ExpanderMetadata:
    """The :class:`ExpanderMetadata` of an expander file, read with ``onnx`` (no inference session)."""
    return ExpanderMetadata.from_props(read_props(path), str(path))
