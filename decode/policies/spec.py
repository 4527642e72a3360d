"""The policy spec: which policy to run, typed, with its one text grammar and one canonical spelling.

A spec is what follows ``VERIFIER@`` in a bench method, ``ddte serve --method`` and what ``ddte generate``'s policy
flags amount to:

* ``K,L1,L2``: the static policy, that tree every step (kept as its canonical shape:
  :meth:`decode.drafting.actions.Action.canonical`, so ``1,0,2`` and ``2,2,0`` are both ``1,2,0``);
* ``adaptive`` or ``adaptive:max-draft=N``: HF assisted generation's +2/-1 schedule, up to N tokens (default 8);
* ``entropy`` or ``entropy:threshold=H,max-draft=N``: a single path of up to N tokens that stops where the draft's
  entropy exceeds H nats (defaults 2 and 8);
* ``shared`` or ``shared:max-draft=N``: chains of up to N tokens (default 6) whose lengths a batch decides together,
  on the machine's latency table (decode/policies/budget.py; alone, over the one request);
* ``selector=FILE``, ``expander=FILE``, ``policy=FILE``: a trained selector, a fitted expander or the policy file
  ``ddte pipeline`` writes.

Each kind's shape (a tree, a file, named options and their defaults) is its entry in decode/policies/kinds.py.
The canonical text leaves default options out, so the spellings older bench files hold (``adaptive``, ``entropy``,
``2,2,4``, ``selector=FILE``) are still the canonical ones. Files are not opened here: the builder
(decode/policies/build.py, :func:`~decode.policies.build.build_policy`) opens and checks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from decode.drafting.actions import Action, check_in_grid
from decode.policies.kinds import (
    DEFAULT_ENTROPY_THRESHOLD,
    DEFAULT_MAX_DRAFT,
    DEFAULT_SHARED_MAX_DRAFT,
    KINDS,
    SPEC_FORMS,
    kind_names,
)

FILE_KINDS = kind_names(lambda entry: entry.file)  # SPEC = KIND=FILE
NAMED_KINDS = kind_names(lambda entry: bool(entry.options))  # SPEC = KIND[:OPTION=VALUE,...]
OPTION_FIELDS = {"max-draft": ("max_draft", int), "threshold": ("entropy_threshold", float)}  # option -> field, type


def check_max_draft(value: int, name: str = "max-draft") -> None:
    """ValueError unless ``value`` is a longest draft the adaptive and entropy policies take (1 to the grid's
    longest single path); ``name``: what the message calls it (a flag, say)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    try:
        check_in_grid(Action(1, value, 0))
    except ValueError as err:
        raise ValueError(f"{name} {value}: {err}") from err


