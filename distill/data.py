"""The draft's training text: windows of the stdlib training split, and held-out windows for validation.

Only modules of the corpus's training split are ever trained on (the held-out modules of the pair's recipe stay
unseen, so held-out prompts remain held out for every model). The target's distributions are NOT cached: they are
computed on the fly for each batch. A cache of full next-token laws would take V = 4096 floats per token (16 KiB;
2.6 M training tokens would need 42 GB), and the on-policy batches, whose tokens the draft samples as it learns,
cannot be cached at all; the target's forward costs about as much as the draft's training step (measured in the
distill summary).
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset

from data_gen.corpus import SourceFile, list_corpus, select_split, subset
from ddte_core.distributed import rank_seed


def corpus_files(heldout_fraction: float, max_files: int | None) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training-split modules, held-out modules) of the stdlib corpus."""
    files = subset(list_corpus(heldout_fraction=heldout_fraction), max_files)
    train, heldout = select_split(files, "train"), select_split(files, "heldout")
    if not train or not heldout:
        raise ValueError("the corpus needs at least one training and one held-out module")
    return train, heldout


def token_stream(tokenizer, files: list[SourceFile]) -> torch.Tensor:
    """All files as one stream of token ids ``(n,)``, each file as the tokenizer encodes it (with its bos)."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for f in files:
        ids.extend(tokenizer(f.read())["input_ids"])
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def evenly_spaced_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """``(count, seq_len)`` windows at evenly spaced offsets (a fixed validation set)."""
    if stream.numel() <= seq_len:
        raise ValueError(f"the held-out text has {stream.numel()} tokens, fewer than one window of {seq_len}")
    starts = torch.linspace(0, stream.numel() - seq_len - 1, count).long().tolist()
    return torch.stack([stream[s : s + seq_len] for s in starts])


class RandomWindows(IterableDataset):
    """An endless, seeded stream of ``(batch_size, seq_len)`` random windows of a token stream; each rank of a
    multi-process job draws its own (``seed`` itself on rank 0)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        if stream.numel() <= seq_len:
            raise ValueError(f"the training text has {stream.numel()} tokens, fewer than one window of {seq_len}")
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(rank_seed(self.seed))
        while True:
            starts = torch.randint(0, self.stream.numel() - self.seq_len, (self.batch_size,), generator=generator)
            yield torch.stack([self.stream[s : s + self.seq_len] for s in starts.tolist()])
