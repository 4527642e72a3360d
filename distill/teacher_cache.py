"""The target's own responses with its next-token laws, sampled once and cached: a teacher-free training set.

Decoding drafts from contexts whose every accepted token is the target's, so the draft of a chat target should
learn on the target's own responses. Sampling a response already computes the target's law at each of its
tokens; this module keeps it instead of recomputing it in training, and training then needs no target at all.

A full law is 49,152 floats per token, so each is kept as its ``k`` largest logits and their token ids, plus the
log-normaliser ``log Σ exp(l / T)`` over the whole vocabulary at each training temperature ``T``. From those,
``log p_T(i) = l_i / T − L_T`` exactly for the top ``k``, and the rest of the mass is ``1 − Σ p_T(i)``: the
coarsened law :func:`distill.module.coarsen` trains on.

One :class:`TeacherLaws` owns the file contract (a safetensors file whose metadata holds the settings).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from ddte_core.paths import staged_file
from decode.models.draft_vocab import DraftVocab, most_frequent

FORMAT = "ddte-teacher-laws/1"


@dataclass
class TeacherLaws:
    """Sequences ``prompt + response`` and the target's law at every response token.

    ``tokens`` ``(M,)`` holds all sequences back to back, sequence ``j`` at ``offsets[j] : offsets[j + 1]``; its
    response starts at ``tokens[offsets[j] + starts[j]]``. Row ``r`` of ``top_ids``/``top_logits`` ``(N, k)`` and
    ``log_norm`` ``(N, len(temperatures))`` is the law of the ``r``-th response token overall (responses in
    sequence order), the law that token was sampled from at ``sample_temperatures[j]``.
    """

    tokens: torch.Tensor  # (M,) int32
    offsets: torch.Tensor  # (S + 1,) int64
    starts: torch.Tensor  # (S,) int64
    sample_temperatures: torch.Tensor  # (S,) float32
    top_ids: torch.Tensor  # (N, k) int32
    top_logits: torch.Tensor  # (N, k) float32
    log_norm: torch.Tensor  # (N, len(temperatures)) float32
    temperatures: list[float]
    seconds: float = 0.0
    vocab_size: int = 0  # the target's vocabulary V (0: a file from before it was recorded)

    def __len__(self) -> int:
        return self.starts.numel()

    def sequence(self, j: int) -> list[int]:
        return self.tokens[self.offsets[j] : self.offsets[j + 1]].tolist()

    def response_offsets(self) -> torch.Tensor:
        """``(S + 1,)``: sequence ``j``'s response laws are rows ``[r[j], r[j + 1])``."""
        lengths = (self.offsets[1:] - self.offsets[:-1]) - self.starts  # (S,) response lengths
        return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])

    def response_rows(self, j: int) -> slice:
        """The rows of sequence ``j``'s response laws."""
        rows = self.response_offsets()
        return slice(int(rows[j]), int(rows[j + 1]))

    def response_token_count(self) -> int:
        return self.top_ids.shape[0]

    def save(self, path: Path) -> None:
        """Write atomically (staged beside ``path``, then renamed)."""
        from safetensors.torch import save_file

        tensors = {"tokens": self.tokens, "offsets": self.offsets, "starts": self.starts,
                   "sample_temperatures": self.sample_temperatures, "top_ids": self.top_ids,
                   "top_logits": self.top_logits, "log_norm": self.log_norm}
        meta = {"format": FORMAT, "temperatures": json.dumps(self.temperatures), "seconds": f"{self.seconds:.1f}",
                "vocab_size": str(self.vocab_size)}
        with staged_file(path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)

    @classmethod
    def load(cls, path: Path) -> TeacherLaws:
        """Read a file :meth:`save` wrote; ValueError for anything else."""
        from ddte_core.tensor_files import read_tensor_file

        tensors, meta = read_tensor_file(path, FORMAT, "teacher laws")
        return cls(temperatures=json.loads(meta["temperatures"]), seconds=float(meta.get("seconds", 0)),
                   vocab_size=int(meta.get("vocab_size", 0)), **tensors)


