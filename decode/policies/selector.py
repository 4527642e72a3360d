"""The neural selector at decode time: an exported ``.onnx`` selector picks the delayed tree at every root.

The file's metadata (:mod:`decode.policies.files.selector_file`) is checked against the pair and the feature schema
before any decoding: a selector trained for another pair, verifier, feature order or hidden size is refused with a clear
error. Each step the decoder computes the root features (decode.policies.features, the same code data_gen ran) and the
policy runs the network once through onnxruntime. The decision value of an action is its score (``policy``
selectors) or its predicted Ê[τ+1] over the latency model's step time T̂ (``be`` selectors).

The never-lose guard: the policy drafts the best action only where its decision value beats the fallback
action's (the best static action of its training data) by more than the margin fitted on validation prompts;
otherwise it drafts the fallback. Fallback and margin are those of the sampling configuration nearest the root's
(``root.sampling``), so one loaded selector serves every temperature. Where the margin is ``None`` the selector
never left its fallback on validation: a generation at that sampling starts as the static fallback policy, with no
features and no network.

:class:`SelectorSource` is the loaded file (network, metadata, one guard per configuration, its fallback picked
once under the running machine's latency table); :class:`SelectorPolicy` runs one generation on it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decode.cost.table import LatencyTable, draft_passes
from decode.drafting.actions import Action
from decode.drafting.sampling import SamplingConfig
from decode.policies.base import Policy, PolicySource, RootState, StaticPolicy, StepOutcome
from decode.policies.files.guard import machine_note
from decode.policies.files.selector_file import INPUT_NAMES, SelectorFileError, SelectorMetadata
from decode.policies.onnx_session import policy_session

SelectorError = SelectorFileError  # the name callers catch
OVERHEAD_WINDOW = 64  # steps in the running median of the unmodelled step time


@dataclass(frozen=True)
class Guard:
    """The never-lose guard at one sampling configuration.

    Attributes:
        action: the fallback, drafted unless the network's choice clears the margin.
        index: the fallback's position in the selector's output.
        margin: relative margin needed to leave the fallback; None = never leave it.
    """

    action: Action
    index: int
    margin: float | None


class SelectorSource(PolicySource):
    """An exported selector, loaded and checked against its verifier and pair: it serves every generation through
    :meth:`start`, the network shared.

    Args:
        path: the ``.onnx`` file.
        verifier: the decoder's verifier (the selector must have been trained on its labels).
        target_hidden, draft_hidden: the pair's hidden sizes.
        pair_fingerprint: the pair's fingerprint; None skips that check.
        use_cuda: run on onnxruntime's CUDA provider when it is available.
        machine: the running machine's latency table, which picks each guard's fallback
            (decode/policies/files/guard.py).

    Attributes:
        actions: the selector's action list (its output order).
        provider: the onnxruntime execution provider actually in use.
        guards: the guard of each sampling configuration (decode/policies/files/sampling_table.py).
    """

    name = "selector"

    def __init__(
        self,
        path: str | Path,
        *,
        verifier: str,
        target_hidden: int,
        draft_hidden: int,
        pair_fingerprint: str | None = None,
        use_cuda: bool = False,
        machine: LatencyTable | None = None,
    ) -> None:
        import onnxruntime as ort

        from decode.policies.features import hidden_sizes

        self.path = Path(path)
        self.machine = machine
        providers = ["CPUExecutionProvider"]
        if use_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.session = policy_session(self.path, "selector", SelectorError, providers)
        self.provider = self.session.get_providers()[0]
        props = dict(self.session.get_modelmeta().custom_metadata_map)
        self.metadata = SelectorMetadata.from_props(props, str(self.path))
        self.metadata.check_compatible(str(self.path), verifier, hidden_sizes(target_hidden, draft_hidden),
                                       pair_fingerprint)
        names = [i.name for i in self.session.get_inputs()]
        if sorted(names) != sorted(INPUT_NAMES):
            raise SelectorError(f"{self.path}: inputs {names}, expected {list(INPUT_NAMES)}")
        try:
            self.actions = [Action.parse(a) for a in self.metadata.actions]
        except ValueError as err:
            raise SelectorError(f"{self.path}: bad action list ({err})") from err
        self.throughput = self.metadata.decision == "throughput"
        table = self.metadata.guard_table()
        statics = table.statics(machine, among=self.actions)
        self.guards = table.with_entries([Guard(action, self.actions.index(action), fallback.margin)
                                          for action, fallback in zip(statics, table.entries, strict=True)])
        self._profiled = [fallback.profile is not None for fallback in table.entries]
        self._step_cache: dict[tuple[int, int], np.ndarray] = {}
        self.action_index = {a: i for i, a in enumerate(self.actions)}
        self._passes = draft_passes(self.actions)
        self.bound = self._bind_buffers(ort) if self.provider == "CPUExecutionProvider" else None

    @classmethod
    def for_pair(cls, path: str | Path, verifier: str, pair, machine: LatencyTable | None = None) -> SelectorSource:
        """The selector checked against a loaded pair (hidden sizes, fingerprint), on its device; ``machine``: the
        running machine's latency table, which picks the guard's fallback (decode/policies/files/guard.py)."""
        return cls(path, verifier=verifier, target_hidden=int(pair.target.config.hidden_size),
                   draft_hidden=int(pair.draft.config.hidden_size), pair_fingerprint=pair.fingerprint(),
                   use_cuda=pair.target.device.type == "cuda", machine=machine)

    def guard(self, sampling: SamplingConfig) -> Guard:
        """The guard of the sampling configuration nearest ``sampling``."""
        return self.guards.nearest(sampling)

    def start(self, sampling: SamplingConfig) -> Policy:
        """The runner of one generation (the loaded network shared), or the static fallback where the guard at
        ``sampling`` never leaves it: then the generation costs no features and no network call."""
        guard = self.guard(sampling)
        if guard.margin is None:
            return StaticPolicy(guard.action)
        return SelectorPolicy(self, guard)

    def describe(self, sampling: SamplingConfig) -> str:
        guard = self.guard(sampling)
        margin = "never leaves it" if guard.margin is None else f"margin {guard.margin:g}"
        profiled = self._profiled[self.guards.index(sampling)]
        return (f"selector {self.path} (fallback {guard.action.canonical()}"
                f"{machine_note(self.machine, profiled)}, {margin})")

    def sampling_note(self, sampling: SamplingConfig) -> str | None:
        return self.guards.note(sampling)

    def _bind_buffers(self, ort):
        """Fixed ``(1, ·)`` float32 input and output buffers bound once to the session (CPU only): a call then
        copies the features in and runs, with no per-call OrtValue or output allocation."""
        widths = {i.name: i.shape[1] for i in self.session.get_inputs()}
        if not all(isinstance(w, int) for w in widths.values()):
            return None  # a width left symbolic in the graph: use the plain run path
        inputs = {name: np.zeros((1, w), dtype=np.float32) for name, w in widths.items()}
        output = np.zeros((1, len(self.actions)), dtype=np.float32)
        binding = self.session.io_binding()
        for name, array in inputs.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        binding.bind_ortvalue_output(self.session.get_outputs()[0].name, ort.OrtValue.ortvalue_from_numpy(output))
        return binding, inputs, output

    def step_ms(self, latency, context_length: int) -> np.ndarray:
        """T̂ of every action near this context length, cached per (table, 16-token bucket).

        T̂ moves slowly with the length; one vectorised Eq. 11 over all actions costs about as much as the network.
        """
        bucket = context_length // 16 * 16
        key = (id(latency), bucket)
        if key not in self._step_cache:
            self._step_cache[key] = latency.step_ms_many(bucket, self._passes)
        return self._step_cache[key]


class SelectorPolicy(Policy):
    """One generation on a :class:`SelectorSource`: chooses (K, L1, L2) per step from the root features, behind the
    guard of its sampling configuration.

    Stateful: it calibrates the unmodelled step time over the steps of its generation.

    Attributes:
        overhead_ms: this generation's calibrated step time beyond T̂ (see :meth:`observe`).
    """

    name = "selector"
    needs_root_features = True
    stateful = True

    def __init__(self, source: SelectorSource, guard: Guard) -> None:
        self.source, self.guard, self.actions = source, guard, source.actions
        self._latency: LatencyTable | None = None
        self._overheads: deque[float] = deque(maxlen=OVERHEAD_WINDOW)
        self.overhead_ms = 0.0
        self._call_seconds: list[float] = []

    def network_seconds(self) -> list[float]:
        return self._call_seconds

    def scores(self, features) -> np.ndarray:
        """``(A,)`` float32 scores of one root's features (a view of the bound output buffer on CPU: valid until
        the next call)."""
        source = self.source
        if source.bound is not None:
            binding, inputs, output = source.bound
            for name, buffer in inputs.items():  # (H,) tensors into (1, H) buffers: no intermediate arrays
                np.copyto(buffer[0], getattr(features, name).numpy(), casting="same_kind")
            start = time.perf_counter()
            source.session.run_with_iobinding(binding)
            self._call_seconds.append(time.perf_counter() - start)
            return output[0]
        feeds = {name: getattr(features, name).numpy()[None].astype(np.float32, copy=False) for name in INPUT_NAMES}
        start = time.perf_counter()
        out = source.session.run(None, feeds)[0][0]
        self._call_seconds.append(time.perf_counter() - start)
        return out

    def choose(self, root: RootState) -> Action:
        guard = self.guard
        if root.features is None:
            raise ValueError("the selector policy needs root features (the decoder computes them when asked)")
        value = self.scores(root.features)
        # Actions the graph masks score the floor of the output (0 for probabilities, -1e9 for Ê): a plain argmax,
        # even after dividing by a positive T̂, never picks one, so no mask pass is needed (each numpy pass over the
        # scores is paid in the loop, where caches are cold).
        if self.source.throughput:
            if root.latency is None:
                raise ValueError("a 'throughput' selector needs the decoder's latency table")
            self._latency = root.latency
            value = value / (self.source.step_ms(root.latency, root.context_length) + self.overhead_ms)
        best = int(np.argmax(value))
        if guard.margin is not None and value[best] > (1.0 + guard.margin) * value[guard.index]:  # None: never
            return self.actions[best]
        return guard.action

    def observe(self, outcome: StepOutcome) -> None:
        """Calibrate T̂ online: the latency model counts the passes (with their sampling) and the cold first draft
        pass, so a step's verification and bookkeeping are missing from it. That fixed cost favours larger trees;
        it is taken as the median, over the last steps, of measured step time minus T̂ (never below 0) and added to
        every action's T̂."""
        if self._latency is None or outcome.seconds is None or outcome.context_length is None:
            return
        index = self.source.action_index.get(outcome.action)
        if index is None:  # clipped near the length budget: not one of the selector's actions
            return
        modelled = float(self.source.step_ms(self._latency, outcome.context_length)[index])
        self._overheads.append(1e3 * outcome.seconds - modelled)
        self.overhead_ms = max(0.0, statistics.median(self._overheads))
