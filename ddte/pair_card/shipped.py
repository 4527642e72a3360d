"""Measure the shipped draft/target pair for its model card: every number in models/README.md comes from here.

For a pair directory (default ``models``) this measures, with the models loaded in fp32 on CPU:
  * architecture, parameter counts, training tokens and wall times (from recipe.json);
  * held-out loss and perplexity of both models on the held-out stdlib modules (blocks of the recipe's seq_len);
  * per-pass latency through HF's forward in both models (decode.models.cached_lm, its tree masks): one token and
    a --tree-nodes block after a --cache-len cache, timed by the latency model (decode.policies.latency), medians;
  * per-token acceptance 1 - TV(p, q) = sum_v min(p_v, q_v) at T = 1 and T = 0.6, on the contexts of target-sampled
    continuations of held-out prompts (mean, std, percentiles, and the spread of per-prompt means);
  * the draft's calibration at T = 1 and 0.6: at the nodes of drafted chains, the correlation (and ROC AUC) of its
    top probability with the acceptance min(1, p/q) of the token it drew;
  * per-pass latency in the decoding loop: the decoder's own wrappers (HF for the target, the fast forward for the
    draft) through the latency model's measurement, and the target/draft ratio;
  * one sample of the target at T = 0.8 from a held-out prompt.

Seeded: the same pair, prompts and thread count give the same acceptance figures; latencies depend on the machine
and its load.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data_gen.corpus import list_corpus, python_version, select_split
from data_gen.prompts import build_prompts
from distill.evaluate import PERCENTILES, acceptance_on_target_samples, drafting_calibration, sample_continuation


def train_pair_folder(spec) -> Path | None:
    """The folder of a pair :class:`~decode.pair.PairSpec` laid out as ``ddte train-pair`` writes one (``target/``,
    ``draft/``, ``tokenizer/`` and ``recipe.json`` side by side, e.g. the shipped pair in ``models/``), else None:
    such a pair gets this module's card, any other pair the card of :mod:`ddte.pair_card.any_pair`."""
    target = spec.target.resolve()
    folder = target.parent
    tokenizer = spec.tokenizer.resolve() if spec.tokenizer is not None else folder / "tokenizer"
    laid_out = (target.name == "target" and spec.draft.resolve() == folder / "draft"
                and tokenizer == folder / "tokenizer")
    return folder if laid_out and (folder / "recipe.json").is_file() else None


def load_card_pair(models_dir: Path):
    """(the loaded pair, fp32, both through HF's forward; the recipe dict) from a pair directory."""
    from decode.pair import load_pair as load_models

    for name in ("tokenizer", "target", "draft"):
        if not (models_dir / name).is_dir():
            raise ValueError(f"{models_dir / name} not found: train the pair first (ddte train-pair)")
    pair = load_models(models_dir / "target", models_dir / "draft", models_dir / "tokenizer", dtype="float32",
                       fast_draft=False)
    recipe_path = models_dir / "recipe.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else {}
    return pair, recipe


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


def heldout_blocks(tok, heldout_fraction: float, seq_len: int, max_blocks: int | None) -> torch.Tensor:
    """The held-out modules as one ``<|bos|> text <|eos|>`` stream cut into blocks: ``(n, seq_len)``."""
    ids: list[int] = []
    backend = tok.backend_tokenizer  # the raw tokenizer: no "longer than model_max_length" warning per module
    for module in select_split(list_corpus(heldout_fraction=heldout_fraction), "heldout"):
        ids.extend([tok.bos_token_id, *backend.encode(module.read(), add_special_tokens=False).ids, tok.eos_token_id])
    n = len(ids) // seq_len
    blocks = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    if max_blocks is not None and n > max_blocks:
        blocks = blocks[torch.linspace(0, n - 1, max_blocks).long()]
    return blocks


def pass_latency(target, draft, cache_len: int, nodes: int, repeats: int) -> dict[str, Any]:
    """Median pass times (ms) of two cached models, timed as the latency model times the loop's passes
    (decode.policies.latency): one token, and a ``nodes``-token block (a tree for the target, a level for the draft),
    after ``cache_len`` cached tokens; and the target/draft ratios."""
    from decode.policies.latency import measure_latency

    table = measure_latency(target, draft, lengths=[cache_len], sizes=[1, nodes], repeats=repeats)
    out: dict[str, Any] = {"cache_len": table.lengths[0], "tree_nodes": nodes, "repeats": repeats}
    for name, times in (("target", table.target_ms[0]), ("draft", table.draft_ms[0])):
        out[name] = {"one_token_ms": times[0], "tree_ms": times[1]}
    for key in ("one_token", "tree"):
        out[f"ratio_{key}"] = out["target"][f"{key}_ms"] / out["draft"][f"{key}_ms"]
    return out


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


