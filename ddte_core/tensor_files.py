"""Reading a safetensors file that declares its own format: ddte's small files of tensors (a draft vocabulary, a
steering map, cached teacher laws) share one reader, so each refuses a corrupt or foreign file with one line."""

from __future__ import annotations

from pathlib import Path


def read_tensor_file(path: Path, file_format: str, what: str):
    """``(tensors, metadata)`` of a safetensors file whose metadata says ``format: file_format``.

    Raises:
        ValueError: the file is unreadable (``what`` names it in the message) or of another format.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (safe_open has no iter)
    except Exception as error:  # safetensors raises its own error types for a corrupt file
        raise ValueError(f"{path}: unreadable {what} ({error})") from error
    if meta.get("format") != file_format:
        raise ValueError(f"{path} is not a {file_format} file")
    return tensors, meta
