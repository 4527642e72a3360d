"""The method contract: what one bench row runs, parsed once from its text form, with one canonical spelling.

A method is ``ar`` (the target alone, HF ``generate``), ``hf-assisted`` (HF assisted generation with the same
draft, in the dtype that runs it fastest stock here: bench/stock_draft.py), ``hf-assisted-own`` (the same with the
draft as the pair loads it), all on the stock models (every linear layer on ``F.linear``: what users have),
``ar-kernels`` and ``hf-assisted-kernels`` (AR and HF assisted on the kernel paths the pair runs here,
decode/models/kernels.py: ddte's own AR on the target's kernels, and HF assisted with the same q as ddte's draft), or
``VERIFIER@SPEC``, a ddte decoder with a policy: SPEC is a policy spec, parsed and spelled by its one owner,
decode/policies/spec.py (a static shape ``K,L1,L2``, ``adaptive``, ``entropy``, ``selector=FILE``, ``policy=FILE``
or ``expander=FILE``, with options for the named policies). What only the bench has stays here: the HF kinds and
``+draft=FOLDER``. Static shapes that draft the same tree are one method: :meth:`Method.parse` keeps the canonical shape
(:meth:`decode.drafting.actions.Action.canonical`), so ``specinfer@1,0,2`` and ``specinfer@2,2,0`` are both
``specinfer@1,2,0``. A ddte method may name another draft for the same target, ``+draft=FOLDER``
(``traversal@2,0,1+draft=runs/distill/steered``): two drafts (a steered one and its parent, say) then compare inside
one interleaved run. The bench writes each row's method as :attr:`Method.key`; the pipeline builds its methods with
:meth:`Method.static` and :meth:`Method.selector`, and finds their rows again through :func:`by_method`, never by
spelling a string.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from decode.drafting.actions import Action
from decode.policies.spec import PolicySpec, parse_verifier_spec
from decode.session import MethodRequest

STOCK_KINDS = ("ar", "hf-assisted", "hf-assisted-own")  # HF rows on the stock models
HF_KINDS = (*STOCK_KINDS, "ar-kernels", "hf-assisted-kernels")
ENGINE_KINDS = ("llama-cpp",)  # another engine's row (bench/llama_cpp.py), run only where the user names it
BASELINE_KINDS = (*HF_KINDS, *ENGINE_KINDS)  # rows without a ddte decoder
DRAFT_SUFFIX = "+draft="  # a ddte method run with another draft folder


@dataclass(frozen=True)
class Method:
    """One method: an HF kind (``hf``), or a ddte decoder (``verifier`` and ``policy``, the typed spec of
    decode/policies/spec.py) with, optionally, another ``draft`` folder to run instead of the pair's, as given."""

    hf: str | None = None
    verifier: str | None = None
    policy: PolicySpec | None = None
    draft: str | None = None

    def __post_init__(self) -> None:
        ddte = self.hf is None and self.verifier is not None and self.policy is not None
        hf = self.hf in BASELINE_KINDS and self.verifier is None and self.policy is None and self.draft is None
        if not (ddte or hf):
            raise ValueError(f"not a method: {self!r} (one of {', '.join(BASELINE_KINDS)}, or a verifier and a policy "
                             "spec, a draft for ddte methods only)")

    @classmethod
    def parse(cls, text: str) -> Method:
        """From its text form. ValueError with one line for a bad form or a shape the verifier is not lossless on;
        KeyError naming the known verifiers for an unknown one. Files are not opened here."""
        if text in BASELINE_KINDS:
            return cls(text)
        text, plus, draft = text.partition(DRAFT_SUFFIX)
        if plus and not draft:
            raise ValueError(f"bad method '{text}{plus}': name the draft folder after {DRAFT_SUFFIX}")
        if "@" not in text:
            raise ValueError(f"bad method '{text}': use {', '.join(BASELINE_KINDS)} or VERIFIER@SPEC (e.g. "
                             "traversal@2,2,4, traversal@adaptive)")
        try:
            verifier, spec = parse_verifier_spec(text)  # KeyError names the known verifiers
        except ValueError as err:
            raise ValueError(f"bad method '{text}': {err}") from err
        return cls(verifier=verifier, policy=spec, draft=draft or None)

    @classmethod
    def ddte(cls, verifier: str, spec: PolicySpec) -> Method:
        """``VERIFIER@SPEC``."""
        return cls(verifier=verifier, policy=spec)

    @classmethod
    def static(cls, verifier: str, action: Action | str) -> Method:
        """``VERIFIER@K,L1,L2`` (the canonical shape)."""
        return cls.ddte(verifier, PolicySpec.static(action))

    @classmethod
    def selector(cls, verifier: str, path: str | Path) -> Method:
        """``VERIFIER@selector=FILE``."""
        return cls.ddte(verifier, PolicySpec.file("selector", str(path)))

    @classmethod
    def expander(cls, verifier: str, path: str | Path) -> Method:
        """``VERIFIER@expander=FILE``."""
        return cls.ddte(verifier, PolicySpec.file("expander", str(path)))

    @classmethod
    def policy_file(cls, verifier: str, path: str | Path) -> Method:
        """``VERIFIER@policy=FILE``."""
        return cls.ddte(verifier, PolicySpec.file("policy", str(path)))

    @property
    def kind(self) -> str:
        """The HF kind, or the policy's kind (``static``, ``adaptive``, ``entropy``, ``selector``, ...)."""
        return self.hf if self.policy is None else self.policy.kind

    @property
    def action(self) -> Action | None:
        """The canonical static shape (static methods only)."""
        return None if self.policy is None else self.policy.action

    @property
    def path(self) -> str | None:
        """The selector, expander or policy file, as given (those kinds only)."""
        return None if self.policy is None else self.policy.path

    @property
    def request(self) -> MethodRequest:
        """What the session builder opens for a ddte method (decode/session.py); ValueError for an HF kind."""
        if self.policy is None:
            raise ValueError(f"{self.hf} runs HF's generate: no ddte session to open")
        return MethodRequest(self.verifier, self.policy, self.draft)

    @property
    def is_hf(self) -> bool:
        """A baseline row: HF ``generate`` runs it (``ar``, ``hf-assisted``, ...) or another engine (``llama-cpp``);
        no ddte decoder, no policy."""
        return self.policy is None

    @property
    def on_stock_kernels(self) -> bool:
        """An HF row on the stock models (``ar``, ``hf-assisted``, ``hf-assisted-own``), not on the pair's kernel
        paths."""
        return self.hf in STOCK_KINDS

    @property
    def is_static(self) -> bool:
        return self.kind == "static"

    @property
    def spec(self) -> str | None:
        """What follows ``VERIFIER@`` (None for the HF kinds)."""
        return None if self.policy is None else self.policy.text

    @property
    def key(self) -> str:
        """The canonical spelling: what a bench row's ``method`` holds."""
        if self.is_hf:
            return self.hf
        return f"{self.verifier}@{self.spec}" + (f"{DRAFT_SUFFIX}{self.draft}" if self.draft else "")

    @property
    def label(self) -> str:
        """The spelling for a figure or a metric name: a file or a draft folder reduced to its name."""
        base = f"{self.verifier}@{self.kind}={Path(self.path).name}" if self.path is not None else \
            self.hf if self.is_hf else f"{self.verifier}@{self.spec}"
        return base + (f"{DRAFT_SUFFIX}{Path(self.draft).name}" if self.draft else "")

    @property
    def group(self) -> str:
        """What a figure groups and colours rows by: the verifier, or the HF kind."""
        return self.verifier or self.hf

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
