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
"""

from __future__ import annotations

import gzip
import hashlib
import json
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

CALCULATOR = re.compile(r"<<[^>]*>>")  # gsm8k's calculator annotations, not part of a natural answer
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


def shared_data_dir() -> Path:
    """``$DDTE_SHARED_DATA``, else ``../shared/data`` beside the repository."""
    env = os.environ.get("DDTE_SHARED_DATA")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def _heldout_by_hash(key: str) -> bool:
    value = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64
    return value < HELDOUT_FRACTION


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


def _spec_bench(root: Path) -> list[dict[str, Any]]:
    records = []
    for row in _read_jsonl(root / "spec_bench" / "question.jsonl"):
        category, ident, content = row["category"], str(row["question_id"]), row["turns"][0]
        if len(content) > MAX_CONTENT_CHARS:
            continue
        if category in UNTRAINED_CATEGORIES:
            records.append(_record("spec_bench", ident, category, content, "heldout", "unlike"))
        elif category in TRAINED_CATEGORIES:
            split = "heldout" if _heldout_by_hash(f"spec_bench:{ident}") else "train"
            records.append(_record("spec_bench", ident, category, content, split, "like"))
    return records


def _interleave(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Round-robin over sources (sorted by name), each source in stable hash order."""
    by_source: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_source.setdefault(record["source"], []).append(record)
    queues = [sorted(rows, key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
              for _, rows in sorted(by_source.items())]
    out, depth = [], 0
    while any(len(q) > depth for q in queues):
        out.extend(q[depth] for q in queues if len(q) > depth)
        depth += 1
    return out


def build_chat_prompts(chat_set: str = "heldout", count: int | None = None,
                       root: Path | None = None) -> list[dict[str, Any]]:
    """The records of ``chat_set`` (one of :data:`CHAT_SETS`), at most ``count``, deterministic.

    Raises:
        ValueError: an unknown set, or ``../shared/data`` missing.
    """
    if chat_set not in CHAT_SETS:
        raise ValueError(f"unknown chat prompt set {chat_set!r} (one of {', '.join(CHAT_SETS)})")
    root = shared_data_dir() if root is None else root
    records = _gsm8k(root) + _humaneval(root) + _spec_bench(root)
    split, _, group = chat_set.partition("-")
    chosen = [r for r in records if r["split"] == split and (not group or r["group"] == group)]
    chosen = _interleave(chosen)
    return chosen if count is None else chosen[:count]
