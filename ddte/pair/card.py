"""Measure the shipped draft/target pair for its model card: every number in models/README.md comes from here.

For a pair directory (default ``models``) this measures, with the models loaded in fp32 on CPU:
  * architecture, parameter counts, training tokens and wall times (from recipe.json);
  * held-out loss and perplexity of both models on the held-out stdlib modules (blocks of the recipe's seq_len);
  * per-token latency: one token after a 256-token KV cache, and one 32-node tree pass (float additive 4D tree
    mask, depth-based position ids) after the same cache; median of --repeats; and the target/draft ratios;
  * per-token acceptance 1 - TV(p, q) = sum_v min(p_v, q_v) at T = 1, on the contexts of target-sampled
    continuations of held-out prompts (mean, std, percentiles, and the spread of per-prompt means);
  * one sample of the target at T = 0.8 from a held-out prompt.

It prints a markdown table and writes everything as JSON (--json). Seeded: the same pair, prompts and thread count
give the same acceptance figures; latencies depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddte.pair.corpus import list_corpus, python_version, select_split
from ddte.pair.prompts import build_prompts

PERCENTILES = (5, 10, 25, 50, 75, 90, 95)


def load_pair(models_dir: Path):
    """(tokenizer, target, draft, recipe dict) from a pair directory, fp32, eval mode, sdpa attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from ddte.cli import UserError

    for name in ("tokenizer", "target", "draft"):
        if not (models_dir / name).is_dir():
            raise UserError(f"{models_dir / name} not found: train the pair first (ddte train-pair)")
    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    target = AutoModelForCausalLM.from_pretrained(models_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(models_dir / "draft", dtype=torch.float32).eval()
    recipe_path = models_dir / "recipe.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else {}
    return tok, target, draft, recipe


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


def tree_mask(parents: list[int], past_len: int) -> torch.Tensor:
    """Float additive mask ``(1, 1, n, past_len + n)``: 0 where a node sees the prefix or an ancestor, else -inf-ish.

    The float form is right under both eager and sdpa attention (a bool mask is silently wrong under eager).
    """
    n = len(parents)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            ancestors[i, j] = True
            j = parents[j]
    allowed = torch.cat([torch.ones(n, past_len, dtype=torch.bool), ancestors], dim=1)[None, None]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def tree_depths(parents: list[int]) -> torch.Tensor:
    """Depth of every node (root 0): shape ``(n,)``; position ids are ``past_len + depth``."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return torch.tensor(depths)


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    """Parents of a random n-node tree rooted at node 0, in topological order."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@torch.inference_mode()
def latency_ms(model, cache_len: int, nodes: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median and minimum wall time (ms) of one forward of ``nodes`` new tokens after a ``cache_len``-token KV cache.

    ``nodes == 1`` is a plain decode step; ``nodes > 1`` is a tree pass with a random tree. The cache is cropped back
    after every call so each one sees exactly ``cache_len`` cached tokens. On a shared CPU the median moves with
    the load; the minimum is the closest to the machine's uncontended speed.
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    model(torch.randint(3, vocab, (1, cache_len), generator=gen), past_key_values=cache, use_cache=True)
    tokens = torch.randint(3, vocab, (1, nodes), generator=gen)
    kwargs: dict[str, Any] = {}
    if nodes > 1:
        parents = random_tree(nodes, gen)
        positions = (cache_len + tree_depths(parents))[None]  # (1, n): depth-based, not arange
        kwargs = {"attention_mask": tree_mask(parents, cache_len), "position_ids": positions}
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        model(tokens, past_key_values=cache, use_cache=True, **kwargs)
        elapsed = time.perf_counter() - start
        cache.crop(-nodes)
        if i >= 3:  # the first calls warm up allocators and kernels
            times.append(elapsed * 1e3)
    return {"median": statistics.median(times), "min": min(times)}


@torch.inference_mode()
def sample(model, ids: list[int], new_tokens: int, temperature: float, gen: torch.Generator) -> list[int]:
    """Ancestral sampling at ``temperature`` (no top-k/top-p) with a KV cache; returns the new token ids."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
    out: list[int] = []
    for _ in range(new_tokens):
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=gen))
        out.append(token)
        logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return out


@torch.inference_mode()
def acceptance(target, draft, tok, prompts: list[str], new_tokens: int, context: int, seed: int) -> dict[str, Any]:
    """1 - TV(p, q) at T = 1 on every context of target-sampled continuations of ``prompts``.

    For each prompt: sample ``new_tokens`` from the target, run both models once over prompt + continuation, and
    take sum_v min(p_v, q_v) at the last prompt position and every continuation position but the last.
    """
    gen = torch.Generator().manual_seed(seed)
    values: list[float] = []
    per_prompt: list[float] = []
    for prompt in prompts:
        ids = tok(prompt).input_ids[-(context - new_tokens) :]  # left-truncate to fit the context window
        seq = ids + sample(target, ids, new_tokens, 1.0, gen)
        x = torch.tensor([seq])
        start = len(ids) - 1  # position whose next-token distribution produced the first sampled token
        p = torch.softmax(target(x).logits[0, start:-1].double(), dim=-1)  # (new_tokens, V)
        q = torch.softmax(draft(x).logits[0, start:-1].double(), dim=-1)
        alpha = torch.minimum(p, q).sum(-1).tolist()
        values.extend(alpha)
        per_prompt.append(statistics.fmean(alpha))
    ordered = sorted(values)

    def pct(k: int) -> float:
        return ordered[min(len(ordered) - 1, round(k / 100 * (len(ordered) - 1)))]

    return {
        "contexts": len(values),
        "prompts": len(prompts),
        "new_tokens_per_prompt": new_tokens,
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "percentiles": {f"p{k}": pct(k) for k in PERCENTILES},
        "per_prompt_mean": {
            "min": min(per_prompt),
            "max": max(per_prompt),
            "std": statistics.pstdev(per_prompt),
        },
    }


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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the card, as a JSON-ready dict."""
    torch.set_num_threads(args.threads)
    models_dir = Path(args.models)
    tok, target, draft, recipe = load_pair(models_dir)
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

    latency: dict[str, Any] = {"cache_len": args.cache_len, "tree_nodes": args.tree_nodes, "repeats": args.repeats}
    for name, model in (("target", target), ("draft", draft)):
        one = latency_ms(model, args.cache_len, 1, args.repeats)
        tree = latency_ms(model, args.cache_len, args.tree_nodes, args.repeats)
        latency[name] = {"one_token_ms": one["median"], "tree_ms": tree["median"],
                         "one_token_min_ms": one["min"], "tree_min_ms": tree["min"]}
    for key in ("one_token", "tree"):
        latency[f"ratio_{key}"] = latency["target"][f"{key}_ms"] / latency["draft"][f"{key}_ms"]
        latency[f"ratio_{key}_min"] = latency["target"][f"{key}_min_ms"] / latency["draft"][f"{key}_min_ms"]
    result["latency"] = latency

    records = build_prompts(args.prompts, "heldout", heldout_fraction=heldout_fraction)
    prompts = [r["prompt"] for r in records]
    context = target.config.max_position_embeddings
    result["acceptance_T1"] = acceptance(target, draft, tok, prompts, args.new_tokens, context, args.seed)

    shortest = min(records, key=lambda r: len(r["prompt"]))
    ids = tok(shortest["prompt"]).input_ids
    new = sample(target, ids, args.sample_tokens, 0.8, torch.Generator().manual_seed(args.seed))
    result["sample_T0.8"] = {"prompt_id": shortest["id"], "prompt": shortest["prompt"], "completion": tok.decode(new)}
    return result


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
        "| 1 token after a {}-token KV cache, ms: median (min) | {:.2f} ({:.2f}) | {:.2f} ({:.2f}) "
        "| {:.1f}× ({:.1f}×) |".format(
            lat["cache_len"], lat["target"]["one_token_ms"], lat["target"]["one_token_min_ms"],
            lat["draft"]["one_token_ms"], lat["draft"]["one_token_min_ms"], lat["ratio_one_token"],
            lat["ratio_one_token_min"],
        ),
        "| {}-node tree pass, ms: median (min) | {:.2f} ({:.2f}) | {:.2f} ({:.2f}) | {:.1f}× ({:.1f}×) |".format(
            lat["tree_nodes"], lat["target"]["tree_ms"], lat["target"]["tree_min_ms"], lat["draft"]["tree_ms"],
            lat["draft"]["tree_min_ms"], lat["ratio_tree"], lat["ratio_tree_min"],
        ),
    ]
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="models", help="pair directory with tokenizer/, target/, draft/")
    parser.add_argument("--json", help="write all measurements to this JSON file")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared CPU)")
    parser.add_argument("--cache-len", type=int, default=256, help="KV cache length for latency (default 256)")
    parser.add_argument("--tree-nodes", type=int, default=32, help="nodes of the timed tree pass (default 32)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per latency figure (default 30)")
    parser.add_argument("--prompts", type=int, default=100, help="held-out prompts for acceptance (default 100)")
    parser.add_argument("--new-tokens", type=int, default=32, help="sampled tokens per prompt (default 32)")
    parser.add_argument(
        "--heldout-blocks", type=int,
        help="held-out blocks for the loss (default: the recipe's final_eval_blocks, else all)",
    )
    parser.add_argument("--sample-tokens", type=int, default=80, help="length of the T=0.8 sample (default 80)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from ddte.cli import UserError

    for name in ("threads", "cache_len", "tree_nodes", "repeats", "prompts", "new_tokens", "sample_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    result = measure(args)
    if args.json:
        write_json(result, Path(args.json))
    print(markdown(result))
    print("T = 0.8 sample from", result["sample_T0.8"]["prompt_id"])
    print(result["sample_T0.8"]["completion"])
    return 0
