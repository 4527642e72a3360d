"""What every exported policy file shares: its metadata in ONNX ``metadata_props``, and the checks against the decoder.

A selector (decode/policies/files/selector_file.py) and an expander (decode/policies/files/expander_file.py) each keep a
dataclass of metadata, written as ``<prefix><field>`` = the value (strings as they are, everything else as JSON).
:class:`PolicyFileMetadata` is the one owner of that scheme and of the checks both files need before a decoder uses
them: the feature schema, the verifier and the pair. Each file adds its own fields and checks.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields
from typing import TYPE_CHECKING, Any, ClassVar

from decode.policies.features import FEATURE_SCHEMA_VERSION, SCALAR_NAMES


class PolicyFileMetadata:
    """A mix-in for a metadata dataclass with ``verifier``, ``feature_schema``, ``scalar_names`` and
    ``pair_fingerprint`` fields. Class attributes: ``PREFIX`` of its keys, ``ERROR`` (a ValueError subclass) it
    raises, ``NOUN`` ("selector", "expander") and ``MADE`` ("trained", "fitted") for its messages."""

    PREFIX: ClassVar[str]
    ERROR: ClassVar[type[ValueError]]
    NOUN: ClassVar[str]
    MADE: ClassVar[str]

    if TYPE_CHECKING:  # what the dataclass it is mixed into holds (declared for the checker only)
        __dataclass_fields__: ClassVar[dict[str, Any]]
        verifier: str
        feature_schema: int
        scalar_names: list[str]
        pair_fingerprint: str

    def to_props(self) -> dict[str, str]:
        """ONNX ``metadata_props``: every value a string; lists and dicts as JSON."""
        return {self.PREFIX + name: value if isinstance(value, str) else json.dumps(value)
                for name, value in asdict(self).items()}

    @classmethod
    def required_fields(cls) -> set[str]:
        """Fields a file must hold (default: those without a default; the others read as their default)."""
        return {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}

    @classmethod
    def values_from_props(cls, props: dict[str, str], where: str) -> dict:
        """Each field's value from ``props``; ``ERROR`` naming a required key that is missing or a value that is not
        JSON."""
        required, values = cls.required_fields(), {}
        for f in fields(cls):
            key = cls.PREFIX + f.name
            if key not in props:
                if f.name in required:
                    raise cls.ERROR(f"{where}: metadata lacks {key}")
                continue
            if f.type == "str":
                values[f.name] = props[key]
                continue
            try:
                values[f.name] = json.loads(props[key])
            except json.JSONDecodeError as err:
                raise cls.ERROR(f"{where}: metadata {key} is not JSON") from err
        return values

    def check_schema_verifier_pair(self, where: str, verifier: str, pair_fingerprint: str | None) -> None:
        """Refuse a file made on another feature schema, for another verifier, or on another pair (None: skip)."""
        if self.feature_schema != FEATURE_SCHEMA_VERSION:
            raise self.ERROR(f"{where}: feature schema {self.feature_schema}, this decoder computes "
                             f"{FEATURE_SCHEMA_VERSION}")
        if list(self.scalar_names) != list(SCALAR_NAMES):
            raise self.ERROR(f"{where}: scalar features {self.scalar_names} differ from this decoder's "
                             f"{list(SCALAR_NAMES)}")
        if self.verifier != verifier:
            raise self.ERROR(f"{where}: {self.MADE} for verifier '{self.verifier}', not '{verifier}' (one "
                             f"{self.NOUN} per verifier)")
        if pair_fingerprint is not None and self.pair_fingerprint != pair_fingerprint:
            stored = self.pair_fingerprint or "none"
            raise self.ERROR(f"{where}: {self.MADE} on another pair (fingerprint {stored[:12]}…, this pair "
                             f"{pair_fingerprint[:12]}…)")


def read_props(path) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file, read with ``onnx`` (no inference session)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}
