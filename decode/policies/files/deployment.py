"""The deployment file (``policy.json``): which policy to run, per verifier and sampling configuration.

``ddte pipeline`` benches each selector and expander against the static candidates and writes this file; ``ddte
generate`` and ``ddte bench`` load it with one flag (``--policy-file``). Each choice is a static action, a selector
file or an expander file (paths relative to the policy file), with the measured ratio that justified it. This module
is the file's one reader and writer, and :func:`load_deployment` its one validator: every field is checked at load
with the rules of the matching flag. The builder (decode/policies/build.py, ``deployed_source``) turns a verifier's
choices into one policy source that serves any sampling configuration.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddte_core.paths import staged_file
from decode.drafting.actions import Action, check_in_grid
from decode.policies.files.guard import StaticProfile
from decode.policies.files.sampling_table import SamplingTable
from decode.policies.kinds import kind_names
from decode.verifiers import VERIFIERS, get_verifier, verifier_names

FORMAT = "ddte-deployment/1"
POLICY_KINDS = kind_names(lambda entry: entry.choice)  # what a choice may run (decode/policies/kinds.py)
FILE_FIELDS = kind_names(lambda entry: entry.choice and entry.file)  # a choice's file, by its kind's name
STATIC_CHOICES = kind_names(lambda entry: entry.choice and not entry.file)  # the tree itself: the static policy


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
        profile: for ``static``, what every static tree earned on the collection's roots (decode/policies/files/guard.py
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

    @property
    def static(self) -> bool:
        """A static choice: its ``action`` (re-picked from its ``profile`` on the running machine) every step."""
        return self.policy in STATIC_CHOICES

    @property
    def file(self) -> str | None:
        """The file a selector or expander choice names (relative to the policy file); None for a static choice."""
        return getattr(self, self.policy) if self.policy in FILE_FIELDS else None


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
                                static=lambda c: (c.action, c.profile if c.static else None))

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
    for name in FILE_FIELDS:
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
