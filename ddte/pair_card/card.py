"""One pair's card (``ddte pair-card``): what every pair gets, and the optional section of a ``ddte train-pair`` folder.

For the pair a pair YAML names, loaded as the decoding loop runs it (the pair's dtypes and kernel paths; a
``ddte train-pair`` folder in fp32 on the default path; ``--kernels`` names other paths for either), this measures:
  * the machine (:func:`ddte_core.machine.environment`), the architecture, parameters and dtype of each model;
  * pass times in the decoding loop (the decoder's wrappers through :func:`decode.cost.measure.measure_latency`):
    the target's one-token and tree passes, the draft's one-token pass warm and its cache-cold first pass of a step
    (warm + c(l)), the draft's level, and their ratios to a one-token target pass;
  * acceptance 1 − TV(p, q) at T = 0.6 and 1 on target-sampled continuations of held-out prompts, per prompt group
    (like/unlike the training data for chat sets, each category of the mixed workload, else one ``heldout`` group);
    q is the draft's law as the loop computes it;
  * one sample of the target at T = 0.8 from the group's shortest prompt;
  * for a ``ddte train-pair`` folder only (:mod:`ddte.pair_card.folder`): training figures, held-out loss, HF-forward
    pass times and the draft's calibration.

Seeded: the same pair, prompts and thread count give the same acceptance figures; latencies depend on the machine
and its load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TEMPERATURES = (0.6, 1.0)
PROGRESS_DELAY_S = 2.0  # the sample's progress bar shows once sampling has run this long


@dataclass
class CardSettings:
    """What the card measures and how often (None: the default of the pair's kind, :func:`with_defaults`)."""

    pair: str = "shipped"
    threads: int = 1
    cache_len: int = 256
    tree_nodes: int | None = None
    repeats: int | None = None
    num_prompts: int | None = None
    max_new_tokens: int = 32
    sample_tokens: int = 80
    seed: int = 0
    groups: tuple[str, ...] = ()  # the prompt groups to measure acceptance on (empty: all)
    heldout_blocks: int | None = None  # a train-pair folder's held-out loss (None: the recipe's own count)
    kernels: str | None = None  # --kernels (None: the pair's own; "default" for a train-pair folder)


FOLDER_DEFAULTS = {"tree_nodes": 32, "repeats": 30, "num_prompts": 100}  # the shipped card's figures
PAIR_DEFAULTS = {"tree_nodes": 8, "repeats": 10, "num_prompts": 24}  # per prompt group


def with_defaults(settings: CardSettings, folder: bool) -> CardSettings:
    """``settings`` with each None count set to the default of a ``ddte train-pair`` folder's card or any pair's."""
    defaults = FOLDER_DEFAULTS if folder else PAIR_DEFAULTS
    return dataclasses.replace(settings, **{k: v for k, v in defaults.items() if getattr(settings, k) is None})


def check_fits(settings: CardSettings, context: int) -> None:
    """ValueError unless the timed cache and tree, the sample and the acceptance continuations fit ``context``."""
    if settings.cache_len + settings.tree_nodes + 1 > context:
        raise ValueError(f"--cache-len {settings.cache_len} with --tree-nodes {settings.tree_nodes} does not fit the "
                         f"pair's {context}-token context")
    for flag, tokens in (("--sample-tokens", settings.sample_tokens), ("--max-new-tokens", settings.max_new_tokens)):
        if tokens >= context:
            raise ValueError(f"{flag} {tokens} runs past the pair's {context}-token context (at most {context - 1})")


def describe(model) -> dict[str, Any]:
    """Architecture summary of a Llama model."""
    cfg = model.config
    return {
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "vocab": cfg.vocab_size,
        "context": cfg.max_position_embeddings,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def measure(settings: CardSettings) -> dict[str, Any]:
    """Every figure of the card (see the module docstring) as a JSON-ready dict; counts left None take their
    defaults (:func:`with_defaults`).

    Raises:
        ValueError: a bad pair, a --groups name the pair has not, or a cache, tree or sample past its context.
    """
    from ddte.pair_card import folder as folder_card
    from ddte_core.machine import environment
    from decode.pair_spec import read_pair_config
    from decode.session import Hooks, PairRequest, open_pair

    torch.set_num_threads(settings.threads)
    spec = read_pair_config(settings.pair)
    folder = folder_card.train_pair_folder(spec)
    settings = with_defaults(settings, folder is not None)
    pair = PairRequest(spec, dtype="float32" if folder is not None else None).load()
    check_fits(settings, pair.context_limit)
    groups = folder_card.prompt_groups(folder, settings.num_prompts) if folder is not None else \
        prompt_groups(spec.heldout_prompts, settings.num_prompts, pair.tokenizer)
    unknown = sorted(set(settings.groups) - set(groups))
    if unknown:  # before any measuring
        raise ValueError(f"--groups: no prompt group {unknown[0]!r} (this pair's: {', '.join(sorted(groups))})")
    groups = {name: texts for name, texts in groups.items() if not settings.groups or name in settings.groups}
    default = "default" if folder is not None else None  # a train-pair folder's figures are on the default path
    choice = open_pair(pair, default if settings.kernels is None else settings.kernels,
                       Hooks(announce=_to_stderr, progress=True)).kernel_choice
    result: dict[str, Any] = {"pair": str(spec.source), **environment(), "load_average_at_start": os.getloadavg()[0],
                              "architecture": {role: describe(lm.model) | {"dtype": str(lm.dtype)}
                                               for role, lm in (("target", pair.target), ("draft", pair.draft))},
                              "kernels": dataclasses.asdict(choice)}
    if folder is not None:
        result |= folder_card.measure_folder(folder, pair, settings)
    result["loop_latency"] = loop_latency(pair, settings.cache_len, settings.tree_nodes, settings.repeats)
    result |= acceptance(pair, groups, settings)
    if folder is not None:
        result |= folder_card.calibration(pair, groups["heldout"], settings.seed)
    shortest = min(next(iter(groups.values())), key=len)
    result["sample_T0.8"] = sample(pair, shortest, settings.sample_tokens, settings.seed)
    return result


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def loop_latency(pair, cache_len: int, tree_nodes: int, repeats: int) -> dict[str, Any]:
    """Median pass times (ms) as the decoding loop runs them, after ``cache_len`` tokens: the target's one-token and
    ``tree_nodes``-token tree passes, the draft's one-token pass warm and cold (a step's first), its level, and
    their ratios to the one-token target pass."""
    from decode.cost.measure import measure_latency

    table = measure_latency(pair.target, pair.draft, lengths=[cache_len], sizes=[1, tree_nodes], repeats=repeats)
    target_one, target_tree = table.target_ms[0]
    draft_warm, draft_level = table.draft_ms[0]
    draft_cold = draft_warm + (table.step_extra_ms[0] if table.step_extra_ms else 0.0)
    return {
        "cache_len": table.lengths[0], "tree_nodes": tree_nodes, "repeats": repeats,
        "draft_wrapper": type(pair.draft).__name__, "target_one_token_ms": target_one,
        "target_tree_ms": target_tree, "draft_one_token_ms": draft_warm,
        "draft_first_pass_ms": draft_cold, "draft_tree_level_ms": draft_level,
        "tree_over_one_token": target_tree / target_one, "ratio_one_token": target_one / draft_warm,
        "draft_over_target": draft_warm / target_one, "draft_first_pass_over_target": draft_cold / target_one,
    }


def prompt_groups(heldout: str, count: int, tokenizer) -> dict[str, list[str]]:
    """Held-out prompt texts by group, at most ``count`` a group: like/unlike for the chat sets, each category for
    the mixed workload, else the one held-out source as ``heldout``."""
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


def acceptance(pair, groups: dict[str, list[str]], settings: CardSettings) -> dict[str, Any]:
    """``acceptance_{group}_T{t}``: 1 − TV(p, q) on target-sampled continuations of each group's prompts."""
    from distill.evaluate import acceptance_on_target_samples

    context = min(pair.context_limit, 2048)
    return {f"acceptance_{group}_T{t:g}": acceptance_on_target_samples(
                pair.target.model, LoopDraft(pair.draft), pair.tokenizer, prompts, settings.max_new_tokens, context,
                settings.seed, temperature=t)
            for group, prompts in groups.items() for t in TEMPERATURES}


class _Counted:
    """A model whose every call advances a progress bar (one call per sampled token), otherwise the model."""

    def __init__(self, model, bar) -> None:
        self.model, self.bar, self.config = model, bar, model.config

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.bar.update(1)
        return out


def sample(pair, prompt: str, tokens: int, seed: int) -> dict[str, str]:
    """The target's ``tokens``-token continuation of ``prompt`` at T = 0.8 (the prompt kept to its last tokens that
    fit the context), with a progress bar on stderr when it runs long."""
    from tqdm import tqdm

    from distill.evaluate import sample_continuation

    ids = list(pair.tokenizer(prompt)["input_ids"])[-(pair.context_limit - tokens):]
    bar = tqdm(total=tokens + 1, desc="sample", unit="token", file=sys.stderr, delay=PROGRESS_DELAY_S, leave=False)
    with torch.inference_mode(), bar:
        new = sample_continuation(_Counted(pair.target.model, bar), ids, tokens, 0.8,
                                  torch.Generator().manual_seed(seed))
    return {"prompt": prompt, "completion": pair.tokenizer.decode(new)}


def write_json(data: dict[str, Any], path: Path) -> None:
    """Write ``data`` as JSON whole or not at all, an ordinary shared file (ddte_core.paths.staged_file)."""
    from ddte_core.paths import staged_file

    with staged_file(path) as tmp, tmp.open("w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, ensure_ascii=False)
        handle.write("\n")
