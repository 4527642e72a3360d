"""The neural selector at decode time: an exported ``.onnx`` selector picks the delayed tree at every root.

The file's metadata (docs/selector.md) is checked against the pair and the feature schema before any decoding:
a selector trained for another pair, verifier, feature order or hidden size is refused with a clear error. Each
step the decoder computes the root features (decode.features, the same code data_gen ran) and the policy runs
the network once through onnxruntime: the action is the argmax of the scores (``policy`` selectors) or of the
predicted Ê[τ+1] over the latency model's step time T̂ (``be`` selectors).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from pathlib import Path

import numpy as np

from decode.drafting import Action
from decode.features import SCALAR_NAMES
from decode.latency import draft_passes
from decode.policies import RootState, StepOutcome

SUPPORTED_SCHEMA = "1"
INPUT_NAMES = ("target_hidden_prev", "draft_hidden_prev", "draft_hidden_root", "scalars")


class SelectorError(ValueError):
    """The selector file cannot be used (unreadable, or it does not match the pair or the feature schema)."""


OVERHEAD_WINDOW = 64  # steps in the running median of the unmodelled step time


def _session(path: str | Path, providers: list[str]):
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise SelectorError(f"selector file {str(path)!r} does not exist")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # a per-step call on a tiny MLP: threads only add wake-up latency
    options.inter_op_num_threads = 1
    # The call runs right after the model passes have flushed the caches; the arena and memory-pattern planner
    # add code and memory to touch per call (measured: cold call 128 µs with them, 110 µs without).
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as err:  # onnxruntime raises its own types (InvalidProtobuf, Fail, ...) for a bad file
        raise SelectorError(f"{path}: not a readable ONNX selector ({type(err).__name__}: {err})") from err


class OnnxSelectorPolicy:
    """Chooses (K, L1, L2) per step from the root features with an exported selector.

    Attributes:
        actions: the selector's action list (its output order).
        call_seconds: wall time of every network call (for the benchmark's overhead figures).
        provider: the onnxruntime execution provider actually in use.
    """

    name = "selector"
    wants_features = True

    def __init__(
        self,
        path: str | Path,
        *,
        verifier: str,
        target_hidden: int,
        draft_hidden: int,
        pair_fingerprint: str | None = None,
        use_cuda: bool = False,
    ) -> None:
        import onnxruntime as ort

        providers = ["CPUExecutionProvider"]
        if use_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.session = _session(path, providers)
        self.provider = self.session.get_providers()[0]
        self.path = Path(path)
        meta = dict(self.session.get_modelmeta().custom_metadata_map)
        self.metadata = meta
        self.actions = _check_metadata(meta, self.path, verifier, target_hidden, draft_hidden, pair_fingerprint)
        self.decision = meta["ddte.decision"]
        self.call_seconds: list[float] = []
        self._step_cache: dict[tuple[int, int], np.ndarray] = {}
        self._index = {a: i for i, a in enumerate(self.actions)}
        self._passes = draft_passes(self.actions)
        self._latency = None
        self._overheads: deque[float] = deque(maxlen=OVERHEAD_WINDOW)
        self.overhead_ms = 0.0
        names = [i.name for i in self.session.get_inputs()]
        if sorted(names) != sorted(INPUT_NAMES):
            raise SelectorError(f"{self.path}: inputs {names}, expected {list(INPUT_NAMES)}")
        self._bound = self._bind_buffers(ort) if self.provider == "CPUExecutionProvider" else None

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

    def scores(self, features) -> np.ndarray:
        """``(A,)`` float32 scores of one root's features (a view of the bound output buffer on CPU: valid until
        the next call)."""
        if self._bound is not None:
            binding, inputs, output = self._bound
            for name, buffer in inputs.items():  # (H,) tensors into (1, H) buffers: no intermediate arrays
                np.copyto(buffer[0], getattr(features, name).numpy(), casting="same_kind")
            start = time.perf_counter()
            self.session.run_with_iobinding(binding)
            self.call_seconds.append(time.perf_counter() - start)
            return output[0]
        feeds = {name: getattr(features, name).numpy()[None].astype(np.float32, copy=False) for name in INPUT_NAMES}
        start = time.perf_counter()
        out = self.session.run(None, feeds)[0][0]
        self.call_seconds.append(time.perf_counter() - start)
        return out

    def choose(self, root: RootState) -> Action:
        if root.features is None:
            raise ValueError("the selector policy needs root features (the decoder computes them when asked)")
        scores = self.scores(root.features)
        # Actions the graph masks score ddte.invalid_score, the floor of the output (0 for probabilities, -1e9 for
        # Ê): a plain argmax, even after dividing by a positive T̂, never picks one, so no mask pass is needed
        # (two numpy passes over the scores cost ~50 µs in the loop, where caches are cold).
        if self.decision == "throughput":
            if root.latency is None:
                raise ValueError("a 'throughput' selector needs the decoder's latency table")
            self._latency = root.latency
            scores = scores / (self._step_ms(root.latency, root.context_length) + self.overhead_ms)
        return self.actions[int(np.argmax(scores))]

    def observe(self, outcome: StepOutcome) -> None:
        """Calibrate T̂ online: Eq. 11 counts only model passes, so a step's verification, sampling and bookkeeping
        are missing from it. That fixed cost favours larger trees; it is taken as the median, over the last
        steps, of measured step time minus T̂ (never below 0) and added to every action's T̂."""
        if self._latency is None or outcome.seconds is None or outcome.context_length is None:
            return
        index = self._index.get(outcome.action)
        if index is None:  # clipped near the length budget: not one of the selector's actions
            return
        modelled = float(self._step_ms(self._latency, outcome.context_length)[index])
        self._overheads.append(1e3 * outcome.seconds - modelled)
        self.overhead_ms = max(0.0, statistics.median(self._overheads))

    def _step_ms(self, latency, context_length: int) -> np.ndarray:
        """T̂ of every action near this context length, cached per (table, 16-token bucket).

        T̂ moves slowly with the length; one vectorised Eq. 11 over all actions costs about as much as the network.
        """
        bucket = context_length // 16 * 16
        key = (id(latency), bucket)
        if key not in self._step_cache:
            self._step_cache[key] = latency.step_ms_many(bucket, self._passes)
        return self._step_cache[key]

    def median_call_us(self) -> float | None:
        return 1e6 * statistics.median(self.call_seconds) if self.call_seconds else None


