"""The deployment file (``policy.json``): which policy to run, per verifier and sampling configuration.

``ddte pipeline`` benches each selector and expander against the static candidates and writes this file; ``ddte
generate`` and ``ddte bench`` load it with one flag (``--policy-file``). Each choice is a static action, a selector
file or an expander file (paths relative to the policy file), with the measured ratio that justified it. This module
is the file's one reader and writer. :meth:`Deployment.policy_for` turns a verifier's choices into one policy that
serves any sampling configuration: each generation starts the choice measured nearest to its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddte_core.paths import staged_file
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig, nearest_note, nearest_setting
from decode.policies.base import Policy, StaticPolicy
from decode.policies.guard import StaticProfile
from decode.policies.latency import LatencyTable

FORMAT = "ddte-deployment/1"
POLICY_KINDS = ("static", "selector", "expander")


@dataclass
class Choice:
    """What to run for one verifier at one sampling configuration.

    Attributes:
        policy: ``static``, ``selector`` or ``expander``.
        action: the static action ``"K,L1,L2"`` (the selector's fallback for ``selector``, the kept static tree for
            ``expander``).
        selector: the selector file, relative to the policy file (``selector`` only).
        expander: the expander file, relative to the policy file (``expander`` only).
        tokens_per_s, static_tokens_per_s: measured in the deciding bench (same run, interleaved).
        reason: one sentence on why this policy was chosen.
        profile: for ``static``, what every static tree earned on the collection's roots (decode/policies/guard.py
            ``StaticProfile``): under the running machine's latency table it re-picks the static tree there.
    """

    verifier: str
    temperature: float
    top_p: float
    policy: str
    action: str
    selector: str | None = None
    tokens_per_s: float | None = None
    static_tokens_per_s: float | None = None
    reason: str = ""
    expander: str | None = None
    profile: dict | None = None


@dataclass
class Deployment:
    """Every choice, the verifier to use when none is named, and the pair they were measured on."""

    choices: list[Choice]
    verifier: str
    pair_fingerprint: str = ""
    source: dict = field(default_factory=dict)
    path: Path | None = None

    def choices_of(self, verifier: str) -> list[Choice]:
        """This verifier's choices, one per measured sampling configuration; ValueError when it has none."""
        mine = [c for c in self.choices if c.verifier == verifier]
        if not mine:
            known = sorted({c.verifier for c in self.choices})
            held = f"it has choices for {', '.join(known)}" if known else "it holds no choices"
            raise ValueError(f"no choice for verifier '{verifier}' ({held})")
        return mine

    def measured_sampling(self, verifier: str) -> list[SamplingConfig]:
        """The sampling configurations this verifier's choices were measured at (the others use the nearest)."""
        return [SamplingConfig(c.temperature, c.top_p) for c in self.choices_of(verifier)]

    def choice_for(self, verifier: str, temperature: float, top_p: float) -> Choice:
        """The choice of this verifier at the nearest measured sampling configuration."""
        return nearest_setting(self.choices_of(verifier), temperature, top_p)

    def policy_for(self, verifier: str, pair, machine: LatencyTable | None = None) -> DeployedPolicy:
        """The policy this file chooses for ``verifier`` on ``pair``, at any sampling configuration; every choice's
        selector is loaded (once per file) and checked against the pair here. ``machine``: the running machine's
        latency table, which picks every static tree and fallback where the file carries profiles (a static tree
        benched on this very machine, ``source["machine"]``, stays: a measurement beats the model)."""
        from decode.policies.expander import ExpanderPolicy  # onnxruntime and numpy: only where a file names one
        from decode.policies.selector import OnnxSelectorPolicy

        if self.pair_fingerprint and self.pair_fingerprint != pair.fingerprint():
            raise ValueError(f"{self.path}: measured on another pair (fingerprint {self.pair_fingerprint[:12]}…)")
        base = self.path.parent if self.path is not None else Path.cwd()
        loaded: dict[tuple[str, str], Policy] = {}  # each file once
        policies: dict[tuple[float, float], Policy] = {}
        for choice in self.choices_of(verifier):
            if choice.policy in ("selector", "expander"):
                name = choice.selector if choice.policy == "selector" else choice.expander
                if not name:
                    raise ValueError(f"{self.path}: a {choice.policy} choice without its file")
                if (choice.policy, name) not in loaded:
                    kind = OnnxSelectorPolicy if choice.policy == "selector" else ExpanderPolicy
                    loaded[choice.policy, name] = kind.for_pair(base / name, verifier, pair, machine)
                policies[choice.temperature, choice.top_p] = loaded[choice.policy, name]
            elif machine is not None and choice.profile is not None and machine.machine != self.source.get("machine"):
                # another machine than the one whose bench chose this tree: its own table re-picks it
                best = StaticProfile.from_dict(choice.profile).best(machine)
                policies[choice.temperature, choice.top_p] = StaticPolicy(best)
            else:
                policies[choice.temperature, choice.top_p] = StaticPolicy(Action.parse(choice.action))
        return DeployedPolicy(self, verifier, policies)

    def write(self, path: str | Path) -> Path:
        """Write whole or not at all (ddte_core.paths.staged_file)."""
        path = Path(path)
        payload = {"format": FORMAT, "verifier": self.verifier, "pair_fingerprint": self.pair_fingerprint,
                   "source": self.source, "choices": [asdict(c) for c in self.choices]}
        with staged_file(path) as tmp:
            tmp.write_text(json.dumps(payload, indent=1), encoding="utf-8")
        return path