def check_entropy_threshold(value: float, name: str = "threshold") -> None:
    """ValueError unless ``value`` is a finite number of nats > 0; ``name``: what the message calls it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class PolicySpec:
    """One policy, typed. ``kind``: a kind of decode/policies/kinds.py (``KINDS``); ``action``: the canonical tree
    (``static`` only); ``path``: the file as given (the file kinds only); ``max_draft``: the longest draft
    (``adaptive``, ``entropy``, ``shared``); ``entropy_threshold``: nats (``entropy`` only). Options a kind does not
    take are None."""

    kind: str
    action: Action | None = None
    path: str | None = None
    max_draft: int | None = None
    entropy_threshold: float | None = None

    def __post_init__(self) -> None:
        entry = KINDS.get(self.kind) if isinstance(self.kind, str) else None
        wants = entry and (entry.action, entry.file, "max-draft" in entry.options, "threshold" in entry.options)
        has = (self.action is not None, bool(self.path), self.max_draft is not None,
               self.entropy_threshold is not None)
        if entry is None or wants != has:
            raise ValueError(f"not a policy spec: {self!r} (an action for static, a file for "
                             f"{', '.join(FILE_KINDS)}, a longest draft for adaptive and entropy, a threshold for "
                             "entropy)")
        if self.action is not None:
            object.__setattr__(self, "action", self.action.canonical())
        if self.max_draft is not None:
            check_max_draft(self.max_draft)
        if self.entropy_threshold is not None:
            check_entropy_threshold(self.entropy_threshold)
            object.__setattr__(self, "entropy_threshold", float(self.entropy_threshold))

    @classmethod
    def static(cls, action: Action | str) -> PolicySpec:
        return cls("static", action if isinstance(action, Action) else Action.parse(action))

    @classmethod
    def adaptive(cls, max_draft: int = DEFAULT_MAX_DRAFT) -> PolicySpec:
        return cls("adaptive", max_draft=max_draft)

    @classmethod
    def entropy(cls, threshold: float = DEFAULT_ENTROPY_THRESHOLD, max_draft: int = DEFAULT_MAX_DRAFT) -> PolicySpec:
        return cls("entropy", max_draft=max_draft, entropy_threshold=threshold)

    @classmethod
    def shared(cls, max_draft: int = DEFAULT_SHARED_MAX_DRAFT) -> PolicySpec:
        return cls("shared", max_draft=max_draft)

    @classmethod
    def file(cls, kind: str, path: str) -> PolicySpec:
        """``selector=FILE``, ``expander=FILE`` or ``policy=FILE``."""
        return cls(kind, path=str(path))

    @property
    def reads_file(self) -> bool:
        """A selector, expander or policy file: the builder opens it and checks it against the pair."""
        return KINDS[self.kind].file

    def check_file(self) -> None:
        """ValueError where this spec's file (a file kind's) is no readable file: a question of the path alone,
        asked before any model loads, in the words the builder would use after."""
        import os

        if self.path is None:
            return
        if os.path.isdir(self.path):
            raise ValueError(f"{self.kind} file {self.path!r} is a folder; give the file")
        if not os.path.isfile(self.path):
            raise ValueError(f"{self.kind} file {self.path!r} does not exist")
        if not os.access(self.path, os.R_OK):
            raise ValueError(f"{self.kind} file {self.path!r} is not readable")

    @property
    def text(self) -> str:
        """The canonical spelling (default options left out); :func:`parse_policy_spec` reads it back."""
        if self.action is not None:
            return self.action.key
        if self.path is not None:
            return f"{self.kind}={self.path}"
        entry = KINDS[self.kind]
        values = {option: getattr(self, OPTION_FIELDS[option][0]) for option in entry.options}
        options = [f"{name}={_shortest(value)}" for name, value in values.items() if value != entry.defaults[name]]
        return self.kind + (":" + ",".join(options) if options else "")

    def __str__(self) -> str:
        return self.text


def parse_policy_spec(text: str) -> PolicySpec:
    """The spec from its text form (module docstring); ValueError with one line for anything else (callers name the
    flag or method it came from). The action grid
    bounds static shapes and longest drafts; whether a verifier is lossless on a shape is the caller's check
    (:func:`check_spec_verifier`)."""
    name, eq, value = text.partition("=")
    if eq and name in FILE_KINDS:
        if not value:
            raise ValueError(f"name the file after {name}=")
        return PolicySpec.file(name, value)
    name, colon, options = text.partition(":")
    if name in NAMED_KINDS:
        return _parse_named(name, options if colon else None)
    try:
        action = Action.parse(text)
        check_in_grid(action)
    except ValueError as err:
        if "," not in text:
            raise ValueError(f"'{text}' is not a policy: use {SPEC_FORMS}") from err
        raise
    return PolicySpec.static(action)


def _parse_named(name: str, options: str | None) -> PolicySpec:
    """A kind with named options and its ``:NAME=VALUE,...`` options (None: none given)."""
    allowed = KINDS[name].options
    values: dict[str, str] = {}
    for item in [] if options is None else options.split(","):
        key, eq, value = item.partition("=")
        if key not in allowed or not eq or not value:
            raise ValueError(f"{name} takes {', '.join(f'{o}=VALUE' for o in allowed)}, got '{item}'")
        if key in values:
            raise ValueError(f"{name}: {key} is given twice")
        values[key] = value
    typed: dict[str, Any] = {}  # field name -> value, each of its option's type
    for option in (option for option in OPTION_FIELDS if option in allowed):  # max-draft's refusal first
        field_name, kind = OPTION_FIELDS[option]
        typed[field_name] = _number(values.get(option, str(KINDS[name].defaults[option])), option, kind)
    return PolicySpec(name, **typed)


def _shortest(value: float) -> str:
    """``value`` as short as it reads back exactly (``1.5``, ``6``, ``0.123456789``)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _number(value: str, key: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got '{value}'") from None


def check_spec_verifier(spec: PolicySpec, verifier) -> None:
    """ValueError when ``verifier`` is not lossless on a static spec's trees (the other kinds draft single paths, or
    their files are checked when they load)."""
    if spec.action is not None:
        verifier.check_action(spec.action)


def parse_verifier_spec(text: str) -> tuple[str, PolicySpec]:
    """``VERIFIER@SPEC`` (a bench method's ddte form, ``ddte serve --method``): the verifier's own name and the spec,
    checked together. KeyError naming the known verifiers for an unknown one; ValueError with one line otherwise."""
    from decode.verifiers import get_verifier

    name, sep, spec_text = text.partition("@")
    if not sep:
        raise ValueError(f"'{text}' is not VERIFIER@SPEC, SPEC one of {SPEC_FORMS}")
    verifier = get_verifier(name)  # KeyError names the known verifiers
    spec = parse_policy_spec(spec_text)
    check_spec_verifier(spec, verifier)
    return verifier.name, spec