@dataclass
class CardSettings:
    """What the card measures and how often (the defaults are the shipped card's)."""

    models: str = "models"
    threads: int = 1
    cache_len: int = 256
    tree_nodes: int = 32
    repeats: int = 30
    num_prompts: int = 100
    max_new_tokens: int = 32
    heldout_blocks: int | None = None
    sample_tokens: int = 80
    seed: int = 0


def measure(args: CardSettings) -> dict[str, Any]:
    """Every figure of the card, as a JSON-ready dict."""
    torch.set_num_threads(args.threads)
    models_dir = Path(args.models)
    pair, recipe = load_card_pair(models_dir)
    tok, target, draft = pair.tokenizer, pair.target.model, pair.draft.model
    context = min(target.config.max_position_embeddings, draft.config.max_position_embeddings)
    if args.cache_len + args.tree_nodes + 1 > context:
        raise ValueError(f"--cache-len {args.cache_len} with --tree-nodes {args.tree_nodes} does not fit the "
                         f"pair's {context}-token context")
    config = recipe.get("config", {})
    heldout_fraction = config.get("corpus", {}).get("heldout_fraction", 0.1)
    seq_len = config.get("target", {}).get("train", {}).get("seq_len", 256)
    result: dict[str, Any] = {
        "models_dir": str(models_dir),
        "python_version": python_version(),
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "architecture": {"target": describe(target), "draft": describe(draft)},
    }
    for name in ("target", "draft"):
        trained = recipe.get("models", {}).get(name, {})
        keys = ("steps", "tokens", "wall_s", "tokens_per_s")
        result.setdefault("training", {})[name] = {k: trained.get(k) for k in keys}

    max_blocks = args.heldout_blocks or config.get("final_eval_blocks")  # default: the recipe's final evaluation
    blocks = heldout_blocks(tok, heldout_fraction, seq_len, max_blocks)
    result["heldout"] = {"seq_len": seq_len, "blocks": int(blocks.shape[0])}
    for name, model in (("target", target), ("draft", draft)):
        loss = heldout_loss(model, blocks)
        result["heldout"][name] = {"loss": loss, "perplexity": math.exp(loss)}

    result["latency"] = pass_latency(pair.target, pair.draft, args.cache_len, args.tree_nodes, args.repeats)

    result["loop_latency"] = loop_latency(pair, args.cache_len, args.tree_nodes, args.repeats)

    records = build_prompts(args.num_prompts, "heldout", heldout_fraction=heldout_fraction)
    prompts = [r["prompt"] for r in records]
    context = target.config.max_position_embeddings
    for t in (1.0, 0.6):
        result[f"acceptance_T{t:g}"] = acceptance_on_target_samples(
            target, draft, tok, prompts, args.max_new_tokens, context, args.seed, temperature=t)
        result[f"calibration_T{t:g}"] = drafting_calibration(
            target, draft, tok, prompts, t, context=context, seed=args.seed)

    shortest = min(records, key=lambda r: len(r["prompt"]))
    ids = tok(shortest["prompt"]).input_ids
    new = sample_continuation(target, ids, args.sample_tokens, 0.8, torch.Generator().manual_seed(args.seed))
    result["sample_T0.8"] = {"prompt_id": shortest["id"], "prompt": shortest["prompt"], "completion": tok.decode(new)}
    return result


def loop_latency(pair, cache_len: int, tree_nodes: int, repeats: int) -> dict[str, Any]:
    """Median pass times (ms) as the decoding loop runs them: the card pair's target (HF's forward through CachedLM)
    and its draft through the fast forward (FastCachedLM, built from the same loaded weights)."""
    from decode.models.fast_llama import cached_lm

    draft = cached_lm(pair.draft.model, pair.draft.device, pair.draft.dtype)
    times = pass_latency(pair.target, draft, cache_len, tree_nodes, repeats)
    out = {"cache_len": times["cache_len"], "draft_wrapper": type(draft).__name__,
           "draft_one_token_ms": times["draft"]["one_token_ms"], "draft_tree_ms": times["draft"]["tree_ms"],
           "target_one_token_ms": times["target"]["one_token_ms"], "target_tree_ms": times["target"]["tree_ms"]}
    out["ratio_one_token"] = times["ratio_one_token"]
    return out


