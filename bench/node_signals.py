"""What a per-node halting signal costs in the drafting loop, and what a cheaper one would give up offline.

An expander decides at every trunk node from the draft's law there (decode/policies/expander.py). Two measurements:

* **Cost** (:func:`time_after_forward`): each variant turns one draft forward's logits ``(1, Vs)`` into the law and
  the signal, timed right after that forward, as the loop runs it. A forward streams the draft's weights through
  the caches, so every distinct operation after it pays a refill; timing a signal on a warm law reads several
  times too low. The variants run in a shuffled order, one per forward; ``law`` alone is the baseline the others
  add to.
* **Offline** (:func:`signals_from_hidden`): a data set's trunk nodes store the draft's final hidden state, so the
  law at each node, and any signal of it, can be recomputed through the draft's output head and compared with the
  stored entropy and top probability (a check that the recomputation is the collector's law). The signals then go
  through the same cross-fitted rule fit as ``ddte analyze --expansion``
  (:func:`selector.expander.expansion.signal_ratios`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from decode.drafting.sampling import SamplingConfig, distributions, entropy, law_entropy
from decode.models.cached_lm import CachedLM
from decode.models.draft_vocab import support_ids


def _law(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    return distributions(logits, sampling)[0]


def _entropy_via_log_softmax(logits: torch.Tensor, sampling: SamplingConfig) -> tuple[torch.Tensor, float]:
    """The law made through log-softmax, so the entropy is one dot away (no top-p: the law is the whole softmax)."""
    log_q = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)[0]
    q = log_q.exp()
    return q, -float(torch.dot(q, log_q))


# name -> logits (1, Vs) and sampling -> (law (Vs,), signal). "entropy" and "top" are what HaltingPolicy computes.
VARIANTS: dict[str, Callable[[torch.Tensor, SamplingConfig], tuple[torch.Tensor, float]]] = {
    "law": lambda lg, s: (_law(lg, s), 0.0),
    "top": lambda lg, s: ((q := _law(lg, s)), float(q.max())),
    "entropy": lambda lg, s: ((q := _law(lg, s)), law_entropy(q)),
    "entropy via log-softmax": _entropy_via_log_softmax,
    "collision Σq²": lambda lg, s: ((q := _law(lg, s)), float(torch.dot(q, q))),
}


def time_after_forward(draft: CachedLM, prompt_ids: Sequence[int], sampling: SamplingConfig, rounds: int,
                       seed: int = 0, variants: Sequence[str] | None = None) -> tuple[dict[str, list[float]],
                                                                                       dict[str, list[float]]]:
    """Microseconds from a one-token draft forward's logits to (law, signal), per variant, and the signals.

    Each round runs every variant once in a shuffled order, each right after its own forward of one token
    (greedy continuations of ``prompt_ids``, the cache cropped back every 24 tokens). Returns
    ``(times µs, values)``, each name -> ``rounds`` floats."""
    if sampling.greedy:
        raise ValueError("a halting signal needs a temperature > 0")
    names = list(variants or VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown signal variants {unknown}; known: {', '.join(VARIANTS)}")
    times: dict[str, list[float]] = {n: [] for n in names}
    values: dict[str, list[float]] = {n: [] for n in names}
    rng = np.random.default_rng(seed)
    support = support_ids(draft.model)
    with torch.inference_mode():
        draft.prefill(list(prompt_ids))
        base, token = draft.length, int(prompt_ids[-1])
        for _ in range(rounds):
            for name in rng.permutation(names):
                if draft.length >= base + 24:
                    draft.crop(base)
                logits = draft.extend_tree([token], [draft.length - 1], on_support=support is not None)
                start = time.perf_counter()
                _, value = VARIANTS[name](logits, sampling)
                times[name].append((time.perf_counter() - start) * 1e6)
                values[name].append(value)
                index = int(logits[0].argmax())
                token = index if support is None else int(support[index])
    return times, values


def cost_table(times: dict[str, list[float]]) -> str:
    """Markdown: median and quartiles per variant, and the median over ``law`` alone (what the signal adds)."""
    law = statistics.median(times["law"]) if "law" in times else None
    lines = ["| variant | median µs | 25–75 % µs | over the law alone µs |", "|---|---:|---:|---:|"]
    for name, ts in times.items():
        q25, q75 = np.percentile(ts, [25, 75])
        extra = "" if law is None or name == "law" else f"{statistics.median(ts) - law:.1f}"
        lines.append(f"| {name} | {statistics.median(ts):.1f} | {q25:.1f}–{q75:.1f} | {extra} |")
    return "\n".join(lines)


def signals_from_hidden(hidden: np.ndarray, head_weight: torch.Tensor, sampling: SamplingConfig,
                        chunk: int = 4096) -> dict[str, np.ndarray]:
    """``top``, ``entropy`` and ``collision`` (Σ q²) of the law at every stored node.

    Args:
        hidden: ``(..., H)`` the draft's final hidden states (after its final norm), NaN rows where no node was run.
        head_weight: ``(Vs, H)`` the draft's output head (its draft vocabulary's rows, or all V).
        sampling: the configuration the laws were drawn under.
    Returns: name -> ``hidden.shape[:-1]`` float64, NaN where the row was NaN.
    """
    flat = torch.from_numpy(np.ascontiguousarray(hidden.reshape(-1, hidden.shape[-1]), dtype=np.float32))
    weight = head_weight.detach()  # the product runs in the head's dtype, as the draft's forward runs it
    out = {name: np.full(flat.shape[0], np.nan) for name in ("top", "entropy", "collision")}
    with torch.inference_mode():
        for start in range(0, flat.shape[0], chunk):
            rows = flat[start:start + chunk]
            ok = torch.isfinite(rows).all(-1)
            q = distributions(rows[ok].to(weight.dtype) @ weight.T, sampling)  # (n, Vs) float32
            index = np.flatnonzero(ok.numpy()) + start
            out["top"][index] = q.max(-1).values.double().numpy()
            out["entropy"][index] = entropy(q).double().numpy()
            out["collision"][index] = (q * q).sum(-1).double().numpy()
    return {name: values.reshape(hidden.shape[:-1]) for name, values in out.items()}