def cache_path(cache_dir: Path, fingerprint: str, plan: list[tuple[str, float]], tokens: int, k: int,
               temperatures: list[float], seed: int) -> Path:
    """The cache file of one sampling plan: keyed by everything the laws depend on."""
    key = json.dumps([fingerprint, plan, tokens, k, temperatures, seed])
    return cache_dir / f"laws-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def keep_laws(logits: torch.Tensor, k: int, temperatures: list[float]) -> tuple[torch.Tensor, ...]:
    """``logits`` ``(n, V)`` -> (top ids ``(n, k)`` int32, top logits ``(n, k)``, log-normalisers ``(n, T)``)."""
    logits = logits.float()
    values, ids = logits.topk(k, dim=-1)
    log_norm = torch.stack([torch.logsumexp(logits / t, dim=-1) for t in temperatures], dim=-1)
    return ids.int(), values, log_norm


def sample_responses(target, tokenizer, prompts: list[list[int]], sample_temperatures: list[float],
                     max_tokens: int, k: int, temperatures: list[float], batch_size: int = 64, seed: int = 0,
                     log: Callable[[str], None] = print) -> TeacherLaws:
    """The target's response to each prompt (token ids), sampled at its own temperature, with the laws kept.

    Prompts are grouped by temperature, batched by length (less padding) and left-padded; a response ends at
    the tokenizer's eos (included) or after ``max_tokens``.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    groups: dict[float, list[int]] = {}
    for j in sorted(range(len(prompts)), key=lambda j: len(prompts[j])):
        groups.setdefault(sample_temperatures[j], []).append(j)
    batches = [group[i : i + batch_size] for _, group in sorted(groups.items())
               for i in range(0, len(group), batch_size)]
    responses: dict[int, tuple[list[int], tuple[torch.Tensor, ...]]] = {}
    start, done = time.perf_counter(), 0
    for number, chunk in enumerate(batches):
        ids, mask = left_padded([prompts[j] for j in chunk], pad)
        width = ids.shape[1]
        torch.manual_seed(seed + number)
        with torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                  temperature=sample_temperatures[chunk[0]], top_k=None, top_p=None,
                                  max_new_tokens=max_tokens, pad_token_id=pad, output_logits=True,
                                  return_dict_in_generate=True)
        steps = torch.stack(out.logits, dim=1)  # (b, steps, V): the raw laws each token was drawn from
        for row, j in enumerate(chunk):
            response = until_eos(out.sequences[row, width:].tolist(), eos)
            responses[j] = (response, keep_laws(steps[row, : len(response)], k, temperatures))
            done += len(response)
        del steps, out
        log(f"target responses: batch {number + 1}/{len(batches)}, {done} tokens, "
            f"{done / (time.perf_counter() - start):.0f} tokens/s")
    laws = _assemble(prompts, sample_temperatures, responses, temperatures, time.perf_counter() - start)
    laws.vocab_size = int(target.config.get_text_config().vocab_size)
    return laws


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as one left-padded batch for HF ``generate``: (ids ``(b, width)``, attention mask)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """A sampled response up to and including its first ``eos`` (all of it when there is none; HF pads after)."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _assemble(prompts, sample_temperatures, responses, temperatures, seconds) -> TeacherLaws:
    sequences = [prompts[j] + responses[j][0] for j in range(len(prompts))]
    lengths = torch.tensor([len(s) for s in sequences])
    laws = [responses[j][1] for j in range(len(prompts))]
    return TeacherLaws(
        tokens=torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        starts=torch.tensor([len(p) for p in prompts]),
        sample_temperatures=torch.tensor(sample_temperatures, dtype=torch.float32),
        top_ids=torch.cat([law[0] for law in laws]), top_logits=torch.cat([law[1] for law in laws]),
        log_norm=torch.cat([law[2] for law in laws]), temperatures=list(temperatures), seconds=seconds,
    )


@dataclass
class LawBatch:
    """One training batch of cached laws: ``ids`` ``(B, S)`` right-padded; at position ``s`` (predicting token
    ``s + 1``) where ``mask[b, s]``, the teacher's top ids ``(B, S - 1, k)`` and ``log_p_top`` ``(T, B, S - 1, k)``
    (log-probabilities at each training temperature)."""

    ids: torch.Tensor
    mask: torch.Tensor
    top_ids: torch.Tensor
    log_p_top: torch.Tensor

    @property
    def size(self) -> int:
        return self.ids.shape[0]


