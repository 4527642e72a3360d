"""What a policy file measured at some sampling settings, and how every other setting is served: one table.

A selector's guards, an expander's rules, a policy file's choices and an acceptance model's columns were each
measured at a few sampling settings (temperature, top-p); a generation at any other setting takes the entry measured
nearest (nearest temperature first, then nearest top-p). :class:`SamplingTable` is the one owner of that rule, of the
list of measured settings, of the line that says a nearest entry stands in (:meth:`SamplingTable.note`), and of the
static tree an entry falls back on, re-picked under the running machine's latency table where the entry carries its
static profile (:meth:`SamplingTable.statics`, :func:`static_on_machine`; decode/policies/files/guard.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from decode.cost.table import LatencyTable
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.files.guard import StaticProfile

T = TypeVar("T")
U = TypeVar("U")


class Measured(Protocol):
    """An entry that carries the sampling setting it was measured at."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_p(self) -> float: ...


M = TypeVar("M", bound=Measured)


def static_on_machine(action: str, profile: dict | None, machine: LatencyTable | None,
                      among: Sequence[Action] | None = None) -> Action:
    """The static tree an entry falls back on, on the machine ``machine`` measured: its profile's best tree there
    (``among``: only these actions); without a table or a profile, ``action``, the fitting machine's choice."""
    if machine is None or profile is None:
        return Action.parse(action)
    return StaticProfile.from_dict(profile).best(machine, among=among)


class SamplingTable(Generic[T]):
    """Entries measured at sampling settings; every other setting is served by the nearest.

    Args:
        entries: ``(setting, entry)`` pairs, at least one.
        noun, verb: how :meth:`note` names what was measured ("the selector", "was trained for").
        static: reads an entry's static fallback, ``(action text, static profile or None)``, for :meth:`statics`.
    """

    def __init__(self, entries: Sequence[tuple[SamplingConfig, T]], noun: str = "it", verb: str = "was measured at",
                 static: Callable[[T], tuple[str, dict | None]] | None = None) -> None:
        if not entries:
            raise ValueError(f"{noun} holds no sampling setting")
        self.settings = [setting for setting, _ in entries]
        self.entries = [entry for _, entry in entries]
        self.noun, self.verb, self._static = noun, verb, static

    @staticmethod
    def of(items: Sequence[M], noun: str = "it", verb: str = "was measured at",
           static: Callable[[M], tuple[str, dict | None]] | None = None) -> SamplingTable[M]:
        """A table of items that carry their own ``temperature`` and ``top_p``."""
        return SamplingTable([(SamplingConfig(item.temperature, item.top_p), item) for item in items], noun, verb,
                             static)

    @staticmethod
    def of_temperatures(temperatures: Sequence[float], noun: str = "it") -> SamplingTable[int]:
        """Column numbers by temperature (top-p 1): an output column per temperature."""
        return SamplingTable([(SamplingConfig(float(t)), i) for i, t in enumerate(temperatures)], noun)

    def with_entries(self, entries: Sequence[U]) -> SamplingTable[U]:
        """The same settings and names holding ``entries`` (one per setting, in order)."""
        if len(entries) != len(self.settings):
            raise ValueError(f"{len(entries)} entries for {len(self.settings)} sampling settings")
        return SamplingTable(list(zip(self.settings, entries, strict=True)), self.noun, self.verb)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[SamplingConfig, T]]:
        return iter(zip(self.settings, self.entries, strict=True))

    def index(self, sampling: SamplingConfig) -> int:
        """The position of the setting nearest ``sampling``: nearest temperature first, then nearest top-p."""
        return min(range(len(self.settings)), key=lambda i: (abs(self.settings[i].temperature - sampling.temperature),
                                                             abs(self.settings[i].top_p - sampling.top_p)))

    def nearest(self, sampling: SamplingConfig) -> T:
        """The entry measured nearest ``sampling``."""
        return self.entries[self.index(sampling)]

    def measured(self) -> list[SamplingConfig]:
        """The settings the entries were measured at."""
        return list(self.settings)

    def note(self, sampling: SamplingConfig, noun: str | None = None) -> str | None:
        """The line saying that an entry measured at another setting stands in for ``sampling``; None when one was
        measured there. ``noun`` names what was measured instead of the table's own noun (a bench's method label)."""
        def at(m: SamplingConfig) -> bool:
            return abs(m.temperature - sampling.temperature) < 1e-6 and abs(m.top_p - sampling.top_p) < 1e-6

        if any(at(m) for m in self.settings):
            return None
        near = self.settings[self.index(sampling)]
        listed = ", ".join(f"T={t:g} top-p={p:g}" for t, p in sorted({(m.temperature, m.top_p) for m in self.settings}))
        return (f"note: {noun or self.noun} {self.verb} {listed}; T={sampling.temperature:g} "
                f"top-p={sampling.top_p:g} uses the nearest, T={near.temperature:g} top-p={near.top_p:g}")

    def statics(self, machine: LatencyTable | None, among: Sequence[Action] | None = None) -> list[Action]:
        """Each entry's static fallback on the machine ``machine`` measured (:func:`static_on_machine`), in order."""
        if self._static is None:
            raise ValueError(f"{self.noun}'s entries carry no static fallback")
        return [static_on_machine(*self._static(entry), machine, among) for entry in self.entries]
