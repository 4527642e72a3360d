"""The card of any pair named by a pair YAML (``ddte pair-card --pair NAME``): the real pretrained pair's figures.

For a :class:`~decode.pair.PairSpec` this measures, with both models in the pair's own dtypes on CPU:
  * architecture, parameters and dtype of each model;
  * pass times in the decoding loop (the decoder's wrappers through :func:`decode.policies.latency.measure_latency`):
    the target's one-token and tree passes, the draft's one-token pass warm and its cache-cold first pass of a step
    (warm + c(l)), and their ratios to a one-token target pass;
  * acceptance 1 − TV(p, q) at T = 0.6 and 1 on target-sampled continuations of the pair's held-out prompts, for
    the prompts like the training data and those unlike it when the prompts are chat sets (``chat:heldout-like``,
    ``chat:heldout-unlike``), and per prompt category for the mixed workload (``mixed:heldout``); q is the draft's
    law as the decoding loop computes it (its wrapper: the fast forward, int8 layers where the pair sets them);
  * one sample of the target at T = 0.8.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ddte.pair_card.shipped import describe
from ddte_core.machine import cpu_model
from ddte_core.paths import latency_cache
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
    groups: tuple[str, ...] = ()  # the prompt groups to measure acceptance on (empty: all)


def prompt_groups(heldout: str, count: int, tokenizer) -> dict[str, list[str]]:
    """Held-out prompt texts by group, at most ``count`` a group: like/unlike for the chat sets, each category for
    the mixed workload, else the one held-out source."""
    from data_gen.chat_prompts import build_chat_prompts, split_source
    from data_gen.prompts import load_prompt_texts
    from decode.pair import render_chat

    if heldout == "chat:heldout":
        return {group: load_prompt_texts(f"chat:heldout-{group}", limit=count, tokenizer=tokenizer)
                for group in ("like", "unlike")}
    parsed = split_source(heldout)
    if parsed is not None and parsed[0] == "mixed":
        groups: dict[str, list[str]] = {}
        for record in build_chat_prompts(parsed[1], workload="mixed"):
            texts = groups.setdefault(record["category"], [])
            if len(texts) < count:
                texts.append(render_chat(tokenizer, record["messages"]))
        return groups
    return {"heldout": load_prompt_texts(heldout, limit=count, tokenizer=tokenizer)}


class LoopDraft:
    """The pair's draft as the decoding loop runs it (:class:`~decode.models.cached_lm.CachedLM` or its fast subclass,
    int8 layers included), called like an HF causal LM on one sequence ``(1, n)``: ``.logits`` ``(1, n, V)``, from one
    prefill pass."""

    def __init__(self, lm) -> None:
        self.lm = lm

    def __call__(self, ids: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.lm.prefill(ids[0].tolist())[None])


def measure_pair(settings: PairCardSettings) -> dict[str, Any]:
    """Every figure of the card (see the module docstring) as a JSON-ready dict."""
    from data_gen.prompts import load_prompt_texts
    from decode.pair import read_pair_config
    from decode.policies.latency import measure_latency

    torch.set_num_threads(settings.threads)
    spec = read_pair_config(settings.pair)
    pair = spec.load()
    choice = pair.use_kernels(None, latency_cache(), announce=lambda line: print(line, file=sys.stderr))
    groups = prompt_groups(spec.heldout_prompts, settings.num_prompts, pair.tokenizer)
    unknown = sorted(set(settings.groups) - set(groups))
    if unknown:  # before any measuring
        raise ValueError(f"--groups: no prompt group {unknown[0]!r} (this pair's: {', '.join(sorted(groups))})")
    target, draft = pair.target.model, pair.draft.model
    result: dict[str, Any] = {
        "pair": str(spec.source), "threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "cpu": cpu_model(), "load_average_at_start": os.getloadavg()[0],
        "architecture": {"target": describe(target) | {"dtype": str(pair.target.dtype)},
                         "draft": describe(draft) | {"dtype": str(pair.draft.dtype)}},
        "kernels": dataclasses.asdict(choice),
    }
    if settings.cache_len + settings.tree_nodes + 1 > pair.context_limit:
        raise ValueError(f"--cache-len {settings.cache_len} with --tree-nodes {settings.tree_nodes} does not fit the "
                         f"pair's {pair.context_limit}-token context")
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
    for group, prompts in groups.items():
        if settings.groups and group not in settings.groups:
            continue
        for t in (0.6, 1.0):
            result[f"acceptance_{group}_T{t:g}"] = acceptance_on_target_samples(
                target, LoopDraft(pair.draft), pair.tokenizer, prompts, settings.max_new_tokens, context,
                settings.seed, temperature=t)
    first = load_prompt_texts(spec.heldout_prompts, limit=1, tokenizer=pair.tokenizer)[0]
    ids = list(pair.tokenizer(first)["input_ids"])
    with torch.inference_mode():
        new = sample_continuation(target, ids, settings.sample_tokens, 0.8, torch.Generator().manual_seed(0))
    result["sample_T0.8"] = {"prompt": first, "completion": pair.tokenizer.decode(new)}
    return result


def kernel_lines(kernels: dict | None) -> list[str]:
    """The kernel paths' pass times per block size (decode/models/kernel_choice.py) and which each model runs."""
    if not kernels or not kernels.get("times"):
        chosen = f"target {kernels['target']}, draft {kernels['draft']}" if kernels else "default"
        return [f"Kernel paths: {chosen} (given, not measured)."]
    lines = ["Kernel paths, ms per pass (median; blocks over a cache of the prefill's tokens; * = chosen):", ""]
    for role, times in kernels["times"].items():
        shapes = times["shapes"]
        lines += [f"| {role} path | " + " | ".join(f"{m} token{'s' if m > 1 else ''}" for m in shapes)
                  + f" | prefill {times['prefill_tokens']} | {max(shapes)} ÷ 1 |",
                  "|---|" + "---:|" * (len(shapes) + 2)]
        for path, ms in times["block_ms"].items():
            mark = "*" if path == kernels[role] else ""
            lines.append(f"| {path}{mark} | " + " | ".join(f"{v:.1f}" for v in ms)
                         + f" | {times['prefill_ms'][path]:.0f} | {ms[-1] / ms[0]:.2f} |")
        lines.append("")
    return lines[:-1]


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
        f"{result['threads']} thread(s), {result['cpu']}, load average {result['load_average_at_start']:.2f} at "
        "start):",
        "", "| pass | ms | / one-token target pass |", "|---|---:|---:|",
        f"| target, 1 token | {loop['target_one_token_ms']:.2f} | 1 |",
        f"| target, {loop['tree_nodes']}-token tree | {loop['target_tree_ms']:.2f} | "
        f"{loop['tree_over_one_token']:.2f} |",
        f"| draft ({loop['draft_wrapper']}), 1 token, warm "
        f"| {loop['draft_one_token_ms']:.3f} | {loop['draft_over_target']:.3f} |",
        f"| draft, {loop['tree_nodes']}-token level | {loop['draft_tree_level_ms']:.3f} | "
        f"{loop['draft_tree_level_ms'] / loop['target_one_token_ms']:.3f} |",
        f"| draft, a step's first pass (cache-cold) | {loop['draft_first_pass_ms']:.3f} | "
        f"{loop['draft_first_pass_over_target']:.3f} |",
        "", *kernel_lines(result.get("kernels")),
        "", "| acceptance 1 − TV(p, q), held-out prompts | T = 0.6 | T = 1 |", "|---|---:|---:|",
    ]
    groups = sorted({k[len("acceptance_"):].rsplit("_", 1)[0] for k in result if k.startswith("acceptance_")})
    for group in groups:
        low, high = result[f"acceptance_{group}_T0.6"], result[f"acceptance_{group}_T1"]
        lines.append(f"| {group} ({high['prompts']} prompts × {high['new_tokens_per_prompt']} tokens) | "
                     f"{low['mean']:.3f} ± {low['std']:.3f} | {high['mean']:.3f} ± {high['std']:.3f} |")
    return "\n".join(lines) + "\n"
