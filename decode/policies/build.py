"""The one builder of a policy from its spec (decode/policies/spec.py), for every command.

Every command builds its policy here, through the session builder (decode/session.py): :func:`load_policy_spec`
checks a spec against the verifier and the pair (reading its file once), before any timing; :func:`needs_latency`
says whether the machine's latency table is then measured, and :func:`reads_root_features` whether the decoder needs
a table for root features; :func:`build_policy` builds the policy source from what was read; :func:`measured_table`
reads, without a session, the sampling settings a spec's file was measured at. :func:`deployed_source` turns a policy
file's choices for one verifier (decode/policies/files/deployment.py) into one policy source
(:class:`DeployedSource`) that serves any sampling configuration: each generation starts the choice measured nearest
to its own (decode/policies/files/sampling_table.py).

What a kind reads and how it builds is its entry in decode/policies/kinds.py; the functions below it names (``build_*``,
``*_reads_root``, ``*_measured``, ``load_policy_file``) are the kinds' own, one each, so nothing here asks which kind a
spec is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decode.cost.table import LatencyTable
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import AdaptiveLengthPolicy, EntropyStopPolicy, Policy, PolicySource, StaticPolicy
from decode.policies.files import deployment as deployment_file
from decode.policies.files.deployment import Deployment
from decode.policies.files.sampling_table import SamplingTable
from decode.policies.kinds import ALWAYS, KINDS, PRICES, PolicyKind
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
    if deployment.pair_fingerprint and deployment.pair_fingerprint != pair.fingerprint():
        raise ValueError(f"{deployment.path}: measured on another pair (fingerprint "
                         f"{deployment.pair_fingerprint[:12]}…)")
    base = _folder(deployment)
    table = deployment.table(verifier)
    benched_here = machine is not None and machine.machine == deployment.source.get("machine")
    statics = table.statics(None if benched_here else machine)
    loaded: dict[tuple[str, str], PolicySource] = {}  # each file once
    sources: list[PolicySource] = []
    for choice, static in zip(table.entries, statics, strict=True):
        if choice.static:  # the tree this machine's table picks
            sources.append(StaticPolicy(static))
            continue
        if not choice.file:
            raise ValueError(f"{deployment.path}: a {choice.policy} choice without its file")
        if (choice.policy, choice.file) not in loaded:
            spec = PolicySpec.file(choice.policy, str(base / choice.file))
            loaded[choice.policy, choice.file] = _kind(spec).function("build")(spec, verifier, pair, machine)
        sources.append(loaded[choice.policy, choice.file])
    return DeployedSource(deployment, table.with_entries(sources))


def _folder(deployment: Deployment) -> Path:
    """Where a policy file's choices name their files from."""
    return deployment.path.parent if deployment.path is not None else Path.cwd()


def _kind(spec: PolicySpec) -> PolicyKind:
    return KINDS[spec.kind]


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
    """Whether the policy of ``spec`` reads the running machine's latency table (its kind's ``latency``): a selector,
    expander or policy file, whose static fallbacks and guards that table picks (decode/policies/files/guard.py);
    the shared budget, which prices every step on it (decode/policies/budget.py)."""
    return _kind(spec).latency is not None


def reads_root_features(loaded: LoadedPolicy) -> bool:
    """Whether some generation of ``loaded``'s policy may read root features, and with them the decoder's latency
    table (their pass times): a selector, an expander whose head reads the root's scalars, or a policy file with
    either among its verifier's choices. Which generation does depends on its sampling, known only when it starts
    (``Policy.start``); this says whether the decoder must hold a table before the first one."""
    return _reads_root(loaded.spec, loaded.verifier, loaded.deployment)


def _reads_root(spec: PolicySpec, verifier: str, deployment: Deployment | None = None) -> bool:
    """The kind's ``root_features``: never, always, or as its file says (the kind's ``reads_root``)."""
    entry = _kind(spec)
    if entry.reads_root is None:
        return entry.root_features == ALWAYS
    return entry.function("reads_root")(spec, verifier, deployment)


def load_policy_spec(spec: PolicySpec, pair, verifier: str, deployment: Deployment | None = None) -> LoadedPolicy:
    """Check ``spec`` against ``verifier`` and ``pair`` before any timing: a static shape the verifier is lossless on,
    a selector or expander file (schema, verifier, pair), a policy file (read once, checked whole, then its choices
    for ``verifier`` against the pair). ``deployment``: the policy file of a ``policy=FILE`` spec when the caller has
    read it already (to name its verifier before the pair loads). ValueError with one line, KeyError for an unknown
    verifier."""
    checker = get_verifier(verifier)
    check_spec_verifier(spec, checker)
    entry = _kind(spec)
    if entry.load is not None:
        return entry.function("load")(spec, pair, checker.name, deployment)
    return LoadedPolicy(spec, checker.name, entry.function("build")(spec, checker.name, pair, None))


