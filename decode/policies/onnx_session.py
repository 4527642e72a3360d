"""The one way ddte opens an ONNX policy file (a selector or an expander) in onnxruntime."""

from __future__ import annotations

from pathlib import Path


def policy_session(path: str | Path, what: str, error: type[ValueError] = ValueError,
                   providers: list[str] | None = None):
    """An onnxruntime session for a small per-step network: one thread, no memory arena, no pattern planner.

    The call runs right after the model passes have flushed the caches: threads only add wake-up latency, and the
    arena and planner add memory to touch per call.
    ``error`` (a ValueError subclass) names a missing or unreadable file as ``what`` ("selector", "expander").
    """
    import onnxruntime as ort

    path = Path(path)
    if path.is_dir():
        raise error(f"{what} file {str(path)!r} is a folder; give the .onnx file")
    if not path.is_file():
        raise error(f"{what} file {str(path)!r} does not exist")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own types (InvalidProtobuf, Fail, ...) for a bad file
        raise error(f"{path}: not a readable ONNX {what} ({type(err).__name__}: {err})") from err