def markdown(result: dict[str, Any]) -> str:
    """The card's tables from a :func:`measure` result."""
    arch, held, lat, acc = result["architecture"], result["heldout"], result["latency"], result["acceptance_T1"]
    rows = [
        "| | target | draft | target / draft |",
        "|---|---|---|---|",
        "| layers × hidden (heads) | {} × {} ({}) | {} × {} ({}) | |".format(
            arch["target"]["layers"], arch["target"]["hidden"], arch["target"]["heads"],
            arch["draft"]["layers"], arch["draft"]["hidden"], arch["draft"]["heads"],
        ),
        "| parameters | {:.2f} M | {:.2f} M | {:.1f}× |".format(
            arch["target"]["parameters"] / 1e6, arch["draft"]["parameters"] / 1e6,
            arch["target"]["parameters"] / arch["draft"]["parameters"],
        ),
    ]
    train = result.get("training", {})
    if train.get("target", {}).get("tokens"):
        rows.append("| training tokens (wall) | {:.2f} M ({:.0f} s) | {:.2f} M ({:.0f} s) | |".format(
            train["target"]["tokens"] / 1e6, train["target"]["wall_s"], train["draft"]["tokens"] / 1e6,
            train["draft"]["wall_s"],
        ))
    rows += [
        "| held-out loss (nats/token) | {:.3f} | {:.3f} | |".format(held["target"]["loss"], held["draft"]["loss"]),
        "| held-out perplexity | {:.2f} | {:.2f} | |".format(
            held["target"]["perplexity"], held["draft"]["perplexity"]
        ),
        "| 1 token after a {}-token KV cache, ms (HF forward) | {:.2f} | {:.2f} | {:.1f}× |".format(
            lat["cache_len"], lat["target"]["one_token_ms"], lat["draft"]["one_token_ms"], lat["ratio_one_token"],
        ),
        "| {}-token block (target: a tree, draft: a level), ms | {:.2f} | {:.2f} | {:.1f}× |".format(
            lat["tree_nodes"], lat["target"]["tree_ms"], lat["draft"]["tree_ms"], lat["ratio_tree"],
        ),
    ]
    loop = result.get("loop_latency")
    if loop:
        rows.append("| in the decoding loop, 1 token after {} tokens, ms (draft: {}) | {:.2f} | {:.3f} | {:.1f}× |"
                    .format(loop["cache_len"], loop["draft_wrapper"], loop["target_one_token_ms"],
                            loop["draft_one_token_ms"], loop["ratio_one_token"]))
    pcts = acc["percentiles"]
    lines = [
        "\n".join(rows),
        "",
        f"Held-out: {held['blocks']} blocks of {held['seq_len']} tokens. Latency: median of {lat['repeats']} calls, "
        f"{result['threads']} thread(s), load average {result['load_average_at_start']:.2f} at start.",
        "",
        "| acceptance 1 − TV(p, q) at T = 1 | value |",
        "|---|---|",
        f"| mean ± std over {acc['contexts']} contexts ({acc['prompts']} prompts × {acc['new_tokens_per_prompt']}) "
        f"| {acc['mean']:.3f} ± {acc['std']:.3f} |",
        "| p5 / p10 / p25 / p50 / p75 / p90 / p95 | "
        + " / ".join(f"{pcts[f'p{k}']:.2f}" for k in PERCENTILES) + " |",
        "| per-prompt mean: min / max / std | {:.3f} / {:.3f} / {:.3f} |".format(
            acc["per_prompt_mean"]["min"], acc["per_prompt_mean"]["max"], acc["per_prompt_mean"]["std"]
        ),
    ]
    if "acceptance_T0.6" in result:
        lines.append(f"| mean at T = 0.6 | {result['acceptance_T0.6']['mean']:.3f} ± "
                     f"{result['acceptance_T0.6']['std']:.3f} |")
    calibration = [result[k] for k in ("calibration_T1", "calibration_T0.6") if k in result]
    if calibration:
        lines += ["", "| draft calibration at drafted-chain nodes | T = " + " | T = ".join(
            f"{c['temperature']:g}" for c in calibration) + " |", "|---|" + "---|" * len(calibration)]
        for key, label in (("nodes", "nodes"), ("mean_accept", "mean min(1, p/q) of the drawn token"),
                           ("corr_top_accept", "corr(top probability, min(1, p/q))"),
                           ("corr_top_beta", "corr(top probability, 1 − TV)"),
                           ("auc_top_accept", "AUC of top probability for acceptance")):
            lines.append(f"| {label} | " + " | ".join(
                str(c[key]) if key == "nodes" else f"{c[key]:.3f}" for c in calibration) + " |")
    return "\n".join(lines) + "\n"


def write_json(data: dict[str, Any], path: Path) -> None:
    """Write ``data`` as JSON atomically (temp file in the same directory, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, ensure_ascii=False)
        handle.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary shared files
    os.replace(tmp, path)