class DeployedPolicy(Policy):
    """A policy file's choices for one verifier: a generation runs the choice measured nearest to its sampling.

    It chooses no action itself: :meth:`start` hands each generation the chosen policy, started.
    """

    name = "policy-file"

    def __init__(self, deployment: Deployment, verifier: str, policies: dict[tuple[float, float], Policy]) -> None:
        self.deployment, self.verifier, self._policies = deployment, verifier, policies

    def chosen(self, sampling) -> Policy:
        """The policy of the choice nearest ``sampling``."""
        choice = self.deployment.choice_for(self.verifier, sampling.temperature, sampling.top_p)
        return self._policies[choice.temperature, choice.top_p]

    def start(self, sampling) -> Policy:
        return self.chosen(sampling).start(sampling)

    def describe(self, sampling) -> str:
        return f"{self.chosen(sampling).describe(sampling)}, from {self.deployment.path}"

    def sampling_note(self, sampling: SamplingConfig) -> str | None:
        return nearest_note("the policy file has choices for", self.deployment.measured_sampling(self.verifier),
                            sampling)


def load_deployment(path: str | Path) -> Deployment:
    """Read a policy file; ValueError with one line if it is missing or malformed."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the policy.json a pipeline wrote")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror})") from err
    except UnicodeDecodeError as err:  # an .onnx selector or expander, say: they have options of their own
        raise ValueError(f"{path}: not a ddte policy file (JSON text; a selector or expander .onnx goes to "
                         "--selector or --expander)") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg})") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a ddte policy file (format {FORMAT!r} expected)")
    fields_known = set(Choice.__dataclass_fields__)
    for i, c in enumerate(data.get("choices") or [], start=1):
        if not isinstance(c, dict):
            raise ValueError(f"{path}: choice {i} is not an object")
        unknown, missing = sorted(set(c) - fields_known), sorted({"verifier", "temperature", "top_p", "policy",
                                                                  "action"} - set(c))
        if unknown or missing:
            raise ValueError(f"{path}: choice {i} " + "; ".join(
                part for part in (f"has unknown keys {', '.join(unknown)}" if unknown else "",
                                  f"lacks {', '.join(missing)}" if missing else "") if part))
    try:
        choices = [Choice(**c) for c in data["choices"]]
        unknown = sorted({c.policy for c in choices} - set(POLICY_KINDS))
        if unknown:
            raise ValueError(f"{path}: unknown policy {unknown[0]!r} (one of {', '.join(POLICY_KINDS)})")
        return Deployment(choices, str(data["verifier"]), str(data.get("pair_fingerprint", "")),
                          dict(data.get("source", {})), path)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: malformed policy file ({err})") from err


POLICY_FILES = ("selector", "expander", "policy")  # what --selector, --expander and --policy-file load


def load_policy(kind: str, path: str | Path, verifier: str, pair, machine: LatencyTable | None = None,
                deployments: dict[str, Deployment] | None = None) -> Policy:
    """The one way a command turns a policy file into a policy for ``verifier`` on ``pair``: a ``selector`` or an
    ``expander`` (ONNX) or a ``policy`` file (policy.json), checked against the pair (ValueError for one that does not
    fit). ``machine``: the running machine's latency table (decode/policies/guard.py). ``deployments``: policy files
    already read, by path; a policy file read here joins it."""
    if kind == "selector":
        from decode.policies.selector import OnnxSelectorPolicy

        return OnnxSelectorPolicy.for_pair(path, verifier, pair, machine)
    if kind == "expander":
        from decode.policies.expander import ExpanderPolicy

        return ExpanderPolicy.for_pair(path, verifier, pair, machine)
    if kind != "policy":
        raise ValueError(f"unknown policy file kind {kind!r} (one of {', '.join(POLICY_FILES)})")
    deployments = {} if deployments is None else deployments
    key = str(path)
    if key not in deployments:
        deployments[key] = load_deployment(path)
    return deployments[key].policy_for(verifier, pair, machine)
