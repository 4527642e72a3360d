"""How well a draft serves its target: acceptance on decode-time contexts and the calibration of its confidence.

Both are measured where drafting happens: on contexts the *target* generates from held-out prompts (not on human
text), at a sampling temperature T.

* :func:`acceptance_on_target_samples`: β = Σ min(p_T, q_T) = 1 − TV at every position of target-sampled
  continuations (the model card's acceptance figure at T = 1).
* :func:`drafting_calibration`: from roots on those contexts, the draft drafts a chain of tokens; at every chain
  node the draft's top probability and entropy are compared with the acceptance min(1, p(x)/q(x)) of the token x it
  drew and with the node's β. A draft whose confidence tracks acceptance lets a policy decide where to stop or
  branch (issue: "correlation of draft confidence with acceptance at trunk nodes").
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

PERCENTILES = (5, 10, 25, 50, 75, 90, 95)


@torch.inference_mode()
def sample_continuation(model, ids: list[int], new_tokens: int, temperature: float, gen: torch.Generator) -> list[int]:
    """Ancestral sampling at ``temperature`` (no top-k/top-p) with a KV cache; returns the new token ids."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
    out: list[int] = []
    for _ in range(new_tokens):
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=gen))
        out.append(token)
        logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def _laws(model, seq: list[int], start: int, temperature: float) -> torch.Tensor:
    """``(len(seq) - 1 - start, V)`` next-token laws at positions start .. len(seq) - 2, float64."""
    return torch.softmax(model(torch.tensor([seq])).logits[0, start:-1].double() / temperature, dim=-1)


@torch.inference_mode()
def acceptance_on_target_samples(target, draft, tokenizer, prompts: list[str], new_tokens: int, context: int,
                                 seed: int, temperature: float = 1.0) -> dict:
    """β at T on every context of target-sampled continuations of ``prompts`` (the last prompt position and every
    continuation position but the last), with its spread over contexts and prompts."""
    gen = torch.Generator().manual_seed(seed)
    values: list[float] = []
    per_prompt: list[float] = []
    for prompt in prompts:
        ids = tokenizer(prompt).input_ids[-(context - new_tokens) :]  # left-truncate to fit the context window
        seq = ids + sample_continuation(target, ids, new_tokens, temperature, gen)
        start = len(ids) - 1  # the position whose next-token law produced the first sampled token
        beta = torch.minimum(_laws(target, seq, start, temperature), _laws(draft, seq, start, temperature)).sum(-1)
        values.extend(beta.tolist())
        per_prompt.append(float(beta.mean()))
    ordered = sorted(values)

    def pct(k: int) -> float:
        return ordered[min(len(ordered) - 1, round(k / 100 * (len(ordered) - 1)))]

    return {
        "temperature": temperature,
        "contexts": len(values),
        "prompts": len(prompts),
        "new_tokens_per_prompt": new_tokens,
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "percentiles": {f"p{k}": pct(k) for k in PERCENTILES},
        "per_prompt_mean": {"min": min(per_prompt), "max": max(per_prompt), "std": statistics.pstdev(per_prompt)},
    }


@torch.inference_mode()
def drafting_calibration(target, draft, tokenizer, prompts: list[str], temperature: float, context_tokens: int = 32,
                         roots_per_prompt: int = 4, depth: int = 8, context: int = 512, seed: int = 0) -> dict:
    """Draft confidence against acceptance at the nodes of drafted chains (see the module docstring).

    Returns the number of nodes, the mean acceptance min(1, p/q) of the drawn tokens, the mean β, and the Pearson
    correlations of the draft's top probability (and of minus its entropy) with both; plus the ROC AUC of the top
    probability for telling a realised acceptance (a coin with probability min(1, p/q)) from a rejection.
    """
    gen = torch.Generator().manual_seed(seed)
    top, negentropy, accept, beta, depths = [], [], [], [], []
    for prompt in prompts:
        ids = tokenizer(prompt).input_ids[-(context - context_tokens - depth - 1) :]
        seq = ids + sample_continuation(target, ids, context_tokens, temperature, gen)
        for r in range(roots_per_prompt):
            root = len(ids) + (r * context_tokens) // roots_per_prompt  # roots spread over the continuation
            chain = seq[: root + 1] + sample_continuation(draft, seq[: root + 1], depth, temperature, gen)
            q = _laws(draft, chain, root, temperature)  # (depth, V): the law each chain token was drawn from
            p = _laws(target, chain, root, temperature)
            drawn = torch.tensor(chain[root + 1 :])
            q_x, p_x = q.gather(1, drawn[:, None])[:, 0], p.gather(1, drawn[:, None])[:, 0]
            top += q.max(-1).values.tolist()
            negentropy += (q * q.clamp_min(1e-300).log()).sum(-1).tolist()
            accept += torch.clamp(p_x / q_x, max=1.0).tolist()
            beta += torch.minimum(p, q).sum(-1).tolist()
            depths += list(range(depth))
    top_a, neg_a, acc_a, beta_a = (np.array(v) for v in (top, negentropy, accept, beta))
    coins = np.random.default_rng(seed).random(len(acc_a)) < acc_a
    return {
        "temperature": temperature,
        "nodes": len(acc_a),
        "mean_accept": float(acc_a.mean()),
        "mean_beta": float(beta_a.mean()),
        "corr_top_accept": _pearson(top_a, acc_a),
        "corr_top_beta": _pearson(top_a, beta_a),
        "corr_negentropy_accept": _pearson(neg_a, acc_a),
        "auc_top_accept": _auc(top_a, coins),
    }


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float("nan")


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counted half (Mann-Whitney)."""
    from scipy.stats import rankdata

    pos, neg = score[label], score[~label]
    if not len(pos) or not len(neg):
        return float("nan")
    ranks = rankdata(np.concatenate([pos, neg]))  # average ranks over ties
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))
