"""The exported selector's file contract: ONNX input and output names and the metadata, written and read here only.

After nanoGPT's config-in-the-checkpoint: :class:`SelectorMetadata` is one dataclass that the exporter
(``selector/root/export.py``) fills and serialises with :meth:`SelectorMetadata.to_props`, and that the decoder
(``decode/policies/selector.py``) rebuilds with :meth:`SelectorMetadata.from_props` and checks against its pair. No
other module spells a ``ddte.*`` key.

Inputs, float32 with a dynamic batch axis: the three hidden blocks of :data:`decode.policies.features.HIDDEN_NAMES` and
the RAW scalar vector (standardisation is inside the graph). Output ``scores`` ``[batch, A]``, one per action in
``actions`` order: π(a | root) for the ``policy`` objective, predicted Ê[τ+1] for ``be``.

The never-lose guard (metadata version 2): per sampling configuration, a ``fallback`` action (the best static
action of the training split) and a ``margin`` fitted on validation prompts. The decoder leaves the fallback only
where the decision value of the best action exceeds the fallback's by more than the margin (relative). A margin of
``null`` (JSON) means the selector never beat its fallback on validation: the decoder then drafts the fallback
without computing features or calling the network.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

from decode.policies.features import FEATURE_SCHEMA_VERSION, HIDDEN_NAMES, SCALAR_NAMES
from decode.policies.files.guard import StaticProfile
from decode.policies.files.policy_file import PolicyFileMetadata, read_props
from decode.policies.files.sampling_table import SamplingTable

INPUT_NAMES = (*HIDDEN_NAMES, "scalars")
OUTPUT_NAME = "scores"
METADATA_VERSION = 2  # 1: files written before the never-lose guard (no fallback or margin)
PREFIX = "ddte."
OPTIONAL_FIELDS = ("fit_prompts",)  # provenance added within metadata version 2; older files read as empty
OBJECTIVES = {"policy": ("argmax", "probability"), "be": ("throughput", "expected_block_efficiency")}


class SelectorFileError(ValueError):
    """A selector file that cannot be used: unreadable, not a ddte selector, or for another pair or schema."""


@dataclass
class Fallback:
    """The guard of one sampling configuration: the static action and the relative margin needed to leave it.

    ``margin`` None: never leave the fallback (the selector did not beat it on validation prompts). ``profile``:
    what every static tree earned on the training roots (decode/policies/files/guard.py ``StaticProfile``), so that the
    running machine's latency table picks the fallback; None in files written before it (then ``action`` is used).
    """

    temperature: float
    top_p: float
    action: str
    margin: float | None
    profile: dict | None = None


@dataclass
class SelectorMetadata(PolicyFileMetadata):
    """Everything a decoder needs besides the weights; serialised to ONNX ``metadata_props`` as ``ddte.<field>``
    (decode/policies/files/policy_file.py)."""

    PREFIX: ClassVar[str] = PREFIX
    ERROR: ClassVar[type[ValueError]] = SelectorFileError
    NOUN: ClassVar[str] = "selector"
    MADE: ClassVar[str] = "trained"

    actions: list[str]
    hidden_sizes: dict[str, int]
    verifier: str
    objective: str
    normalisation: dict
    invalid_score: float
    fallbacks: list[Fallback] = field(default_factory=list)
    scalar_names: list[str] = field(default_factory=lambda: list(SCALAR_NAMES))
    feature_schema: int = FEATURE_SCHEMA_VERSION
    metadata_version: int = METADATA_VERSION
    pair_fingerprint: str = ""
    data_fingerprint: str = ""
    run_id: str = ""
    # prompt ids of the training data set whose roots trained or validated the network or fitted its guard: an
    # offline score of this file (`ddte analyze --selector`) leaves their roots out
    fit_prompts: list[str] = field(default_factory=list)

    @property
    def decision(self) -> str:
        """``argmax`` of the scores (policy) or ``throughput``: argmax of scores / T̂ (be)."""
        return OBJECTIVES[self.objective][0]

    @property
    def output(self) -> str:
        return OBJECTIVES[self.objective][1]

    def guard_table(self) -> SamplingTable[Fallback]:
        """The guards by the sampling configuration they were fitted at (the others use the nearest), each with its
        static fallback (:meth:`SamplingTable.statics`)."""
        if not self.fallbacks:
            raise SelectorFileError("the selector has no fallback action")
        return SamplingTable.of(self.fallbacks, "the selector", "was trained for",
                                static=lambda f: (f.action, f.profile))

    def to_props(self) -> dict[str, str]:
        """ONNX ``metadata_props``, with the derived decision and output written for readers of the file."""
        return {**super().to_props(), PREFIX + "decision": self.decision, PREFIX + "output": self.output}

    @classmethod
    def required_fields(cls) -> set[str]:
        """Every non-string field but the provenance added within version 2 (strings missing fail as malformed)."""
        return {f.name for f in fields(cls) if f.type != "str" and f.name not in OPTIONAL_FIELDS}

    @classmethod
    def from_props(cls, props: dict[str, str], where: str = "selector") -> SelectorMetadata:
        """Rebuild from ``metadata_props``; SelectorFileError names what is missing or malformed."""
        if PREFIX + "actions" not in props:
            raise SelectorFileError(f"{where}: not a ddte selector (no {PREFIX}actions in its metadata)")
        version = _json(props, "metadata_version", where) if PREFIX + "metadata_version" in props else 1
        if version != METADATA_VERSION:
            raise SelectorFileError(
                f"{where}: selector metadata version {version}, this decoder reads {METADATA_VERSION} "
                "(files written before the never-lose guard carry no fallback action: retrain and re-export, "
                "`ddte train` then `ddte export`)"
            )
        values = cls.values_from_props(props, where)
        try:
            values["fallbacks"] = [Fallback(**f) for f in values["fallbacks"]]
            meta = cls(**values)
        except TypeError as err:
            raise SelectorFileError(f"{where}: malformed metadata ({err})") from err
        if meta.objective not in OBJECTIVES:
            raise SelectorFileError(f"{where}: unknown objective {meta.objective!r}")
        return meta

    def check_compatible(self, where: str, verifier: str, hidden_sizes: dict[str, int],
                         pair_fingerprint: str | None) -> None:
        """Refuse a selector made for another feature schema, pair, verifier or hidden sizes."""
        self.check_schema_verifier_pair(where, verifier, pair_fingerprint)
        if dict(self.hidden_sizes) != dict(hidden_sizes):
            raise SelectorFileError(f"{where}: trained on hidden sizes {self.hidden_sizes}, but this pair has "
                                    f"{dict(hidden_sizes)}")
        for fallback in self.fallbacks:
            if fallback.action not in self.actions:
                raise SelectorFileError(f"{where}: fallback action {fallback.action} is not one of its actions")
            if fallback.margin is not None and not (math.isfinite(fallback.margin) and fallback.margin >= 0):
                raise SelectorFileError(f"{where}: bad margin {fallback.margin!r}")
            if fallback.profile is not None:
                try:
                    profile = StaticProfile.from_dict(fallback.profile)
                except ValueError as err:
                    raise SelectorFileError(f"{where}: {err}") from err
                if not set(profile.actions) <= set(self.actions):
                    raise SelectorFileError(f"{where}: its static profile names actions it does not have")


def _json(props: dict[str, str], name: str, where: str):
    try:
        return json.loads(props[PREFIX + name])
    except (KeyError, json.JSONDecodeError) as err:
        raise SelectorFileError(f"{where}: metadata {PREFIX}{name} is missing or not JSON") from err


def read_selector_metadata(path) -> SelectorMetadata:
    """The :class:`SelectorMetadata` of an exported selector, read with ``onnx`` (no inference session)."""
    return SelectorMetadata.from_props(read_props(path), str(path))
