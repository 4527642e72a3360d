"""The card's optional section for a pair laid out as ``ddte train-pair`` writes one (``target/``, ``draft/``,
``tokenizer/`` and ``recipe.json`` side by side; the shipped pair in ``models/``): every number in models/README.md.

From the folder's ``recipe.json`` and its models (fp32, on CPU):
  * training tokens and wall times;
  * held-out loss and perplexity of both models on the held-out stdlib modules (blocks of the recipe's seq_len);
  * per-pass latency through HF's forward in both models (:class:`~decode.models.cached_lm.CachedLM`, its tree
    masks): one token and a ``tree_nodes`` block after a ``cache_len`` cache, timed by the latency model, medians;
  * the draft's calibration at T = 1 and 0.6: at the nodes of drafted chains, the correlation (and ROC AUC) of its
    top probability with the acceptance min(1, p/q) of the token it drew.

Its acceptance prompts are the held-out code prompts of the recipe's own split (:func:`prompt_groups`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ddte.train_pair.config import read_recipe, recipe_heldout_fraction


def train_pair_folder(spec) -> Path | None:
    """The folder of a pair :class:`~decode.pair_spec.PairSpec` laid out as ``ddte train-pair`` writes one, else
    None: such a pair's card has this module's section."""
    target = spec.target.resolve()
    folder = target.parent
    tokenizer = spec.tokenizer.resolve() if spec.tokenizer is not None else folder / "tokenizer"
    laid_out = (target.name == "target" and spec.draft.resolve() == folder / "draft"
                and tokenizer == folder / "tokenizer")
    return folder if laid_out and (folder / "recipe.json").is_file() else None


def prompt_groups(folder: Path, count: int) -> dict[str, list[str]]:
    """``{"heldout": texts}``: ``count`` held-out code prompts of the recipe's corpus split."""
    from data_gen.prompts import build_prompts

    records = build_prompts(count, "heldout", heldout_fraction=recipe_heldout_fraction(read_recipe(folder)))
    return {"heldout": [record["prompt"] for record in records]}


@torch.inference_mode()
def heldout_loss(model, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token NLL (nats/token) over ``blocks`` of shape ``(n, seq_len)``."""
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        batch = blocks[i : i + batch_size]
        logits = model(input_ids=batch).logits[:, :-1]  # (b, T-1, V)
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        total += nll.item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    return total / count


def heldout_blocks(tok, fraction: float, seq_len: int, max_blocks: int | None) -> torch.Tensor:
    """The held-out modules as one ``<|bos|> text <|eos|>`` stream cut into blocks: ``(n, seq_len)``."""
    from data_gen.corpus import list_corpus, select_split

    ids: list[int] = []
    backend = tok.backend_tokenizer  # the raw tokenizer: no "longer than model_max_length" warning per module
    for module in select_split(list_corpus(heldout_fraction=fraction), "heldout"):
        ids.extend([tok.bos_token_id, *backend.encode(module.read(), add_special_tokens=False).ids, tok.eos_token_id])
    n = len(ids) // seq_len
    blocks = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    if max_blocks is not None and n > max_blocks:
        blocks = blocks[torch.linspace(0, n - 1, max_blocks).long()]
    return blocks


def pass_latency(target, draft, cache_len: int, nodes: int, repeats: int) -> dict[str, Any]:
    """Median pass times (ms) of two cached models, timed as the latency model times the loop's passes
    (decode.cost.measure): one token, and a ``nodes``-token block (a tree for the target, a level for the draft),
    after ``cache_len`` cached tokens; and the target/draft ratios."""
    from decode.cost.measure import measure_latency

    table = measure_latency(target, draft, lengths=[cache_len], sizes=[1, nodes], repeats=repeats)
    out: dict[str, Any] = {"cache_len": table.lengths[0], "tree_nodes": nodes, "repeats": repeats}
    for name, times in (("target", table.target_ms[0]), ("draft", table.draft_ms[0])):
        out[name] = {"one_token_ms": times[0], "tree_ms": times[1]}
    for key in ("one_token", "tree"):
        out[f"ratio_{key}"] = out["target"][f"{key}_ms"] / out["draft"][f"{key}_ms"]
    return out


def measure_folder(folder: Path, pair, settings) -> dict[str, Any]:
    """The folder's section: ``models_dir``, ``training``, ``heldout`` (loss and perplexity) and ``latency`` (both
    models through HF's forward), for a pair loaded in fp32 and ``settings`` of
    :class:`~ddte.pair_card.card.CardSettings`."""
    from decode.models.cached_lm import CachedLM

    recipe = read_recipe(folder)
    config = recipe.get("config", {})
    out: dict[str, Any] = {"models_dir": _shown(folder), "training": {}}
    for name in ("target", "draft"):
        trained = recipe.get("models", {}).get(name, {})
        out["training"][name] = {k: trained.get(k) for k in ("steps", "tokens", "wall_s", "tokens_per_s")}
    seq_len = config.get("target", {}).get("train", {}).get("seq_len", 256)
    max_blocks = settings.heldout_blocks or config.get("final_eval_blocks")  # default: the recipe's final evaluation
    blocks = heldout_blocks(pair.tokenizer, recipe_heldout_fraction(recipe), seq_len, max_blocks)
    out["heldout"] = {"seq_len": seq_len, "blocks": int(blocks.shape[0])}
    for name, lm in (("target", pair.target), ("draft", pair.draft)):
        loss = heldout_loss(lm.model, blocks)
        out["heldout"][name] = {"loss": loss, "perplexity": math.exp(loss)}
    hf_draft = CachedLM(pair.draft.model, pair.draft.device, pair.draft.dtype)  # the same weights, HF's forward
    out["latency"] = pass_latency(pair.target, hf_draft, settings.cache_len, settings.tree_nodes, settings.repeats)
    return out


def calibration(pair, prompts: list[str], seed: int) -> dict[str, Any]:
    """``calibration_T{t}`` at T = 1 and 0.6 (:func:`distill.evaluate.drafting_calibration`, the draft's HF model)."""
    from distill.evaluate import drafting_calibration

    return {f"calibration_T{t:g}": drafting_calibration(pair.target.model, pair.draft.model, pair.tokenizer, prompts,
                                                        t, context=pair.context_limit, seed=seed)
            for t in (1.0, 0.6)}


def _shown(folder: Path) -> str:
    """The pair folder as the card names it: relative to the current directory when inside it (models)."""
    folder, here = Path(folder).resolve(), Path.cwd().resolve()
    return str(folder.relative_to(here)) if folder.is_relative_to(here) else str(folder)
