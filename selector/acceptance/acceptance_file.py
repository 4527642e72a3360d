"""The acceptance model's file contract: its ``ddte.acceptance.*`` metadata, written by its trainer and read by the
expander fit, in one typed owner.

``ddte acceptance`` (selector/acceptance/acceptance_train.py) exports the graph (input ``node``: the draft's hidden
state, entropy, top probability and depth; output ``beta``, one column per temperature) with
:meth:`AcceptanceMetadata.to_props`; the expander fit (selector/expander/expander.py ``AcceptanceFile``) reads it
back with :meth:`AcceptanceMetadata.from_props` and checks it against a collection (:meth:`check_for`). Every value is
stored as JSON, strings included, as every file written so far holds them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from decode.drafting.sampling import SamplingConfig
from decode.policies.files.sampling_table import SamplingTable

PREFIX = "ddte.acceptance."
INPUTS = ["draft_hidden", "entropy", "top1", "depth"]


@dataclass(frozen=True)
class AcceptanceMetadata:
    """What an acceptance model's file says of itself.

    Attributes:
        hidden_size: the draft hidden state it reads.
        temperatures: the temperature of each output column.
        pair_fingerprint: the pair its dense labels came from.
        data_fingerprint: the dense data set it was trained on.
        fit_prompts: the prompt ids whose nodes trained, validated or tested it.
        prompts: the prompt set those came from.
        inputs: the node features the graph reads, in order.
        label: what it was fitted to: ``exact`` β, or the drawn token's ``realized`` min(1, p/q) (files written
            before the choice existed: exact).
    """

    hidden_size: int
    temperatures: list[float]
    pair_fingerprint: str
    data_fingerprint: str = ""
    fit_prompts: list[str] = field(default_factory=list)
    prompts: object = None
    inputs: list[str] = field(default_factory=lambda: list(INPUTS))
    label: str = "exact"

    def to_props(self) -> dict[str, str]:
        """ONNX ``metadata_props``: ``ddte.acceptance.<field>`` = its value as JSON."""
        return {PREFIX + name: json.dumps(value) for name, value in asdict(self).items()}

    @classmethod
    def from_props(cls, props: dict[str, str], where: str) -> AcceptanceMetadata:
        """Rebuild from ``metadata_props``; ValueError naming what is missing or malformed."""
        if PREFIX + "temperatures" not in props:
            raise ValueError(f"{where}: not an acceptance model (ddte acceptance writes one)")
        known = {f.name for f in fields(cls)}
        try:
            values = {key[len(PREFIX):]: json.loads(value) for key, value in props.items()
                      if key.startswith(PREFIX) and key[len(PREFIX):] in known}
            values["hidden_size"] = int(values["hidden_size"])
            values["temperatures"] = [float(t) for t in values["temperatures"]]
            values["fit_prompts"] = [str(p) for p in values.get("fit_prompts", [])]
            return cls(**values)
        except (KeyError, json.JSONDecodeError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: malformed acceptance metadata ({err})") from err

    @property
    def columns(self) -> SamplingTable[int]:
        """The output column of each temperature (the nearest serves the others)."""
        return SamplingTable.of_temperatures(self.temperatures, "the acceptance model")

    def column(self, temperature: float) -> int:
        """The output column of the temperature nearest ``temperature``."""
        return self.columns.nearest(SamplingConfig(temperature))

    def check_for(self, where: str, pair_fingerprint: str, draft_hidden: int, prompts: set[str]) -> None:
        """ValueError unless the model was trained on this pair and draft, and on none of ``prompts`` (a collection's:
        its β̂ there would be in-sample and every offline figure optimistic)."""
        if self.pair_fingerprint != pair_fingerprint:
            raise ValueError(f"{where}: trained on another pair than the collection's")
        if self.hidden_size != draft_hidden:
            raise ValueError(f"{where}: reads a draft hidden state of {self.hidden_size}, not {draft_hidden}")
        seen = prompts & set(self.fit_prompts)
        if seen:
            raise ValueError(f"{where}: trained on {len(seen)} of the collection's prompts (e.g. "
                             f"{sorted(seen)[0]}); train it on others (ddte dense-labels --first-prompt) so the "
                             "offline figures are honest")
