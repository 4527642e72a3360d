"""Log-probabilities in OpenAI's two response shapes: a completion's ``{tokens, token_logprobs, top_logprobs,
text_offset}`` (a prompt's first token has none: null) and a chat's ``{content: [{token, logprob, bytes,
top_logprobs}]}``. A log-probability of minus infinity (a token the law sampled gives no mass: top-k, top-p, min-p,
greedy) is written -9999.0, as vLLM writes it: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from decode.generation import TokenLogprob

NO_MASS = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_MASS


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (each byte a printable character), read back: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenNames:
    """Each token id as text and bytes, as the log-probabilities name it (cached: a vocabulary's worth at most).

    A token that is part of a character (a byte-level BPE piece) has no text of its own: its bytes are read from the
    piece, and its name is ``bytes:\\xNN...``, as OpenAI names it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._names: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        """(the token's name, its UTF-8 bytes)."""
        if token not in self._names:
            self._names[token] = self._name(token)
        return self._names[token]

    def _name(self, token: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode())
        piece = self.tokenizer.convert_ids_to_tokens(token) or ""
        table = _byte_decoder()
        if not piece or any(c not in table for c in piece):
            return text, list(text.encode())
        raw = bytes(table[c] for c in piece)
        try:
            return raw.decode(), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def completion_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprob | None], names: TokenNames,
                        offset: int = 0) -> tuple[dict, int]:
    """(a completion's ``logprobs`` object for ``tokens``, the text offset after them). ``entries[i]``: token i's
    log-probability and its law's likeliest tokens (None: a prompt's first token, which has none). Each token's
    ``top_logprobs`` lists the likeliest and the token itself, as OpenAI's (up to k + 1 entries)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries, strict=True):
        name = names(token)[0]
        out["tokens"].append(name)
        out["text_offset"].append(offset)
        offset += len(name)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {names(t)[0]: finite(lp) for t, lp in entry.top}
        top.setdefault(name, finite(entry.logprob))
        out["token_logprobs"].append(finite(entry.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(entries: Sequence[TokenLogprob], names: TokenNames) -> dict:
    """A chat choice's ``logprobs`` object: each token's name, log-probability and bytes, and its law's k likeliest
    tokens the same way."""

    def one(token: int, logprob: float) -> dict:
        name, raw = names(token)
        return {"token": name, "logprob": finite(logprob), "bytes": raw}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}
