"""The deployment file (``policy.json``): which policy to run, per verifier and sampling configuration.

``ddte pipeline`` benches each selector and expander against the static candidates and writes this file; ``ddte
generate`` and ``ddte bench`` load it with one flag (``--policy-file``). Each choice is a static action, a selector
file or an expander file (paths relative to the policy file), with the measured ratio that justified it. This module
is the file's one reader and writer, and :func:`load_deployment` its one validator: every field is checked at load
with the rules of the matching flag. :meth:`Deployment.policy_for` turns a verifier's choices into one policy source
(:class:`DeployedSource`) that serves any sampling configuration: each generation starts the choice measured nearest
to its own (decode/policies/sampling_table.py).

Every command builds its policy here, from a spec (decode/policies/spec.py), through the session builder
(decode/session.py): :func:`load_policy_spec` checks it against the verifier and the pair (reading its file once),
before any timing; :func:`needs_latency` says whether the machine's latency table is then measured, and
:func:`reads_root_features` whether the decoder needs a table for root features; :func:`build_policy` builds the
policy source from what was read; :func:`measured_table` reads, without a session, the sampling settings a spec's
file was measured at.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddte_core.paths import staged_file
from decode.cost.table import LatencyTable
from decode.drafting.actions import Action, check_in_grid
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import AdaptiveLengthPolicy, EntropyStopPolicy, Policy, PolicySource, StaticPolicy
from decode.policies.guard import StaticProfile
from decode.policies.sampling_table import SamplingTable
from decode.policies.spec import PolicySpec, check_spec_verifier
from decode.verifiers import VERIFIERS, get_verifier, verifier_names

FORMAT = "ddte-deployment/1"
POLICY_KINDS = ("static", "selector", "expander")


@dataclass
class Choice:
    """What to run for one verifier at one sampling configuration.

    Attributes:
        policy: ``static``, ``selector`` or ``expander``.
        action: the static action ``"K,L1,L2"`` (the selector's fallback for ``selector``, the kept static tree for
            ``expander``).
        selector: the selector file, relative to the policy file (``selector`` only).
        expander: the expander file, relative to the policy file (``expander`` only).
        tokens_per_s, static_tokens_per_s: measured in the deciding bench (same run, interleaved).
        reason: one sentence on why this policy was chosen.
        profile: for ``static``, what every static tree earned on the collection's roots (decode/policies/guard.py
            ``StaticProfile``): under the running machine's latency table it re-picks the static tree there.
    """

    verifier: str
    temperature: float
    top_p: float
    policy: str
    action: str
    selector: str | None = None
    tokens_per_s: float | None = None
    static_tokens_per_s: float | None = None
    reason: str = ""
    expander: str | None = None
    profile: dict | None = None


@dataclass
class Deployment:
    """Every choice, the verifier to use when none is named, and the pair they were measured on."""

    choices: list[Choice]
    verifier: str
    pair_fingerprint: str = ""
    source: dict = field(default_factory=dict)
    path: Path | None = None

    def choices_of(self, verifier: str) -> list[Choice]:
        """This verifier's choices, one per measured sampling configuration; ValueError when it has none."""
        mine = [c for c in self.choices if c.verifier == verifier]
        if not mine:
            known = sorted({c.verifier for c in self.choices})
            held = f"it has choices for {', '.join(known)}" if known else "it holds no choices"
            raise ValueError(f"no choice for verifier '{verifier}' ({held})")
        return mine

    def table(self, verifier: str) -> SamplingTable[Choice]:
        """This verifier's choices by the sampling configuration they were measured at (the others use the
        nearest), each static choice with its profile (:meth:`SamplingTable.statics`)."""
        return SamplingTable.of(self.choices_of(verifier), "the policy file", "has choices for",
                                static=lambda c: (c.action, c.profile if c.policy == "static" else None))

    def policy_for(self, verifier: str, pair, machine: LatencyTable | None = None) -> DeployedSource:
        """The policy source this file chooses for ``verifier`` on ``pair``, at any sampling configuration; every
        choice's selector or expander is loaded (once per file) and checked against the pair here. ``machine``: the
        running machine's latency table, which picks every static tree and fallback where the file carries profiles
        (a static tree benched on this very machine, ``source["machine"]``, stays: a measurement beats the model)."""
        from decode.policies.expander import ExpanderSource  # onnxruntime and numpy: only where a file names one
        from decode.policies.selector import SelectorSource

        if self.pair_fingerprint and self.pair_fingerprint != pair.fingerprint():
            raise ValueError(f"{self.path}: measured on another pair (fingerprint {self.pair_fingerprint[:12]}…)")
        base = self.path.parent if self.path is not None else Path.cwd()
        table = self.table(verifier)
        benched_here = machine is not None and machine.machine == self.source.get("machine")
        statics = table.statics(None if benched_here else machine)
        loaded: dict[tuple[str, str], PolicySource] = {}  # each file once
        sources: list[PolicySource] = []
        for choice, static in zip(table.entries, statics, strict=True):
            if choice.policy == "static":
                sources.append(StaticPolicy(static))
                continue
            name = choice.selector if choice.policy == "selector" else choice.expander
            if not name:
                raise ValueError(f"{self.path}: a {choice.policy} choice without its file")
            if (choice.policy, name) not in loaded:
                kind = SelectorSource if choice.policy == "selector" else ExpanderSource
                loaded[choice.policy, name] = kind.for_pair(base / name, verifier, pair, machine)
            sources.append(loaded[choice.policy, name])
        return DeployedSource(self, table.with_entries(sources))

    def check(self) -> None:
        """ValueError where a choice holds what :func:`load_deployment` would refuse (a writer's check, before it
        writes a file its readers could not load)."""
        for i, choice in enumerate(self.choices, start=1):
            check_choice(asdict(choice), f"choice {i}")

    def write(self, path: str | Path) -> Path:
        """Write whole or not at all (ddte_core.paths.staged_file)."""
        path = Path(path)
        payload = {"format": FORMAT, "verifier": self.verifier, "pair_fingerprint": self.pair_fingerprint,
                   "source": self.source, "choices": [asdict(c) for c in self.choices]}
        with staged_file(path) as tmp:
            tmp.write_text(json.dumps(payload, indent=1), encoding="utf-8")
        return path


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