class LawBatches(IterableDataset):
    """An endless, seeded stream of :class:`LawBatch` of ``batch_size`` random sequences of ``laws``; each
    sequence is cut to its last ``max_len`` tokens (keeping its response)."""

    def __init__(self, laws: TeacherLaws, batch_size: int, max_len: int, seed: int) -> None:
        self.laws, self.batch_size, self.max_len, self.seed = laws, batch_size, max_len, seed
        self.first_row = laws.response_offsets()

    def batch(self, picks: list[int]) -> LawBatch:
        laws, k = self.laws, self.laws.top_ids.shape[1]
        seqs = [laws.tokens[laws.offsets[j] : laws.offsets[j + 1]].long() for j in picks]
        cuts = [max(0, s.numel() - self.max_len) for s in seqs]
        width = max(s.numel() - c for s, c in zip(seqs, cuts, strict=True))
        ids = torch.zeros(len(picks), width, dtype=torch.long)
        mask = torch.zeros(len(picks), width - 1, dtype=torch.bool)
        top_ids = torch.zeros(len(picks), width - 1, k, dtype=torch.long)
        top_logits = torch.zeros(len(picks), width - 1, k)
        log_norm = torch.zeros(len(picks), width - 1, len(laws.temperatures))
        for b, (j, seq, cut) in enumerate(zip(picks, seqs, cuts, strict=True)):
            ids[b, : seq.numel() - cut] = seq[cut:]
            rows = slice(int(self.first_row[j]), int(self.first_row[j + 1]))
            first = int(laws.starts[j]) - 1 - cut  # the position predicting the first response token
            n = rows.stop - rows.start
            if first < 0:  # the cut removed the response's first tokens' contexts
                rows, n, first = slice(rows.start - first, rows.stop), n + first, 0
            mask[b, first : first + n] = True
            top_ids[b, first : first + n] = laws.top_ids[rows].long()
            top_logits[b, first : first + n] = laws.top_logits[rows]
            log_norm[b, first : first + n] = laws.log_norm[rows]
        temps = torch.tensor(laws.temperatures).view(-1, 1, 1, 1)
        log_p_top = top_logits.unsqueeze(0) / temps - log_norm.permute(2, 0, 1).unsqueeze(-1)  # (T, B, S-1, k)
        return LawBatch(ids, mask, top_ids, log_p_top)

    def __iter__(self) -> Iterator[LawBatch]:
        from ddte_core.distributed import rank_seed

        generator = torch.Generator().manual_seed(rank_seed(self.seed))  # each rank of a DDP job its own batches
        while True:
            picks = torch.randint(0, len(self.laws), (self.batch_size,), generator=generator).tolist()
            yield self.batch(picks)


def target_token_mass(laws: TeacherLaws, vocab_size: int, temperature_index: int = -1) -> torch.Tensor:
    """``(V,)`` the target's expected token counts over its responses: Σ over response tokens of p_T(i), each law
    known on its top k (the rest of its mass, spread over unknown tokens, is left out)."""
    p_top = (laws.top_logits / laws.temperatures[temperature_index]
             - laws.log_norm[:, temperature_index].unsqueeze(-1)).exp()  # (N, k)
    return torch.zeros(vocab_size).index_add_(0, laws.top_ids.flatten().long(), p_top.flatten())


def choose_draft_vocab(laws: TeacherLaws, vocab_size: int, size: int, always: list[int]) -> DraftVocab:
    """The ``size`` tokens of largest expected count in the target's responses (plus ``always``), with the share
    of the target's mass they hold on those responses (at the last training temperature, a lower bound).

    Raises:
        ValueError: the laws are of a target with another vocabulary than ``vocab_size``.
    """
    largest = int(laws.top_ids.max()) if laws.top_ids.numel() else -1
    if (laws.vocab_size and laws.vocab_size != vocab_size) or largest >= vocab_size:
        known = f"{laws.vocab_size} tokens" if laws.vocab_size else f"token ids up to {largest}"
        raise ValueError(f"these laws are of a target with {known}; this draft's vocabulary has {vocab_size}: give "
                         "the laws of the draft's own target")
    mass = target_token_mass(laws, vocab_size)
    chosen = most_frequent(mass, size, always)
    covered = float(mass[chosen.token_ids].sum()) / laws.response_token_count()
    return DraftVocab(chosen.token_ids, vocab_size, {
        "source": "target responses' laws (ddte draft-vocab)", "response_tokens": laws.response_token_count(),
        "temperature": laws.temperatures[-1], "target_mass_covered": round(covered, 4)})
