"""A draft's reduced output vocabulary (FR-Spec; SGLang's ``--speculative-token-map``): one file contract.

A draft for a 49,152-token vocabulary pays mostly for its output head. Restricted to the tokens its target
actually writes, the head is a fraction of that, and decoding stays exactly lossless: the draft's q puts zero
mass outside the set, and every verifier's residual ``max(p − q, 0)`` carries the target's mass on the tokens the
draft can never propose (tested by exact enumeration in ``tests/decode/exact/test_draft_vocab.py``).

The set lives beside the draft's weights as ``draft_vocab.safetensors`` (the token ids, ascending, and the
metadata that says how it was chosen). :func:`attach_draft_vocab` swaps the model's ``lm_head`` for a
:class:`SubsetHead` over the rows of those tokens; its logits are still full width ``(…, V)``, with ``-inf``
outside the set, so everything downstream (sampling, features, verifiers, HF assisted generation) is unchanged.
Inside :func:`support_logits` the head returns the set's logits alone ``(…, Vs)``: the drafting loop samples from
laws of that width (a sixth of SmolLM2's vocabulary) and widens only the rows the verifier reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ddte_core.paths import staged_file
from ddte_core.tensor_files import read_tensor_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FILE = "draft_vocab.safetensors"
FORMAT = "ddte-draft-vocab/1"


@dataclass(frozen=True)
class DraftVocab:
    """The token ids ``(Vs,)`` (int64, ascending, unique) a draft may propose, out of ``vocab_size``."""

    token_ids: torch.Tensor
    vocab_size: int
    info: dict = field(default_factory=dict)  # how the set was chosen: source, counted tokens, mass covered

    def __post_init__(self) -> None:
        ids = self.token_ids
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError("a draft vocabulary needs a non-empty 1-D list of token ids")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("draft vocabulary token ids must be ascending and unique")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"draft vocabulary token ids must lie in [0, {self.vocab_size})")

    @property
    def size(self) -> int:
        return self.token_ids.numel()

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/draft_vocab.safetensors`` atomically; returns its path."""
        from safetensors.torch import save_file

        path = Path(folder) / FILE
        with staged_file(path) as tmp:
            save_file({"token_ids": self.token_ids.contiguous()}, tmp, metadata={
                "format": FORMAT, "vocab_size": str(self.vocab_size), "info": json.dumps(self.info)})
        return path

    @classmethod
    def load(cls, folder: str | Path) -> DraftVocab | None:
        """The draft vocabulary saved in ``folder``, or None when it has none; ValueError for a bad file."""
        path = Path(folder) / FILE
        if not path.is_file():
            return None
        tensors, meta = read_tensor_file(path, FORMAT, "draft vocabulary")
        if "token_ids" not in tensors:
            raise ValueError(f"{path}: no token_ids in this draft vocabulary")
        return cls(tensors["token_ids"].long(), int(meta["vocab_size"]), json.loads(meta.get("info", "{}")))


def most_frequent(counts: torch.Tensor, size: int, always: list[int] | tuple[int, ...] = (),
                  info: dict | None = None) -> DraftVocab:
    """The ``size`` tokens with the largest ``counts`` ``(V,)`` (ties by id), plus ``always`` (eos, say)."""
    if not 1 <= size < counts.numel():  # the whole vocabulary would reduce nothing
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel() - 1}] (below the vocabulary's "
                         f"{counts.numel()}), got {size}")
    order = sorted(range(counts.numel()), key=lambda i: (-float(counts[i]), i))[:size]
    ids = torch.tensor(sorted(set(order) | {int(t) for t in always}), dtype=torch.long)
    return DraftVocab(ids, counts.numel(), dict(info or {}))


class SubsetHead(nn.Module):
    """An output head over the rows of a draft vocabulary: ``(..., H)`` -> full-width logits ``(..., V)``, or the
    vocabulary's own logits ``(..., Vs)`` (column i is token ``token_ids[i]``) while ``expand`` is False
    (:func:`support_logits`)."""

    token_ids: torch.Tensor  # a buffer: (Vs,) the draft vocabulary's ids

    def __init__(self, weight: torch.Tensor, vocab: DraftVocab) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight[vocab.token_ids].detach().clone(), requires_grad=False)  # (Vs, H)
        self.register_buffer("token_ids", vocab.token_ids.to(weight.device), persistent=False)  # moves with .to()
        self.vocab_size = vocab.vocab_size
        self.expand = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden, self.weight)  # (..., Vs)
        return expand_logits(logits, self.token_ids, self.vocab_size) if self.expand else logits


def support_ids(model: PreTrainedModel) -> torch.Tensor | None:
    """The token ids ``(Vs,)`` where ``model``'s logits can be finite (its draft vocabulary's, on its
    :class:`SubsetHead`), or None: every id."""
    return getattr(model.get_output_embeddings(), "token_ids", None)


@contextmanager
def support_logits(model: PreTrainedModel) -> Iterator[None]:
    """Within it, ``model``'s forward returns its draft vocabulary's logits ``(..., Vs)`` (a model without one keeps
    its full-width head). HF's forward calls the head itself, so the switch lives on the head."""
    head = model.get_output_embeddings()
    if not isinstance(head, SubsetHead):
        yield
        return
    head.expand = False
    try:
        yield
    finally:
        head.expand = True


def expand_logits(logits: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits ``(..., Vs)`` over ``token_ids`` ``(Vs,)`` -> ``(..., vocab_size)``, ``-inf`` at every other id."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, token_ids, logits)


def attach_draft_vocab(model, vocab: DraftVocab) -> None:
    """Replace ``model``'s output head (``lm_head``, bias-free) by a :class:`SubsetHead` over ``vocab``."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("a draft vocabulary needs a model with a bias-free output head")
    if head.weight.shape[0] != vocab.vocab_size:
        raise ValueError(f"draft vocabulary over {vocab.vocab_size} tokens, model head over {head.weight.shape[0]}")
    model.set_output_embeddings(SubsetHead(head.weight, vocab))
