"""Policy kinds, each declared once: how a spec spells it, what it reads, and how it builds.

:data:`KINDS` holds one :class:`PolicyKind` per kind, in the order help texts list them. The spec grammar
(decode/policies/spec.py) reads a kind's shape from its entry (a tree, a file, named options with their defaults);
the builder (decode/policies/build.py) asks it what the policy reads (root features, the draft's hidden states, the
running machine's latency table) and calls its functions to check, build and describe it; a policy file's choice
(decode/policies/files/deployment.py) may name the kinds marked ``choice``. Adding a kind is one entry here and its
functions.

The functions are named ``"module:function"`` and imported only when called, so listing kinds imports neither torch
nor onnxruntime (``ddte generate --help`` names them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

DEFAULT_MAX_DRAFT = 8
DEFAULT_SHARED_MAX_DRAFT = 6
DEFAULT_ENTROPY_THRESHOLD = 2.0
OPTION_VALUES = {"max-draft": "N", "threshold": "H"}  # the value each option's form names
NEVER, ALWAYS, FROM_FILE = "never", "always", "from its file"  # what a kind reads from the decoder
PICKS, PRICES = "picks its fallbacks", "prices every step"  # what a kind does with the machine's latency table
BUILD = "decode.policies.build"


@dataclass(frozen=True)
class PolicyKind:
    """One policy kind.

    Attributes:
        name: how a spec names it (``NAME``, ``NAME:OPTIONS`` or ``NAME=FILE``; the tree ``K,L1,L2`` for static).
        summary: one line for help texts.
        build: ``"module:function"`` of ``(spec, verifier, pair, latency table or None) -> PolicySource``.
        action: its spec is a tree shape (``K,L1,L2``).
        file: its spec names a file (``NAME=FILE``), which the builder opens and checks against the pair.
        options: its named options (``NAME:OPTION=VALUE,...``), in canonical order; ``defaults`` their values.
        root_features, draft_hidden: whether its runners read the root features (and with them the decoder's latency
            table) and the draft's hidden states: :data:`NEVER`, :data:`ALWAYS` or :data:`FROM_FILE` (its file says:
            ``reads_root`` for the root features; a runner declares both on its class).
        latency: what it does with the running machine's latency table: None (nothing), :data:`PICKS` (its file's
            static trees and guards are re-picked on it; without one each file runs as fitted) or :data:`PRICES` (it
            prices every step on it, and cannot run without one).
        reads_root: ``"module:function"`` of ``(spec, verifier, deployment) -> bool`` where ``root_features`` is
            :data:`FROM_FILE`.
        load: ``"module:function"`` of ``(spec, pair, verifier, deployment) -> LoadedPolicy`` where checking the spec
            reads more than building it does (a policy file, read once); None: the spec built without a table.
        measured: ``"module:function"`` of ``(spec, verifier, deployment) -> SamplingTable | None``, the sampling
            settings its file was measured at; None: a built-in policy, which holds at any setting.
        choice: a policy file's choice may run it.
        noun: how refusals name it ("" : ``the NAME policy``).
    """

    name: str
    summary: str
    build: str
    action: bool = False
    file: bool = False
    options: tuple[str, ...] = ()
    defaults: Mapping[str, int | float] = field(default_factory=dict)
    root_features: str = NEVER
    draft_hidden: str = NEVER
    latency: str | None = None
    reads_root: str | None = None
    load: str | None = None
    measured: str | None = None
    choice: bool = False
    noun: str = ""

    @property
    def form(self) -> str:
        """How a spec spells it, for help texts and refusals."""
        if self.action:
            return "K,L1,L2"
        if self.file:
            return f"{self.name}=FILE"
        if not self.options:
            return self.name
        return f"{self.name}[:{','.join(f'{o}={OPTION_VALUES[o]}' for o in self.options)}]"

    def __post_init__(self) -> None:
        if not self.noun:
            object.__setattr__(self, "noun", f"the {self.name} policy")

    @property
    def built_in(self) -> bool:
        """It holds nothing to load and reads no table: its own source (decode/policies/base.py)."""
        return not self.file and self.latency is None

    def function(self, attribute: str) -> Callable:
        """The function an attribute names (``build``, ``reads_root``, ``load``, ``measured``), imported now."""
        module, _, name = getattr(self, attribute).partition(":")
        return getattr(importlib.import_module(module), name)


KINDS: dict[str, PolicyKind] = {
    entry.name: entry
    for entry in (
        PolicyKind("static", "the same tree every step", f"{BUILD}:build_static", action=True, choice=True),
        PolicyKind("adaptive", "HF assisted generation's +2/-1 schedule on a single path", f"{BUILD}:build_adaptive",
                   options=("max-draft",), defaults={"max-draft": DEFAULT_MAX_DRAFT}),
        PolicyKind("entropy", "a single path that stops where the draft's entropy exceeds a threshold",
                   f"{BUILD}:build_entropy", options=("threshold", "max-draft"),
                   defaults={"threshold": DEFAULT_ENTROPY_THRESHOLD, "max-draft": DEFAULT_MAX_DRAFT}),
        PolicyKind("shared", "one chain length a batch decides together on the latency table (decode/policies/"
                   "budget.py)", f"{BUILD}:build_shared", options=("max-draft",),
                   defaults={"max-draft": DEFAULT_SHARED_MAX_DRAFT}, latency=PRICES, noun="the shared budget"),
        PolicyKind("selector", "a trained selector picks the tree at every root", f"{BUILD}:build_selector",
                   file=True, root_features=ALWAYS, latency=PICKS, measured=f"{BUILD}:selector_measured",
                   choice=True),
        PolicyKind("expander", "a fitted expander halts the trunk node by node", f"{BUILD}:build_expander",
                   file=True, root_features=FROM_FILE, draft_hidden=FROM_FILE, latency=PICKS,
                   reads_root=f"{BUILD}:expander_reads_root", measured=f"{BUILD}:expander_measured", choice=True),
        PolicyKind("calibrated", "an expander file whose threshold follows the acceptance its steps realize "
                   "(decode/policies/calibration.py)", f"{BUILD}:build_calibrated", file=True, root_features=FROM_FILE,
                   draft_hidden=FROM_FILE, latency=PICKS, reads_root=f"{BUILD}:expander_reads_root",
                   measured=f"{BUILD}:expander_measured", noun="the calibrated expander"),
        PolicyKind("policy", "the policy file ddte pipeline writes: a choice per verifier and sampling",
                   f"{BUILD}:build_policy_file", file=True, root_features=FROM_FILE, draft_hidden=FROM_FILE,
                   latency=PICKS, reads_root=f"{BUILD}:policy_file_reads_root", load=f"{BUILD}:load_policy_file",
                   measured=f"{BUILD}:policy_file_measured"),
    )
}
SPEC_FORMS = ", ".join(entry.form for entry in list(KINDS.values())[:-1]) + " or " + list(KINDS.values())[-1].form


def kind_names(where: Callable[[PolicyKind], bool] = lambda entry: True) -> tuple[str, ...]:
    """The kinds ``where`` holds for, in registry order."""
    return tuple(name for name, entry in KINDS.items() if where(entry))
