"""What a trained selector knows besides its weights, typed from the data module to the exported file.

:class:`DataFacts` is what the data module (selector/root/data.py) tells the model about the data set and its splits;
:class:`SelectorInfo` adds how the network was trained and its never-lose guard. The model carries one in its
checkpoint (a plain JSON-ready dict under ``checkpoint["ddte"]``: :meth:`SelectorInfo.to_dict` and
:meth:`SelectorInfo.from_dict`, the keys written before these types), the training run reports from it, and the
exporter turns it into the file's :class:`~decode.policies.files.selector_file.SelectorMetadata`
(:meth:`SelectorInfo.metadata`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from decode.drafting.sampling import SamplingConfig
from decode.policies.features import SCALAR_NAMES
from decode.policies.files.selector_file import OBJECTIVES, Fallback, SelectorMetadata


def sampling_configs(values: list[dict[str, Any]]) -> list[SamplingConfig]:
    """The sampling configurations of a data set's metadata (``{"temperature": t, "top_p": p}`` each)."""
    return [SamplingConfig(float(v["temperature"]), float(v["top_p"])) for v in values]


@dataclass
class DataFacts:
    """The data a selector learns from.

    ``static_actions``: per sampling configuration (index into ``sampling``), the training split's best static
    action; ``static_ranking``: its leading distinct static trees, best first (what ``ddte pipeline`` benches).
    ``fit_prompts``: the prompts whose roots trained or validated the network or fitted its guard (an offline score
    of the exported file leaves them out). ``per_step``: the data set's roots sample a reference loop's step starts
    (``"roots": "steps"``), else trajectory positions: how the offline metrics read them
    (decode/cost/throughput.py); checkpoints written before it: positions.
    """

    schema_version: int
    actions: list[str]
    hidden_sizes: dict[str, int]
    verifier: str
    pair_fingerprint: str
    data_fingerprint: str
    data_dir: str
    sampling: list[SamplingConfig]
    static_actions: dict[int, str]
    static_ranking: dict[int, list[str]]
    split_rows: dict[str, int]
    split_prompts: dict[str, int]
    fit_prompts: list[str]
    scalar_names: list[str] = field(default_factory=lambda: list(SCALAR_NAMES))
    per_step: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: sampling configurations as dicts, configuration indices as strings."""
        out = dataclasses.asdict(self)
        out["static_actions"] = {str(k): v for k, v in self.static_actions.items()}
        out["static_ranking"] = {str(k): v for k, v in self.static_ranking.items()}
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DataFacts:
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in values.items() if k in names}
        kept["sampling"] = sampling_configs(values["sampling"])
        kept["static_actions"] = {int(k): v for k, v in values["static_actions"].items()}
        kept["static_ranking"] = {int(k): list(v) for k, v in values.get("static_ranking", {}).items()}
        kept.setdefault("fit_prompts", [])
        return cls(**kept)


@dataclass
class SelectorInfo:
    """The data facts, the objective and standardisation the network was trained with, and its guard.

    ``fallbacks``: per sampling configuration, the static action the guard falls back to and its margin; None until
    the guard is fitted after training (selector/root/evaluation.py).
    """

    data: DataFacts
    objective: str
    normalisation: dict[str, Any]
    fallbacks: list[Fallback] | None = None

    @property
    def decision(self) -> str:
        return OBJECTIVES[self.objective][0]

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's ``ddte`` dict: the data facts' keys beside the training ones, flat."""
        out = self.data.to_dict() | {"objective": self.objective, "decision": self.decision,
                                     "normalisation": self.normalisation}
        if self.fallbacks is not None:
            out["fallbacks"] = [dataclasses.asdict(f) for f in self.fallbacks]
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SelectorInfo:
        """From a checkpoint's ``ddte`` dict; ValueError naming what is missing."""
        try:
            fallbacks = values.get("fallbacks")
            return cls(DataFacts.from_dict(values), str(values["objective"]), dict(values["normalisation"]),
                       None if fallbacks is None else [Fallback(**f) for f in fallbacks])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed selector metadata ({type(err).__name__}: {err})") from err

    def metadata(self, invalid_score: float, run_id: str = "") -> SelectorMetadata:
        """The exported file's metadata. ValueError before the guard is fitted (a checkpoint of an older ddte)."""
        if self.fallbacks is None:
            raise ValueError("the checkpoint has no never-lose guard (fallback actions and margins): it was trained "
                             "by an older ddte; retrain it with `ddte train`")
        data = self.data
        return SelectorMetadata(
            actions=list(data.actions), hidden_sizes=dict(data.hidden_sizes), verifier=data.verifier,
            objective=self.objective, normalisation=dict(self.normalisation), invalid_score=float(invalid_score),
            fallbacks=list(self.fallbacks), scalar_names=list(data.scalar_names),
            pair_fingerprint=data.pair_fingerprint, data_fingerprint=data.data_fingerprint, run_id=run_id,
            fit_prompts=list(data.fit_prompts),
        )
