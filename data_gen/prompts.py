"""Prompt sets: built from the stdlib corpus's modules (held-out for evaluation, training for data collection), or
read from JSONL, parquet, a ``datasets`` file spec or a data set in the offline HF cache.

A prompt is the text of a module up to and including the header of a function or class and its docstring, i.e. the
point where the body's code should begin. It starts at the module's first line when that fits in ``--max-chars``,
otherwise at the latest line that keeps it within the limit (``start_line`` records which). Every record has the
``prompt`` plus provenance: module path, line numbers, the def/class name, python version and split.

Only held-out modules are used unless ``--split train`` is given explicitly (for data collection): held-out prompts
never contain text from a training module. The output is deterministic: candidates are ordered by a stable hash
within each module and taken round-robin across modules in sorted order, so every module contributes.
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data_gen.chat_prompts import build_chat_prompts, split_source
from data_gen.corpus import HELDOUT_FRACTION, SPLITS, SourceFile, list_corpus, python_version, select_split
from ddte_core.paths import staged_file
from decode.pair import render_chat

DEFAULT_COUNT = 200
DEFAULT_MAX_CHARS = 1200  # ~360 tokens of the pair's BPE: leaves room for a continuation in a 512-token context
DATASET_BUILDERS = ("json", "parquet", "csv", "text")


def _anchors(source: str) -> Iterator[tuple[int, int, str]]:
    """(header line, docstring end line, "def name"/"class name") for each documented def/class, 1-based lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return  # not parseable by this interpreter: no prompts from it
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if ast.get_docstring(node, clean=False) is None:
            continue
        doc = node.body[0]
        kind = "class" if isinstance(node, ast.ClassDef) else "def"
        yield node.lineno, doc.end_lineno or doc.lineno, f"{kind} {node.name}"


def _window(lines: list[str], end_line: int, max_chars: int) -> int | None:
    """The first line (1-based) of the longest line-aligned window ending at ``end_line`` within ``max_chars``."""
    total, start = 0, end_line + 1
    for index in range(end_line - 1, -1, -1):
        if total + len(lines[index]) > max_chars:
            break
        total += len(lines[index])
        start = index + 1
    return start if start <= end_line else None


def module_prompts(module: SourceFile, max_chars: int = DEFAULT_MAX_CHARS) -> list[dict[str, Any]]:
    """Every prompt candidate of one module, in source order, with provenance."""
    source = module.read()
    lines = source.splitlines(keepends=True)
    records = []
    for header_line, end_line, anchor in sorted(set(_anchors(source))):
        start = _window(lines, end_line, max_chars)
        if start is None or start > header_line:
            continue  # the header and docstring alone exceed max_chars
        text = "".join(lines[start - 1 : end_line])
        if not text.endswith("\n"):
            text += "\n"  # a docstring on the file's last line without a newline: the body starts on a new line
        records.append(
            {
                "prompt": text,
                "module": module.relpath,
                "split": module.split,
                "start_line": start,
                "header_line": header_line,
                "end_line": end_line,
                "anchor": anchor,
                "python_version": python_version(),
                "id": f"{module.relpath}:{header_line}",
            }
        )
    return records


def _stable_key(record: dict[str, Any]) -> str:
    return hashlib.sha256(record["id"].encode("utf-8")).hexdigest()