def load_deployment(path: str | Path) -> Deployment:
    """Read a policy file and check it whole (:func:`check_choice`); ValueError with one line if it is missing or
    malformed, or any field holds what the matching flag would refuse."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the policy.json a pipeline wrote")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror})") from err
    except UnicodeDecodeError as err:  # an .onnx selector or expander, say: they have options of their own
        raise ValueError(f"{path}: not a ddte policy file (JSON text; a selector or expander .onnx goes to "
                         "--selector or --expander)") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg})") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a ddte policy file (format {FORMAT!r} expected)")
    verifier, fingerprint, source = data.get("verifier"), data.get("pair_fingerprint", ""), data.get("source", {})
    if not isinstance(verifier, str) or verifier not in VERIFIERS:
        raise ValueError(f"{path}: verifier must be one of {', '.join(verifier_names())}, got {verifier!r}")
    if not isinstance(fingerprint, str) or not isinstance(source, dict):
        raise ValueError(f"{path}: pair_fingerprint must be a string and source an object")
    if not isinstance(data.get("choices"), list) or not data["choices"]:
        raise ValueError(f"{path}: choices must be a non-empty list")
    choices = [check_choice(c, f"{path}: choice {i}") for i, c in enumerate(data["choices"], start=1)]
    settings = [(c.verifier, c.temperature, c.top_p) for c in choices]
    if len(set(settings)) < len(settings):
        raise ValueError(f"{path}: two choices for one verifier at one temperature and top-p")
    return Deployment(choices, get_verifier(verifier).name, fingerprint, source, path)


REQUIRED = ("verifier", "temperature", "top_p", "policy", "action")


def check_choice(entry: object, where: str) -> Choice:
    """One choice of a policy file, every field checked with the rules of the matching flag (``--verifier``,
    ``--temperature``, ``--top-p``, ``--action`` with its grid and the verifier's lossless shapes); ValueError naming
    the field, one line."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object")
    unknown, missing = sorted(set(entry) - set(Choice.__dataclass_fields__)), sorted(set(REQUIRED) - set(entry))
    if unknown or missing:
        raise ValueError(f"{where} " + "; ".join(
            part for part in (f"has unknown keys {', '.join(unknown)}" if unknown else "",
                              f"lacks {', '.join(missing)}" if missing else "") if part))
    choice = Choice(**entry)
    if not isinstance(choice.verifier, str) or choice.verifier not in VERIFIERS:
        raise ValueError(f"{where}: verifier must be one of {', '.join(verifier_names())}, got {choice.verifier!r}")
    if not _is_number(choice.temperature) or not 0 <= choice.temperature < math.inf:
        raise ValueError(f"{where}: temperature must be a finite number >= 0, got {choice.temperature!r}")
    if not _is_number(choice.top_p) or not 0 < choice.top_p <= 1:
        raise ValueError(f"{where}: top_p must be a number in (0, 1], got {choice.top_p!r}")
    if choice.policy not in POLICY_KINDS:
        raise ValueError(f"{where}: unknown policy {choice.policy!r} (one of {', '.join(POLICY_KINDS)})")
    if not isinstance(choice.action, str):
        raise ValueError(f"{where}: action must be a 'K,L1,L2' string, got {choice.action!r}")
    try:
        action = Action.parse(choice.action)
        check_in_grid(action)
        get_verifier(choice.verifier).check_action(action)
    except ValueError as err:
        raise ValueError(f"{where}: action: {err}") from err
    for name in ("selector", "expander"):
        value = getattr(choice, name)
        if choice.policy == name and (not isinstance(value, str) or not value):
            raise ValueError(f"{where}: {_a(name)} choice without its file ('{name}': a path relative to the "
                             f"policy file), got {value!r}")
        if choice.policy != name and value is not None:
            raise ValueError(f"{where}: {_a(choice.policy)} choice names {_a(name)} file, which only {_a(name)} "
                             "choice reads")
    for name in ("tokens_per_s", "static_tokens_per_s"):
        value = getattr(choice, name)
        if value is not None and (not _is_number(value) or not 0 <= value < math.inf):
            raise ValueError(f"{where}: {name} must be a finite number >= 0 or null, got {value!r}")
    if not isinstance(choice.reason, str):
        raise ValueError(f"{where}: reason must be a string, got {choice.reason!r}")
    if choice.profile is not None:
        _check_profile(choice.profile, where)
    return choice


