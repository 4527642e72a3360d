"""Typed YAML configs: a dataclass is the schema, the YAML mirrors it key for key, ``key=value`` overrides on top.

Unknown keys are errors, so a typo in a config or an override never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from ddte_core.paths import bundled

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a config schema: a dataclass


MAX_SEED = 2**63 - 1  # the largest seed torch.Generator takes


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check and convert one YAML value to its annotated type (int/float/str/bool/list[...], optionally None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        annotation = next(a for a in options if a is not type(None))
        origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            value = [value]  # a scalar override for a list key means a one-element list
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        if key.rsplit(".", 1)[-1].endswith("seed") and not 0 <= value <= MAX_SEED:  # torch takes 64-bit seeds
            raise ValueError(f"{key}: a seed in [0, {MAX_SEED}], got {value}")
        return value
    if annotation in (str, bool) and isinstance(value, annotation):
        return value
    name = getattr(annotation, '__name__', annotation)
    if value is None:  # `key=` on the command line, or `key:` with nothing after it in the file
        raise ValueError(f"{key} is empty: give a {name} value")
    raise ValueError(f"{key}: expected {name}, got {value!r}")


def build_dataclass(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Instantiate dataclass ``cls`` from a nested dict, rejecting unknown keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = build_dataclass(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, prefix + name)
    return cls(**kwargs)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML (``null``, ``[1, 2]``)."""
    if "=" not in assignment:
        raise ValueError(f"override {assignment!r} is not KEY=VALUE")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a section")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        where = getattr(err, "problem", None) or "not valid YAML"
        raise ValueError(f"override {assignment!r}: the value is not valid YAML ({where})") from err
    # YAML reads "1e-3" as a string (no dot in the mantissa); a float is what any numeric key wants.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            pass
    node[parts[-1]] = value


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping (empty for an empty file).

    Raises:
        ValueError: a missing file, text that is not UTF-8 or not valid YAML, or YAML that is not a mapping."""
    path = bundled(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text") from err
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} is not a YAML config: expected 'key: value' lines, "
                         f"got a {type(data).__name__}")
    return data


def load_yaml_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None,
                     required: tuple[str, ...] = ()) -> T:
    """Read a YAML file (or start from the defaults when ``path`` is None), apply overrides, build ``cls``.

    ``required``: top-level sections a file must hold (a file without one would run on defaults it never named)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = bundled(path)
        data = read_yaml_mapping(path)
        missing = [key for key in required if key not in data]
        if missing:
            raise ValueError(f"config file {str(path)!r} has no '{missing[0]}:' section (it needs "
                             f"{', '.join(required)})")
    for assignment in overrides or []:
        apply_override(data, assignment)
    return build_dataclass(cls, data)
