"""Chat prompt sets for real chat models, built from the public sets in ``../shared/data`` (never copied here).

Each record is one user turn in the chat format of HF datasets, ``{"messages": [{"role": "user", "content": ...}]}``,
plus provenance (``source``, ``id``, ``category``, ``split``, ``group``). A prompt consumer renders it with the
pair's tokenizer chat template and ``add_generation_prompt=True`` (:func:`decode.pair.render_chat`).

The split rule, fixed so every model and command sees the same sets:

* **gsm8k**: its own ``train.jsonl`` is training, its ``test.jsonl`` held out;
* **humaneval** and the **spec_bench** categories in :data:`TRAINED_CATEGORIES`: a record is held out when the
  first 8 bytes of ``sha256(source:id)``, read as a fraction of 2**64, fall below :data:`HELDOUT_FRACTION`;
* the spec_bench categories in :data:`UNTRAINED_CATEGORIES` are never trained on: held out, group ``unlike``.

Held-out records of the trained sources are group ``like`` (prompts like the training data); ``chat:heldout-like``
and ``chat:heldout-unlike`` name the two groups. Within a split the sources are interleaved round-robin in a stable
hash order, so the first n prompts of a set mix every source.

The **mixed** workload (``mixed:SET``, the Qwen2.5-Coder pair's prompts) takes every spec_bench category, RAG's
long retrieved passages included (user turns up to :data:`MIXED_MAX_CONTENT_CHARS`). Its split rule differs in one
point, so that every trained category has held-out prompts (spec_bench's MT-bench categories have 10 rows each, and
the hash threshold above holds out none of writing's): within each (source, category) of humaneval and the trained
spec_bench categories, the ``ceil(20 %)`` records with the smallest hash fraction are held out. gsm8k keeps its
files, and the untrained categories stay held out. The sets interleave round-robin over *categories* instead of
sources, so the first 13 held-out prompts cover every category (10 trained, 3 never trained on) and per-category
figures need few prompts.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

HELDOUT_FRACTION = 0.2
TRAINED_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "translation", "summarization", "qa",
                      "math_reasoning")
UNTRAINED_CATEGORIES = ("extraction", "stem", "humanities")  # spec_bench's MT-bench groups never trained on
CHAT_SETS = ("train", "heldout", "heldout-like", "heldout-unlike")
MAX_CONTENT_CHARS = 2000  # longer user turns (rag's retrieved passages) are left out: a 512-token prompt budget
WORKLOADS = ("chat", "mixed")  # the prompt-source prefixes chat:SET and mixed:SET
MIXED_CATEGORIES = (*TRAINED_CATEGORIES, "rag")  # the mixed workload trains on every category but the untrained
MIXED_MAX_CONTENT_CHARS = 4000  # RAG's turns are 2.7-3.5k characters (~900 tokens): a 32k-context pair takes them

CALCULATOR = re.compile(r"<<[^>]*>>")  # gsm8k's calculator annotations, not part of a natural answer
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


def shared_data_dir() -> Path:
    """``$DDTE_SHARED_DATA``, else ``../shared/data`` beside the repository."""
    env = os.environ.get("DDTE_SHARED_DATA")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def _hash_fraction(key: str) -> float:
    """The first 8 bytes of ``sha256(key)`` as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def _heldout_by_hash(key: str) -> bool:
    return _hash_fraction(key) < HELDOUT_FRACTION


