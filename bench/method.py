"""The method contract: what one bench row runs, parsed once from its text form, with one canonical spelling.

A method is ``ar`` (the target alone, HF ``generate``), ``hf-assisted`` (HF assisted generation with the same
draft), both on the stock models (every linear layer on ``F.linear``: what users have), ``ar-kernels`` and
``hf-assisted-kernels`` (the same two on the kernel paths the pair runs here, decode/models/kernels.py: ddte's own AR
on the target's kernels, and HF assisted with the same q as ddte's draft), or ``VERIFIER@SPEC``, a ddte decoder
with a policy: SPEC is a static shape ``K,L1,L2``, a named policy
(``adaptive``, ``entropy``), ``selector=FILE``, ``policy=FILE`` or ``expander=FILE``. Static shapes that draft the
same tree are one method: :meth:`Method.parse` keeps the canonical shape
(:meth:`decode.drafting.actions.Action.canonical`), so ``specinfer@1,0,2`` and ``specinfer@2,2,0`` are both
``specinfer@1,2,0``. A ddte method may name another draft for the same target, ``+draft=FOLDER``
(``traversal@2,0,1+draft=runs/distill/steered``): two drafts (a steered one and its parent, say) then compare inside
one interleaved run. The bench writes each row's method as :attr:`Method.key`; the pipeline builds its methods with
:meth:`Method.static` and :meth:`Method.selector`, and finds their rows again through :func:`by_method`, never by
spelling a string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from decode.drafting.actions import Action, check_in_grid
from decode.engine import check_action
from decode.verifiers import get_verifier

HF_KINDS = ("ar", "hf-assisted", "ar-kernels", "hf-assisted-kernels")
NAMED_POLICIES = ("adaptive", "entropy")
FILE_KINDS = ("selector", "policy", "expander")  # SPEC = KIND=FILE
DRAFT_SUFFIX = "+draft="  # a ddte method run with another draft folder
KINDS = (*HF_KINDS, "static", *NAMED_POLICIES, *FILE_KINDS)


@dataclass(frozen=True)
class Method:
    """One method. ``kind``: ``ar``, ``hf-assisted``, ``static``, a named policy, ``selector`` or ``policy``.

    ``verifier``: the ddte decoder's verifier (None for the HF kinds); ``action``: the canonical static shape
    (``static`` only); ``path``: the selector, policy or expander file (those kinds only), as given; ``draft``: a draft
    folder to run instead of the pair's (ddte kinds only), as given.
    """

    kind: str
    verifier: str | None = None
    action: Action | None = None
    path: str | None = None
    draft: str | None = None

    def __post_init__(self) -> None:
        wants = (self.kind not in HF_KINDS, self.kind == "static", self.kind in FILE_KINDS)
        has = (self.verifier is not None, self.action is not None, self.path is not None)
        if self.kind not in KINDS or wants != has or (self.draft is not None and self.kind in HF_KINDS):
            raise ValueError(f"not a method: {self!r} (a verifier for every kind but {', '.join(HF_KINDS)}, an "
                             f"action for static, a file for {' and '.join(FILE_KINDS)}, a draft for ddte kinds)")
        if self.action is not None:
            object.__setattr__(self, "action", self.action.canonical())

    @classmethod
    def parse(cls, text: str) -> Method:
        """From its text form. ValueError with one line for a bad form or a shape the verifier is not lossless on;
        KeyError naming the known verifiers for an unknown one. Files are not opened here."""
        if text in HF_KINDS:
            return cls(text)
        text, plus, draft = text.partition(DRAFT_SUFFIX)
        if plus and not draft:
            raise ValueError(f"bad method '{text}{plus}': name the draft folder after {DRAFT_SUFFIX}")
        method = cls._parse_ddte(text)
        return dataclasses.replace(method, draft=draft) if draft else method

    @classmethod
    def _parse_ddte(cls, text: str) -> Method:
        name, sep, spec = text.partition("@")
        if not sep:
            raise ValueError(f"bad method '{text}': use {', '.join(HF_KINDS)}, VERIFIER@K,L1,L2 or "
                             "VERIFIER@adaptive")
        verifier = get_verifier(name)  # KeyError names the known verifiers
        kind, eq, value = spec.partition("=")
        if eq and kind in FILE_KINDS and value:
            return cls(kind, verifier.name, path=value)
        if spec in NAMED_POLICIES:
            return cls(spec, verifier.name)
        try:
            action = Action.parse(spec)
            check_in_grid(action)
            check_action(verifier, action)
        except ValueError as err:
            raise ValueError(f"bad method '{text}': {err}") from err
        return cls("static", verifier.name, action)

    @classmethod
    def static(cls, verifier: str, action: Action | str) -> Method:
        """``VERIFIER@K,L1,L2`` (the canonical shape)."""
        return cls("static", verifier, action if isinstance(action, Action) else Action.parse(action))

    @classmethod
    def selector(cls, verifier: str, path: str | Path) -> Method:
        """``VERIFIER@selector=FILE``."""
        return cls("selector", verifier, path=str(path))

    @classmethod
    def expander(cls, verifier: str, path: str | Path) -> Method:
        """``VERIFIER@expander=FILE``."""
        return cls("expander", verifier, path=str(path))

    @classmethod
    def policy_file(cls, verifier: str, path: str | Path) -> Method:
        """``VERIFIER@policy=FILE``."""
        return cls("policy", verifier, path=str(path))

    @property
    def is_hf(self) -> bool:
        """HF ``generate`` runs it (``ar``, ``hf-assisted``): no ddte decoder, no policy."""
        return self.kind in HF_KINDS

    @property
    def on_stock_kernels(self) -> bool:
        """An HF row on the stock models (``ar``, ``hf-assisted``), not on the pair's kernel paths."""
        return self.kind in HF_KINDS[:2]

    @property
    def is_static(self) -> bool:
        return self.kind == "static"

    @property
    def spec(self) -> str | None:
        """What follows ``VERIFIER@`` (None for the HF kinds)."""
        if self.is_hf:
            return None
        if self.action is not None:
            return self.action.key
        return f"{self.kind}={self.path}" if self.path is not None else self.kind

    @property
    def key(self) -> str:
        """The canonical spelling: what a bench row's ``method`` holds."""
        if self.is_hf:
            return self.kind
        return f"{self.verifier}@{self.spec}" + (f"{DRAFT_SUFFIX}{self.draft}" if self.draft else "")

    @property
    def label(self) -> str:
        """The spelling for a figure or a metric name: a file or a draft folder reduced to its name."""
        base = f"{self.verifier}@{self.kind}={Path(self.path).name}" if self.path is not None else \
            self.kind if self.is_hf else f"{self.verifier}@{self.spec}"
        return base + (f"{DRAFT_SUFFIX}{Path(self.draft).name}" if self.draft else "")

    @property
    def group(self) -> str:
        """What a figure groups and colours rows by: the verifier, or the HF kind."""
        return self.verifier or self.kind

    def __str__(self) -> str:
        return self.key


AR = Method("ar")


def unique_methods(texts: Iterable[str]) -> tuple[list[Method], list[str]]:
    """(the methods parsed, in first-seen order, each once; the texts dropped as repeats of an earlier one)."""
    kept: dict[Method, None] = {}
    dropped: list[str] = []
    for text in texts:
        method = Method.parse(text)
        if method in kept:
            dropped.append(text)
        kept[method] = None
    return list(kept), dropped


def by_method(rows: Iterable[dict], temperature: float | None = None) -> dict[Method, dict]:
    """Bench rows by their method, each parsed once: the rows at ``temperature`` (where a method has one row), or
    every row when None (rows of one temperature)."""
    return {Method.parse(row["method"]): row for row in rows
            if temperature is None or row["temperature"] == temperature}


def static_rows(rows: Iterable[dict], verifier: str, temperature: float, actions: Iterable[str]) -> list[dict]:
    """The rows of ``verifier``'s static ``actions`` (``K,L1,L2`` keys) at ``temperature``, in their order."""
    at_t = by_method(rows, temperature)
    return [at_t[Method.static(verifier, action)] for action in actions]