def _check_profile(profile: object, where: str) -> None:
    """A static choice's profile: a :class:`StaticProfile` whose trees are all in the grid."""
    try:
        if not isinstance(profile, dict):
            raise ValueError("not an object")
        read = StaticProfile.from_dict(profile)
        if len(read.actions) != len(read.be) or not read.actions or not read.lengths:
            raise ValueError("its actions and be differ in length, or it holds none")
        for key in read.actions:
            check_in_grid(Action.parse(key))
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: profile is not a static profile ({err})") from err


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _is_number(value: object) -> bool:
    """A JSON number that is a real number (true and false are not; NaN is, and fails the range checks)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


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
    file, whose static fallbacks and guards that table picks (decode/policies/guard.py); the shared budget, which
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
    from decode.policies.expander_file import read_expander_metadata

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
        deployment = deployment if deployment is not None else load_deployment(spec.path)
        return LoadedPolicy(spec, checker.name, deployment.policy_for(checker.name, pair), deployment)
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
        return loaded.deployment.policy_for(loaded.verifier, pair, latency)
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
        from decode.policies.selector_file import read_selector_metadata

        return read_selector_metadata(spec.path).guard_table()
    if spec.kind == "expander":
        from decode.policies.expander_file import read_expander_metadata

        return read_expander_metadata(spec.path).rule_table()
    if spec.kind == "policy" and deployment is not None and any(c.verifier == verifier for c in deployment.choices):
        return deployment.table(verifier)
    return None