def _split_by_rank(records: list[dict[str, Any]]) -> None:
    """The mixed workload's rule, in place: within each (source, category) of trained records outside gsm8k, the
    ``ceil(HELDOUT_FRACTION · n)`` with the smallest hash fraction of their id are held out, the rest trained on."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        if record["source"] != "gsm8k" and record["group"] == "like":
            groups.setdefault((record["source"], record["category"]), []).append(record)
    for rows in groups.values():
        cut = math.ceil(HELDOUT_FRACTION * len(rows))
        for rank, record in enumerate(sorted(rows, key=lambda r: _hash_fraction(r["id"]))):
            record["split"] = "heldout" if rank < cut else "train"


def _record(source: str, ident: str, category: str, content: str, split: str, group: str,
            answer: str | None = None) -> dict[str, Any]:
    record = {"messages": [{"role": "user", "content": content}], "source": source, "id": f"{source}:{ident}",
              "category": category, "split": split, "group": group}
    if answer is not None:
        record["answer"] = answer  # the data set's reference answer (distillation text; never shown as a prompt)
    return record


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"{path} not found: the chat prompt sets read ../shared/data (or $DDTE_SHARED_DATA)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _gsm8k(root: Path) -> list[dict[str, Any]]:
    records = []
    for split, name in (("train", "train.jsonl"), ("heldout", "test.jsonl")):
        for index, row in enumerate(_read_jsonl(root / "gsm8k" / name)):
            answer = CALCULATOR.sub("", row["answer"]).replace("#### ", "The answer is ")
            records.append(_record("gsm8k", f"{name}:{index}", "math", row["question"], split, "like", answer))
    return records


def _humaneval(root: Path) -> list[dict[str, Any]]:
    records = []
    for row in _read_jsonl(root / "humaneval" / "HumanEval.jsonl.gz"):
        ident = row["task_id"]
        split = "heldout" if _heldout_by_hash(f"humaneval:{ident}") else "train"
        answer = f"```python\n{row['prompt']}{row['canonical_solution']}```"
        records.append(_record("humaneval", ident, "coding", HUMANEVAL_TEMPLATE.format(prompt=row["prompt"]), split,
                               "like", answer))
    return records


def _spec_bench(root: Path, trained: tuple[str, ...] = TRAINED_CATEGORIES,
                max_chars: int = MAX_CONTENT_CHARS) -> list[dict[str, Any]]:
    records = []
    for row in _read_jsonl(root / "spec_bench" / "question.jsonl"):
        category, ident, content = row["category"], str(row["question_id"]), row["turns"][0]
        if len(content) > max_chars:
            continue
        if category in UNTRAINED_CATEGORIES:
            records.append(_record("spec_bench", ident, category, content, "heldout", "unlike"))
        elif category in trained:
            split = "heldout" if _heldout_by_hash(f"spec_bench:{ident}") else "train"
            records.append(_record("spec_bench", ident, category, content, split, "like"))
    return records


def _interleave(records: list[dict[str, Any]], key: str = "source") -> list[dict[str, Any]]:
    """Round-robin over the values of ``key`` (sorted), each group in stable hash order."""
    by_source: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_source.setdefault(record[key], []).append(record)
    queues = [sorted(rows, key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
              for _, rows in sorted(by_source.items())]
    out, depth = [], 0
    while any(len(q) > depth for q in queues):
        out.extend(q[depth] for q in queues if len(q) > depth)
        depth += 1
    return out


def build_chat_prompts(chat_set: str = "heldout", count: int | None = None,
                       root: Path | None = None, workload: str = "chat") -> list[dict[str, Any]]:
    """The records of ``chat_set`` (one of :data:`CHAT_SETS`) of ``workload`` (one of :data:`WORKLOADS`), at most
    ``count``, deterministic.

    Raises:
        ValueError: an unknown set or workload, or ``../shared/data`` missing.
    """
    if chat_set not in CHAT_SETS:
        raise ValueError(f"unknown chat prompt set {chat_set!r} (one of {', '.join(CHAT_SETS)})")
    if workload not in WORKLOADS:
        raise ValueError(f"unknown prompt workload {workload!r} (one of {', '.join(WORKLOADS)})")
    root = shared_data_dir() if root is None else root
    mixed = workload == "mixed"
    spec_bench = (_spec_bench(root, MIXED_CATEGORIES, MIXED_MAX_CONTENT_CHARS) if mixed else _spec_bench(root))
    records = _gsm8k(root) + _humaneval(root) + spec_bench
    if mixed:
        _split_by_rank(records)
    split, _, group = chat_set.partition("-")
    chosen = [r for r in records if r["split"] == split and (not group or r["group"] == group)]
    chosen = _interleave(chosen, "category" if mixed else "source")
    return chosen if count is None else chosen[:count]


def split_source(source: str) -> tuple[str, str] | None:
    """(workload, set) of a prompt source ``chat:SET`` or ``mixed:SET``; None for any other source."""
    workload, sep, chat_set = source.partition(":")
    return (workload, chat_set) if sep and workload in WORKLOADS else None