def _check_metadata(
    meta: dict[str, str], path: Path, verifier: str, target_hidden: int, draft_hidden: int, fingerprint: str | None
) -> list[Action]:
    """Validate a selector's metadata against this decoder; returns its actions."""
    required = ["ddte.schema_version", "ddte.actions", "ddte.scalar_names", "ddte.hidden_sizes", "ddte.verifier",
                "ddte.decision"]
    missing = [k for k in required if k not in meta]
    if missing:
        raise SelectorError(f"{path}: not a ddte selector (metadata lacks {', '.join(missing)})")
    if meta["ddte.schema_version"] != SUPPORTED_SCHEMA:
        version = meta["ddte.schema_version"]
        raise SelectorError(f"{path}: feature schema {version}, this decoder has {SUPPORTED_SCHEMA}")
    names = json.loads(meta["ddte.scalar_names"])
    if names != list(SCALAR_NAMES):
        raise SelectorError(f"{path}: scalar features {names} differ from this decoder's {list(SCALAR_NAMES)}")
    sizes = json.loads(meta["ddte.hidden_sizes"])
    want = {"target_hidden_prev": target_hidden, "draft_hidden_prev": draft_hidden, "draft_hidden_root": draft_hidden}
    if sizes != want:
        raise SelectorError(f"{path}: trained on hidden sizes {sizes}, but this pair has {want}")
    if meta["ddte.verifier"] != verifier:
        raise SelectorError(
            f"{path}: trained for verifier '{meta['ddte.verifier']}', not '{verifier}' (one selector per verifier)"
        )
    stored = meta.get("ddte.pair_fingerprint", "")
    if fingerprint is not None and stored and stored != fingerprint:
        raise SelectorError(
            f"{path}: trained on another pair (fingerprint {stored[:12]}…, this pair {fingerprint[:12]}…)"
        )
    if meta["ddte.decision"] not in ("argmax", "throughput"):
        raise SelectorError(f"{path}: unknown decision rule {meta['ddte.decision']!r}")
    try:
        return [Action.parse(a) for a in json.loads(meta["ddte.actions"])]
    except ValueError as err:
        raise SelectorError(f"{path}: bad action list ({err})") from err
