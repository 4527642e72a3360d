"""Training text for a draft of a chat model: chat-templated conversations, and the target's own responses.

Two kinds of sequence, each one conversation rendered with the tokenizer's chat template, ending with its eos:

* **fixed text** from ``../shared/data`` (:mod:`data_gen.chat_prompts`' training split only): a gsm8k question
  with its worked answer as the assistant's turn, a humaneval function with its canonical body, and the other
  training prompts followed by the target's own response when one is cached;
* **the target's responses**: the target samples a response to each of the first ``responses`` training prompts
  once (batched HF ``generate`` in the target's dtype), and the token ids are cached as JSON under the cache folder
  keyed by the target's weights, its dtype and the sampling settings. These are the contexts the draft meets in
  decoding: every accepted token is the target's.

The teacher's next-token laws are computed on the fly during training (a cache of full laws would take
49,152 floats per token); only token ids are cached. Validation uses the held-out chat set built the same way,
without target responses for the prompts that have no reference answer.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from data_gen.chat_prompts import build_chat_prompts
from ddte_core.paths import staged_file
from decode.pair import render_chat
from distill.teacher_cache import left_padded, until_eos


def _conversation(tokenizer, user: str, assistant: str) -> list[int]:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer(text)["input_ids"])


def reference_answer(record: dict) -> str | None:
    """The data set's own answer to a chat record (gsm8k's worked answer, humaneval's canonical body), if any."""
    return record.get("answer")


def fixed_sequences(tokenizer, chat_set: str, responses: dict[str, list[int]] | None = None,
                    root: Path | None = None, response_weight: int = 1) -> list[list[int]]:
    """One token sequence per record of ``chat_set`` that has an answer: a cached target response (``responses`` by
    record id, ``response_weight`` copies), else a reference answer. Records with neither are skipped."""
    sequences = []
    for record in build_chat_prompts(chat_set, root=root):
        user = record["messages"][0]["content"]
        if responses and record["id"] in responses:
            prompt = list(tokenizer(render_chat(tokenizer, record["messages"]))["input_ids"])
            sequences.extend([prompt + responses[record["id"]]] * response_weight)
        elif reference_answer(record) is not None:
            sequences.append(_conversation(tokenizer, user, record["answer"]))
    if not sequences:
        raise ValueError(f"chat set {chat_set!r} has no sequence to train on")
    return sequences


def stream_of(sequences: list[list[int]], eos: int | None) -> torch.Tensor:
    """All sequences as one stream ``(n,)``, each followed by ``eos``."""
    ids: list[int] = []
    for sequence in sequences:
        ids.extend(sequence)
        if eos is not None and (not sequence or sequence[-1] != eos):
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def response_cache_path(cache_dir: Path, fingerprint: str, count: int, tokens: int, temperature: float) -> Path:
    key = hashlib.sha256(f"{fingerprint}:{count}:{tokens}:{temperature}".encode()).hexdigest()[:16]
    return cache_dir / f"responses-{key}.json"


def target_responses(target, tokenizer, fingerprint: str, count: int, tokens: int, temperature: float,
                     cache_dir: Path, batch_size: int = 16, seed: int = 0,
                     log: Callable[[str], None] = print) -> dict[str, list[int]]:
    """The target's sampled responses (token ids, eos included when reached) to the first ``count`` training
    prompts, by record id: read from the cache when present, else generated once and cached atomically."""
    if count <= 0:
        return {}
    path = response_cache_path(cache_dir, fingerprint, count, tokens, temperature)
    if path.is_file():
        return {k: list(v) for k, v in json.loads(path.read_text())["responses"].items()}
    records = build_chat_prompts("train", count=count)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: dict[str, list[int]] = {}
    start = time.perf_counter()
    torch.manual_seed(seed)
    for first in range(0, len(records), batch_size):
        batch = records[first : first + batch_size]
        prompts = [list(tokenizer(render_chat(tokenizer, r["messages"]))["input_ids"]) for r in batch]
        ids, mask = left_padded(prompts, pad)
        width = ids.shape[1]
        with torch.no_grad():
            generated = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                        top_k=None, top_p=None, max_new_tokens=tokens, pad_token_id=pad)
        for record, row in zip(batch, generated[:, width:].tolist(), strict=True):
            out[record["id"]] = until_eos(row, tokenizer.eos_token_id)
        done = sum(map(len, out.values()))
        log(f"target responses: {len(out)}/{len(records)} prompts, {done} tokens, "
            f"{done / (time.perf_counter() - start):.0f} tokens/s")
    seconds = time.perf_counter() - start
    with staged_file(path) as tmp:
        tmp.write_text(json.dumps({"count": count, "tokens": tokens, "temperature": temperature,
                                   "seconds": round(seconds, 1), "responses": out}))
    return out
