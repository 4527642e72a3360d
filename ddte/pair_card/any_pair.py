"""The card of any pair named by a pair YAML (``ddte pair-card --pair NAME``): the real pretrained pair's figures.

For a :class:`~decode.pair.PairSpec` this measures, with both models in the pair's own dtypes on CPU:
  * architecture, parameters and dtype of each model;
  * pass times in the decoding loop (the decoder's wrappers through :func:`decode.latency.measure_latency`): the
    target's one-token and tree passes, the draft's one-token pass warm and its cache-cold first pass of a step
    (warm + c(l)), and their ratios to a one-token target pass;
  * acceptance 1 − TV(p, q) at T = 0.6 and 1 on target-sampled continuations of the pair's held-out prompts, for
    the prompts like the training data and those unlike it when the prompts are chat sets (``chat:heldout-like``,
    ``chat:heldout-unlike``);
  * one sample of the target at T = 0.8.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Any

import torch

from ddte.pair_card.shipped import describe
from distill.evaluate import acceptance_on_target_samples, sample_continuation


@dataclass
class PairCardSettings:
    pair: str
    threads: int = 1
    cache_len: int = 256
    tree_nodes: int = 8
    repeats: int = 10
    num_prompts: int = 24
    max_new_tokens: int = 32
    sample_tokens: int = 60
    seed: int = 0


def prompt_groups(heldout: str) -> dict[str, str]:
    """Held-out prompt sources by group: like/unlike for chat sets, else the one held-out source."""
    if heldout == "chat:heldout":
        return {"like": "chat:heldout-like", "unlike": "chat:heldout-unlike"}
    return {"heldout": heldout}


def measure_pair(settings: PairCardSettings) -> dict[str, Any]:
    """Every figure of the card (see the module docstring) as a JSON-ready dict."""
    from data_gen.prompts import load_prompt_texts
    from decode.latency import measure_latency
    from decode.pair import read_pair_config

    torch.set_num_threads(settings.threads)
    spec = read_pair_config(settings.pair)
    pair = spec.load()
    target, draft = pair.target.model, pair.draft.model
    result: dict[str, Any] = {
        "pair": str(spec.source), "threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "load_average_at_start": os.getloadavg()[0],
        "architecture": {"target": describe(target) | {"dtype": str(pair.target.dtype)},
                         "draft": describe(draft) | {"dtype": str(pair.draft.dtype)}},
    }
    table = measure_latency(pair.target, pair.draft, lengths=[settings.cache_len], sizes=[1, settings.tree_nodes],
                            repeats=settings.repeats)
    target_one = table.target_ms[0][0]
    draft_warm = table.draft_ms[0][0]
    draft_cold = draft_warm + (table.step_extra_ms[0] if table.step_extra_ms else 0.0)
    result["loop_latency"] = {
        "cache_len": table.lengths[0], "tree_nodes": settings.tree_nodes, "repeats": settings.repeats,
        "draft_wrapper": type(pair.draft).__name__, "target_one_token_ms": target_one,
        "target_tree_ms": table.target_ms[0][1], "draft_one_token_ms": draft_warm,
        "draft_first_pass_ms": draft_cold, "draft_tree_level_ms": table.draft_ms[0][1],
        "tree_over_one_token": table.target_ms[0][1] / target_one,
        "draft_over_target": draft_warm / target_one, "draft_first_pass_over_target": draft_cold / target_one,
    }
    context = min(pair.context_limit, 2048)
    for group, source in prompt_groups(spec.heldout_prompts).items():
        prompts = load_prompt_texts(source, limit=settings.num_prompts, tokenizer=pair.tokenizer)
        for t in (0.6, 1.0):
            result[f"acceptance_{group}_T{t:g}"] = acceptance_on_target_samples(
                target, draft, pair.tokenizer, prompts, settings.max_new_tokens, context, settings.seed,
                temperature=t)
    first = load_prompt_texts(spec.heldout_prompts, limit=1, tokenizer=pair.tokenizer)[0]
    ids = list(pair.tokenizer(first)["input_ids"])
    with torch.inference_mode():
        new = sample_continuation(target, ids, settings.sample_tokens, 0.8, torch.Generator().manual_seed(0))
    result["sample_T0.8"] = {"prompt": first, "completion": pair.tokenizer.decode(new)}
    return result


def pair_markdown(result: dict[str, Any]) -> str:
    """The card's tables from a :func:`measure_pair` result."""
    arch, loop = result["architecture"], result["loop_latency"]
    lines = [
        "| | target | draft |", "|---|---|---|",
        "| layers × hidden (heads) | {layers} × {hidden} ({heads}) | ".format(**arch["target"])
        + "{layers} × {hidden} ({heads}) |".format(**arch["draft"]),
        f"| parameters | {arch['target']['parameters'] / 1e6:.1f} M | {arch['draft']['parameters'] / 1e6:.2f} M |",
        f"| dtype | {arch['target']['dtype']} | {arch['draft']['dtype']} |",
        "",
        f"Pass times in the decoding loop after {loop['cache_len']} tokens (median of {loop['repeats']}, "
        f"{result['threads']} thread(s), load average {result['load_average_at_start']:.2f} at start):",
        "", "| pass | ms | / one-token target pass |", "|---|---:|---:|",
        f"| target, 1 token | {loop['target_one_token_ms']:.2f} | 1 |",
        f"| target, {loop['tree_nodes']}-token tree | {loop['target_tree_ms']:.2f} | "
        f"{loop['tree_over_one_token']:.2f} |",
        f"| draft ({loop['draft_wrapper']}), 1 token, warm | {loop['draft_one_token_ms']:.3f} | "
        f"1/{1 / loop['draft_over_target']:.0f} |",
        f"| draft, a step's first pass (cache-cold) | {loop['draft_first_pass_ms']:.3f} | "
        f"1/{1 / loop['draft_first_pass_over_target']:.0f} |",
        "", "| acceptance 1 − TV(p, q), held-out prompts | T = 0.6 | T = 1 |", "|---|---:|---:|",
    ]
    groups = sorted({k.split("_")[1] for k in result if k.startswith("acceptance_")})
    for group in groups:
        low, high = result[f"acceptance_{group}_T0.6"], result[f"acceptance_{group}_T1"]
        lines.append(f"| {group} ({high['prompts']} prompts × {high['new_tokens_per_prompt']} tokens) | "
                     f"{low['mean']:.3f} ± {low['std']:.3f} | {high['mean']:.3f} ± {high['std']:.3f} |")
    return "\n".join(lines) + "\n"
