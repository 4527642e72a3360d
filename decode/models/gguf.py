"""GGUF causal LMs: read one with transformers' own GGUF reader, dequantized, as a plain HF model and tokenizer.

A GGUF file is a safe format (tensors and metadata, no code), so ddte accepts one wherever it accepts a model
folder. transformers reads it (``gguf_file=``, with the ``gguf`` package installed) and dequantizes every tensor;
the model it returns still carries a ``quantization_config`` that makes ``save_pretrained`` refuse. :func:`
load_gguf_model` rebuilds a plain model of the same class from the config without it, so the result is an ordinary
model that can be saved as safetensors (:func:`convert_gguf`) and loaded like any other folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

GGUF_MAGIC = b"GGUF"
Progress = Callable[[int, int], None]  # (tensors dequantized so far, tensors in the file)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the content is checked when it is read)."""
    return str(path).lower().endswith(".gguf")


def check_gguf_file(path: str | Path) -> Path:
    """The path, if it is a readable file that starts with the GGUF magic bytes.

    Raises:
        ValueError: missing, a folder, or not a GGUF file.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    return path


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer stored in a GGUF file (with its chat template, when the file has one).

    Raises:
        ValueError: not a GGUF file, or one transformers cannot read.
    """
    from transformers import AutoTokenizer

    path = check_gguf_file(path)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as err:  # as for the model: the reader fails in many ways on a corrupt file
        raise ValueError(f"cannot read the tokenizer of {path}: {_first_line(err)}") from err


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32, progress: Progress | None = None):
    """A plain (unquantized) HF causal LM with the GGUF file's dequantized weights, in ``dtype``, eval mode.

    Args:
        progress: receives (tensors dequantized, tensors in the file) as the reader goes, and transformers then draws
            no bar of its own; None: transformers' bars are the progress (dequantizing a 1.5B model takes minutes).

    Raises:
        ValueError: not a GGUF file, an architecture transformers cannot read from GGUF, a corrupt file, or the
            ``gguf`` package missing.
    """
    from transformers import AutoModelForCausalLM

    from ddte_core.quiet import quiet_transformers

    path = check_gguf_file(path)
    try:
        with quiet_transformers(bars=progress is None), _reader_progress(progress):
            loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                          local_files_only=True, trust_remote_code=False)
    except ImportError as err:
        raise ValueError(f"reading GGUF needs the gguf package: pip install gguf ({_first_line(err)})") from err
    except Exception as err:  # a corrupt or foreign file fails anywhere in the reader (struct, numpy, KeyError...)
        raise ValueError(f"cannot read {path} as a causal LM: {_first_line(err)}") from err
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are already dequantized; the tag only blocks saving
    config.dtype = dtype
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    return plain.to(dtype).eval()


@contextlib.contextmanager
def _reader_progress(progress: Progress | None) -> Iterator[None]:
    """Inside the block, given ``progress``, transformers' GGUF reader reports each tensor it dequantizes to it and
    draws nothing: the reader loops over the file's tensors through its module's own ``tqdm`` (tqdm.auto, which
    transformers' ``disable_progress_bar`` does not reach), swapped here for a counting loop and restored after."""
    from transformers import modeling_gguf_pytorch_utils as reader

    if progress is None or not hasattr(reader, "tqdm"):
        yield
        return

    def counted(iterable, *_args, **_kwargs):
        items = list(iterable)
        progress(0, len(items))
        for done, item in enumerate(items, start=1):
            yield item
            progress(done, len(items))  # the reader has finished the previous item when it asks for the next

    original = reader.tqdm
    reader.tqdm = counted
    try:
        yield
    finally:
        reader.tqdm = original


def convert_gguf(path: str | Path, output: str | Path, dtype: torch.dtype = torch.float32,
                 progress: Progress | None = None) -> Path:
    """Write the GGUF file's model (safetensors, ``dtype``) and tokenizer as an HF folder at ``output``.

    The folder is staged beside ``output`` and renamed into place only when whole, so an interrupted or failed
    conversion leaves nothing at ``output``. transformers draws no "Writing model shards" bar; ``progress`` as for
    :func:`load_gguf_model`.

    Raises:
        ValueError: as :func:`load_gguf_model`, or ``output`` already exists.
    """
    from ddte_core.quiet import quiet_transformers

    output = Path(output)
    if output.exists():
        raise ValueError(f"{output} exists already")
    tokenizer = load_gguf_tokenizer(path)
    model = load_gguf_model(path, dtype, progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        with quiet_transformers(warnings=True):  # one shard: its bar is noise
            model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        for item in staging.iterdir():
            os.chmod(item, 0o644)
        os.chmod(staging, 0o755)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
