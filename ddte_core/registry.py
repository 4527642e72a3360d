"""Named strategies, imported only when asked for: the registry behind the verifiers.

A registry maps a name to ``"module:attribute"``. Listing names costs nothing (no import), so ``--help`` texts and
argument checks can name every verifier without loading torch (the policy kinds, decode/policies/kinds.py, name their
functions the same way); :meth:`Registry.get` imports the one module that defines the chosen entry. Registries live
beside the interface they serve and never in a module that the registered implementations import, so no import
circle can form.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


class Registry:
    """Name -> lazily imported class or factory.

    Args:
        kind: what the entries are ("verifier", "policy"), for error messages.
        entries: name -> ``"module.path:attribute"``; names are matched case-insensitively.
    """

    def __init__(self, kind: str, entries: Mapping[str, str]) -> None:
        self.kind = kind
        self._entries = {name.lower(): target for name, target in entries.items()}

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._entries

    def get(self, name: str) -> Any:
        """The registered object (class or factory) for ``name``; KeyError listing the known names."""
        key = name.lower()
        if key not in self._entries:
            raise KeyError(f"unknown {self.kind} '{name}'; known: {', '.join(self._entries)}")
        module, _, attribute = self._entries[key].partition(":")
        return getattr(importlib.import_module(module), attribute)