def build_policy(spec: PolicySpec | LoadedPolicy, pair, verifier: str, latency: LatencyTable | None = None
                 ) -> PolicySource:
    """The one way a command turns a spec into the policy source for ``verifier`` on ``pair``. ``latency``: the running
    machine's table, which picks a file's fallbacks (None: each file as fitted). A :class:`LoadedPolicy` is built
    from what it read; a plain spec is checked first (:func:`load_policy_spec`)."""
    loaded = spec if isinstance(spec, LoadedPolicy) else load_policy_spec(spec, pair, verifier)
    if loaded.verifier != get_verifier(verifier).name:
        raise ValueError(f"the policy was checked for verifier '{loaded.verifier}', not '{verifier}'")
    entry = _kind(loaded.spec)
    if latency is None and entry.latency == PRICES:
        raise ValueError(f"{entry.noun} prices each step on a latency table: --latency machine or a table file, not "
                         "fitted")
    if latency is None or not needs_latency(loaded.spec):
        return loaded.checked
    if loaded.deployment is not None:
        return deployed_source(loaded.deployment, loaded.verifier, pair, latency)
    return entry.function("build")(loaded.spec, loaded.verifier, pair, latency)


def measured_table(spec: PolicySpec, verifier: str, deployment: Deployment | None = None) -> SamplingTable | None:
    """The sampling settings the file of ``spec`` was measured at, read from its metadata without a session (a
    selector's guards, an expander's rules, a policy file's choices for ``verifier``: ``deployment``, read already);
    None for a built-in policy, which holds at any setting, or a policy file without choices for ``verifier``."""
    entry = _kind(spec)
    return None if entry.measured is None else entry.function("measured")(spec, verifier, deployment)


# Each kind's own functions, named by its entry in decode/policies/kinds.py. A spec holds the fields its kind takes
# (PolicySpec refuses one without them): the asserts below only say so.

def build_static(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    assert spec.action is not None
    return StaticPolicy(spec.action)


def build_adaptive(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    assert spec.max_draft is not None
    return AdaptiveLengthPolicy(initial=min(4, spec.max_draft), maximum=spec.max_draft)


def build_entropy(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    assert spec.max_draft is not None and spec.entropy_threshold is not None
    return EntropyStopPolicy(max_length=spec.max_draft, threshold=spec.entropy_threshold)


def build_shared(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    from decode.policies.budget import SharedBudgetSource

    assert spec.max_draft is not None
    return SharedBudgetSource(latency, spec.max_draft)  # without a table only checked: build_policy needs one


def build_selector(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    """The selector file loaded and checked against ``pair``."""
    from decode.policies.selector import SelectorSource  # onnxruntime and numpy: only where a file names one

    assert spec.path is not None
    return SelectorSource.for_pair(spec.path, verifier, pair, latency)


def build_expander(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    """The expander file loaded and checked against ``pair``."""
    from decode.policies.expander import ExpanderSource  # onnxruntime and numpy: only where a file names one

    assert spec.path is not None
    return ExpanderSource.for_pair(spec.path, verifier, pair, latency)


def build_calibrated(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    """The expander file loaded and checked against ``pair``, its rules calibrated online."""
    from decode.policies.expander import ExpanderSource

    assert spec.path is not None
    return ExpanderSource.for_pair(spec.path, verifier, pair, latency, calibrate=True)


def build_policy_file(spec: PolicySpec, verifier: str, pair, latency: LatencyTable | None) -> PolicySource:
    """The policy file read and its choices for ``verifier`` built (:func:`deployed_source`)."""
    assert spec.path is not None
    return deployed_source(deployment_file.load_deployment(spec.path), verifier, pair, latency)


def load_policy_file(spec: PolicySpec, pair, verifier: str, deployment: Deployment | None) -> LoadedPolicy:
    """The policy file read once (unless the caller has: ``deployment``), checked whole, then its choices for
    ``verifier`` against the pair."""
    assert spec.path is not None
    deployment = deployment if deployment is not None else deployment_file.load_deployment(spec.path)
    return LoadedPolicy(spec, verifier, deployed_source(deployment, verifier, pair), deployment)


def expander_reads_root(spec: PolicySpec, verifier: str, deployment: Deployment | None) -> bool:
    """Whether the expander file's head reads the root's scalars (read from its metadata; the file was checked)."""
    from decode.policies.files.expander_file import read_expander_metadata

    return read_expander_metadata(spec.path).reads_root


def policy_file_reads_root(spec: PolicySpec, verifier: str, deployment: Deployment | None) -> bool:
    """Whether any of the policy file's choices for ``verifier`` reads root features (a static choice reads none)."""
    if deployment is None:
        return False
    base = _folder(deployment)
    return any(_reads_root(PolicySpec.file(choice.policy, str(base / choice.file)), verifier)
               for choice in deployment.choices_of(verifier) if choice.file)


def selector_measured(spec: PolicySpec, verifier: str, deployment: Deployment | None) -> SamplingTable:
    from decode.policies.files.selector_file import read_selector_metadata

    return read_selector_metadata(spec.path).guard_table()


def expander_measured(spec: PolicySpec, verifier: str, deployment: Deployment | None) -> SamplingTable:
    from decode.policies.files.expander_file import read_expander_metadata

    return read_expander_metadata(spec.path).rule_table()


def policy_file_measured(spec: PolicySpec, verifier: str, deployment: Deployment | None) -> SamplingTable | None:
    if deployment is not None and any(c.verifier == verifier for c in deployment.choices):
        return deployment.table(verifier)
    return None