def build_prompts(
    count: int = DEFAULT_COUNT,
    split: str = "heldout",
    max_chars: int = DEFAULT_MAX_CHARS,
    heldout_fraction: float = HELDOUT_FRACTION,
    files: list[SourceFile] | None = None,
) -> list[dict[str, Any]]:
    """Up to ``count`` prompt records from the modules of ``split``; deterministic for a given corpus."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    files = list_corpus(heldout_fraction=heldout_fraction) if files is None else files
    per_module = [sorted(module_prompts(m, max_chars), key=_stable_key) for m in select_split(files, split)]
    per_module = [records for records in per_module if records]
    chosen: list[dict[str, Any]] = []
    depth = 0
    while len(chosen) < count and any(len(r) > depth for r in per_module):
        chosen.extend(records[depth] for records in per_module if len(records) > depth)
        depth += 1
    return chosen[:count]


def write_jsonl(records: list[dict[str, Any]], path: Path) -> None:
    """Write records as JSONL, whole or not at all (ddte_core.paths.staged_file)."""
    with staged_file(path) as tmp, tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit inside a string
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {err.object[err.start]:#04x})") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object per line")
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several types for a corrupt or non-parquet file
        raise ValueError(f"{path}: cannot read as parquet ({err})") from err


def _read_dataset(builder: str, path: Path) -> list[dict[str, Any]]:
    from datasets import load_dataset

    try:
        return load_dataset(builder, data_files=str(path), split="train").to_list()
    except Exception as err:  # datasets wraps parse errors in its own exception types
        raise ValueError(f"{builder}:{path}: cannot load with datasets ({err})") from err


def _read_rows(source: str) -> list[dict[str, Any]]:
    """Rows of a JSONL/JSON-lines file, a parquet file, or a ``builder:path`` datasets spec."""
    builder, _, rest = source.partition(":")
    if rest and builder in DATASET_BUILDERS:
        path = Path(rest)
        if not path.is_file():
            raise ValueError(f"prompt file not found: {path} (from {source!r})")
        return _read_dataset(builder, path)
    path = Path(source)
    if path.is_dir():
        raise ValueError(f"prompt file {source} is a folder; give a .jsonl, .json or .parquet file")
    if path.exists() and not path.is_file():
        raise ValueError(f"prompt file {source} is not a regular file (a pipe or device): give a file")
    if not path.is_file():
        raise ValueError(f"prompt file not found: {source}")
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(
        f"unknown prompt source format: {source} (expected .jsonl, .json, .parquet or one of "
        f"{', '.join(b + ':PATH' for b in DATASET_BUILDERS)})"
    )


def load_prompts(source: str | Path, field: str = "prompt", limit: int | None = None,
                 tokenizer=None) -> list[str]:
    """The ``field`` strings of a prompt set, in file order, at most ``limit`` of them.

    ``source`` is a ``.jsonl``/``.json`` (JSON lines) file, a ``.parquet`` file, or a datasets spec such as
    ``json:path`` or ``parquet:path``. A row without ``field`` but with ``messages`` (the chat format of HF datasets)
    is rendered with ``tokenizer``'s chat template and the generation prompt. Raises ValueError for a missing file,
    a missing or non-string field, a chat row without a chat template, or an empty result.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    rows = _read_rows(str(source))
    if not rows:
        raise ValueError(f"no prompts in {source}")
    chosen = rows[:limit] if limit is not None else rows
    chat = [field not in row and "messages" in row for row in chosen]
    if any(chat) and not all(chat):  # one kind per file: a chat model reading a raw line, or the reverse, is a slip
        raise ValueError(f"{source}: row {chat.index(True) + 1} is a chat row (messages) and row "
                         f"{chat.index(False) + 1} a {field!r} row; a prompt file holds one kind")
    prompts = [_row_text(row, field, tokenizer, f"{source}: row {index}") for index, row in enumerate(chosen, start=1)]
    if not any(p.strip() for p in prompts):
        raise ValueError(f"{source}: every {field!r} value is empty")
    empty = next((index for index, p in enumerate(prompts, start=1) if not p.strip()), None)
    if empty is not None:  # it would decode from nothing but the start token: refused here as bench refuses it
        raise ValueError(f"{source}: row {empty} has an empty {field!r}")
    return prompts


def _row_text(row: dict[str, Any], field: str, tokenizer, where: str) -> str:
    """One row's prompt text: its ``field``, or its ``messages`` rendered with the chat template."""
    if field not in row and "messages" in row:
        try:
            return render_chat(tokenizer, row["messages"])
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
    if field not in row:
        available = ", ".join(sorted(row)) or "none"
        raise ValueError(f"{where} has no field {field!r} (fields: {available})")
    value = row[field]
    if not isinstance(value, str):
        raise ValueError(f"{where} field {field!r} is {type(value).__name__}, not a string")
    return value


def load_prompt_texts(source: str, field: str = "prompt", limit: int | None = None, split: str = "train",
                      tokenizer=None) -> list[str]:
    """Prompt texts from any source the collect config names (``prompts.source``).

    ``builtin:train`` / ``builtin:heldout`` (the stdlib prompt builder's splits), ``chat:SET`` or ``mixed:SET`` (a
    chat set of :mod:`data_gen.chat_prompts`, rendered with ``tokenizer``'s chat template), a file
    :func:`load_prompts` reads (chat rows rendered the same way), or ``hf:NAME`` for a ``datasets`` data set
    (``split`` and ``field`` apply; offline, it must be in the HF cache). Raises ValueError with one line for every
    problem.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"prompts.limit must be at least 1, got {limit}")
    if source.startswith("builtin:"):
        texts = [r["prompt"] for r in build_prompts(count=limit or 10**6, split=source.split(":", 1)[1])]
    elif split_source(source) is not None:
        workload, chat_set = split_source(source)
        records = build_chat_prompts(chat_set, count=limit, workload=workload)
        texts = [render_chat(tokenizer, r["messages"]) for r in records]
    elif source.startswith("hf:"):
        texts = _hub_prompts(source[3:], split, field, limit)
    else:
        texts = load_prompts(source, field=field, limit=limit, tokenizer=tokenizer)
    if not texts:
        raise ValueError(f"no prompts from {source}")
    return texts


def _hub_prompts(name: str, split: str, field: str, limit: int | None) -> list[str]:
    from datasets import load_dataset

    try:
        data = load_dataset(name, split=split)
    except Exception as err:  # datasets raises many types; offline misses are the usual cause
        where = f"data set {name!r} split {split!r}"
        raise ValueError(f"cannot load {where} (offline, it must be in the HF cache): {err}") from err
    if field not in data.column_names:
        raise ValueError(f"data set {name!r} has no field {field!r} (fields: {', '.join(data.column_names)})")
    texts = [str(x) for x in data[field][: limit or len(data)]]
    if not texts:
        raise ValueError(f"data set {name!r} split {split!r} is empty")
    return texts
