"""The one builder of a policy from its spec (decode/policies/spec.py), for every command.

Every command builds its policy here, through the session builder (decode/session.py): :func:`load_policy_spec`
checks a spec against the verifier and the pair (reading its file once), before any timing; :func:`needs_latency`
says whether the machine's latency table is then measured, and :func:`reads_root_features` whether the decoder needs
a table for root features; :func:`build_policy` builds the policy source from what was read; :func:`measured_table`
reads, without a session, the sampling settings a spec's file was measured at. :func:`deployed_source` turns a policy
file's choices for one verifier (decode/policies/files/deployment.py) into one policy source
(:class:`DeployedSource`) that serves any sampling configuration: each generation starts the choice measured nearest
to its own (decode/policies/files/sampling_table.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decode.cost.table import LatencyTable
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import AdaptiveLengthPolicy, EntropyStopPolicy, Policy, PolicySource, StaticPolicy
from decode.policies.files import deployment as policy_file
from decode.policies.files.deployment import Deployment
from decode.policies.files.sampling_table import SamplingTable
from decode.policies.spec import PolicySpec, check_spec_verifier
from decode.verifiers import get_verifier


class DeployedSource(PolicySource):
    """A policy file's choices for one verifier: a generation runs the choice measured nearest to its sampling,
    started (each choice's source by the sampling configuration it was measured at)."""

    name = "policy-file"

    def __init__(self, deployment: Deployment, sources: SamplingTable[PolicySource]) -> None:
        self.deployment, self.sources = deployment, sources

    def chosen(self, sampling: SamplingConfig) -> PolicySource:
        """The policy source of the choice nearest ``sampling``."""
        return self.sources.nearest(sampling)

    def start(self, sampling: SamplingConfig) -> Policy:
        return self.chosen(sampling).start(sampling)

    def describe(self, sampling: SamplingConfig) -> str:
        return f"{self.chosen(sampling).describe(sampling)}, from {self.deployment.path}"

    def sampling_note(self, sampling: SamplingConfig) -> str | None:
        return self.sources.note(sampling)


def deployed_source(deployment: Deployment, verifier: str, pair, machine: LatencyTable | None = None
                    ) -> DeployedSource:
    """The policy source ``deployment`` chooses for ``verifier`` on ``pair``, at any sampling configuration; every
    choice's selector or expander is loaded (once per file) and checked against the pair here. ``machine``: the
    running machine's latency table, which picks every static tree and fallback where the file carries profiles
    (a static tree benched on this very machine, ``source["machine"]``, stays: a measurement beats the model)."""
    from decode.policies.expander import ExpanderSource  # onnxruntime and numpy: only where a file names one
    from decode.policies.selector import SelectorSource

    if deployment.pair_fingerprint and deployment.pair_fingerprint != pair.fingerprint():
        raise ValueError(f"{deployment.path}: measured on another pair (fingerprint "
                         f"{deployment.pair_fingerprint[:12]}…)")
    base = deployment.path.parent if deployment.path is not None else Path.cwd()
    table = deployment.table(verifier)
    benched_here = machine is not None and machine.machine == deployment.source.get("machine")
    statics = table.statics(None if benched_here else machine)
    loaded: dict[tuple[str, str], PolicySource] = {}  # each file once
    sources: list[PolicySource] = []
    for choice, static in zip(table.entries, statics, strict=True):
        if choice.policy == "static":
            sources.append(StaticPolicy(static))
            continue
        name = choice.selector if choice.policy == "selector" else choice.expander
        if not name:
            raise ValueError(f"{deployment.path}: a {choice.policy} choice without its file")
        if (choice.policy, name) not in loaded:
            kind = SelectorSource if choice.policy == "selector" else ExpanderSource
            loaded[choice.policy, name] = kind.for_pair(base / name, verifier, pair, machine)
        sources.append(loaded[choice.policy, name])
    return DeployedSource(deployment, table.with_entries(sources))


@dataclass(frozen=True)
class LoadedPolicy:
    """A spec checked against a pair and a verifier, holding what its file held: :func:`build_policy` builds from it
    without reading the file again.

    Attributes:
        spec: the policy spec (decode/policies/spec.py).
        verifier: the verifier's name.
        checked: the policy source as built without a latency table (what a ``--latency fitted`` run serves).
        deployment: the policy file a ``policy=FILE`` spec named, read and checked whole; None for the other kinds.
    """

    spec: PolicySpec
    verifier: str
    checked: PolicySource
    deployment: Deployment | None = None


def needs_latency(spec: PolicySpec) -> bool:
    """Whether the policy of ``spec`` reads the running machine's latency table: a selector, expander or policy
    file, whose static fallbacks and guards that table picks (decode/policies/files/guard.py); the shared budget, which
    prices every step on it (decode/policies/budget.py)."""
    return spec.reads_file or spec.kind == "shared"


def reads_root_features(loaded: LoadedPolicy) -> bool:
    """Whether some generation of ``loaded``'s policy may read root features, and with them the decoder's latency
    table (their pass times): a selector, an expander whose head reads the root's scalars, or a policy file with
    either among its verifier's choices. Which generation does depends on its sampling, known only when it starts
    (``Policy.start``); this says whether the decoder must hold a table before the first one."""
    if loaded.spec.kind == "selector":
        return True
    if loaded.spec.kind == "expander":
        return _expander_reads_root(loaded.spec.path)
    if loaded.deployment is None:
        return False
    base = loaded.deployment.path.parent if loaded.deployment.path is not None else Path.cwd()
    return any(choice.policy == "selector" or (choice.policy == "expander" and
                                               _expander_reads_root(base / choice.expander))
               for choice in loaded.deployment.choices_of(loaded.verifier))


def _expander_reads_root(path: str | Path) -> bool:
    """Whether the expander file's head reads the root's scalars (read from its metadata; the file was checked)."""
    from decode.policies.files.expander_file import read_expander_metadata

    return read_expander_metadata(path).reads_root


def load_policy_spec(spec: PolicySpec, pair, verifier: str, deployment: Deployment | None = None) -> LoadedPolicy:
    """Check ``spec`` against ``verifier`` and ``pair`` before any timing: a static shape the verifier is lossless on,
    a selector or expander file (schema, verifier, pair), a policy file (read once, checked whole, then its choices
    for ``verifier`` against the pair). ``deployment``: the policy file of a ``policy=FILE`` spec when the caller has
    read it already (to name its verifier before the pair loads). ValueError with one line, KeyError for an unknown
    verifier."""
    checker = get_verifier(verifier)
    check_spec_verifier(spec, checker)
    if spec.kind == "policy":
        deployment = deployment if deployment is not None else policy_file.load_deployment(spec.path)
        return LoadedPolicy(spec, checker.name, deployed_source(deployment, checker.name, pair), deployment)
    return LoadedPolicy(spec, checker.name, _policy_of(spec, checker.name, pair, None))


def build_policy(spec: PolicySpec | LoadedPolicy, pair, verifier: str, latency: LatencyTable | None = None
                 ) -> PolicySource:
    """The one way a command turns a spec into the policy source for ``verifier`` on ``pair``. ``latency``: the running
    machine's table, which picks a file's fallbacks (None: each file as fitted). A :class:`LoadedPolicy` is built
    from what it read; a plain spec is checked first (:func:`load_policy_spec`)."""
    loaded = spec if isinstance(spec, LoadedPolicy) else load_policy_spec(spec, pair, verifier)
    if loaded.verifier != get_verifier(verifier).name:
        raise ValueError(f"the policy was checked for verifier '{loaded.verifier}', not '{verifier}'")
    if latency is None and loaded.spec.kind == "shared":
        raise ValueError("the shared budget prices each step on a latency table: --latency machine or a table "
                         "file, not fitted")
    if latency is None or not needs_latency(loaded.spec):
        return loaded.checked
    if loaded.deployment is not None:
        return deployed_source(loaded.deployment, loaded.verifier, pair, latency)
    return _policy_of(loaded.spec, loaded.verifier, pair, latency)


def _policy_of(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    """A built-in policy, or a selector or expander file loaded and checked against ``pair``."""
    if spec.kind == "selector":
        from decode.policies.selector import SelectorSource  # onnxruntime and numpy: only where a file names one

        return SelectorSource.for_pair(spec.path, verifier, pair, latency)
    if spec.kind == "expander":
        from decode.policies.expander import ExpanderSource

        return ExpanderSource.for_pair(spec.path, verifier, pair, latency)
    if spec.kind == "static":
        return StaticPolicy(spec.action)
    if spec.kind == "adaptive":
        return AdaptiveLengthPolicy(initial=min(4, spec.max_draft), maximum=spec.max_draft)
    if spec.kind == "shared":
        from decode.policies.budget import SharedBudgetSource

        return SharedBudgetSource(latency, spec.max_draft)  # without a table only checked: build_policy needs one
    return EntropyStopPolicy(max_length=spec.max_draft, threshold=spec.entropy_threshold)


def measured_table(spec: PolicySpec, verifier: str, deployment: Deployment | None = None) -> SamplingTable | None:
    """The sampling settings the file of ``spec`` was measured at, read from its metadata without a session (a
    selector's guards, an expander's rules, a policy file's choices for ``verifier``: ``deployment``, read already);
    None for a built-in policy, which holds at any setting, or a policy file without choices for ``verifier``."""
    if spec.kind == "selector":
        from decode.policies.files.selector_file import read_selector_metadata

        return read_selector_metadata(spec.path).guard_table()
    if spec.kind == "expander":
        from decode.policies.files.expander_file import read_expander_metadata

        return read_expander_metadata(spec.path).rule_table()
    if spec.kind == "policy" and deployment is not None and any(c.verifier == verifier for c in deployment.choices):
        return deployment.table(verifier)
    return None
