"""Train the shipped draft/target pair from scratch: tokenizer, target and draft, on the Python stdlib.

Reads a YAML config (default ``configs/train-pair/default.yaml``), trains a byte-level BPE tokenizer on the training
split of the running interpreter's standard library, then a Llama target and a Llama draft from random init, and writes
into the output directory:

  tokenizer/         the tokenizer (also copied into target/ and draft/)
  target/, draft/    HF format: config.json, generation_config.json, model.safetensors (+ tokenizer files)
  recipe.json        resolved config, corpus counts, python version, seeds, wall times, final losses
  loss_curve.png     train and held-out loss of both models against training tokens

Runs are seeded: the same config, Python version (corpus) and thread count give the same weights.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from data_gen.corpus import SourceFile, corpus_summary, list_corpus, python_version, select_split, subset
from ddte.train_pair.config import ModelRecipe, PairConfig, TrainSchedule, config_to_dict
from ddte.train_pair.tokenizer import BOS, EOS, train_bpe, wrap_for_transformers
from ddte_core.machine import environment
from distill.saving import round_to_storage, save_model

DEFAULT_CONFIG = "configs/train-pair/default.yaml"
PRODUCTS = ("tokenizer", "target", "draft", "recipe.json", "loss_curve.png")


def encode_stream(tok, files: list[SourceFile]) -> torch.Tensor:
    """All files as one token stream, each wrapped as ``<|bos|> text <|eos|>``: shape ``(n_tokens,)``, int64."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encodings = tok.encode_batch([f.read() for f in files], add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def eval_blocks(stream: torch.Tensor, seq_len: int, max_blocks: int | None) -> torch.Tensor:
    """Non-overlapping blocks of the held-out stream, evenly spaced when capped: shape ``(n_blocks, seq_len)``."""
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(f"held-out stream ({stream.numel()} tokens) is shorter than one block of {seq_len}")
    blocks = stream[: n * seq_len].view(n, seq_len)
    if max_blocks is not None and n > max_blocks:
        blocks = blocks[torch.linspace(0, n - 1, max_blocks).long()]
    return blocks


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of the training stream (seeded): shape ``(batch_size, seq_len)``."""
    starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def build_model(recipe: ModelRecipe, vocab_size: int, context_length: int):
    """A randomly initialised Llama (tied embeddings, sdpa attention), seeded by ``recipe.seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = recipe.shape
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=context_length,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(cfg).float()


@torch.inference_mode()
def evaluate(model, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) over ``blocks`` of shape ``(n, seq_len)``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        batch = blocks[i : i + batch_size]
        logits = model(input_ids=batch).logits[:, :-1].float()  # (b, T-1, V)
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        n = batch[:, 1:].numel()
        total += nll.item() * n
        count += n
    return total / count


def train_model(name: str, model, stream: torch.Tensor, heldout: torch.Tensor, sched: TrainSchedule, seed: int):
    """Train ``model`` in place on random windows of ``stream``; returns the loss curve and timings."""
    from tqdm import tqdm

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]  # norms: no weight decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": sched.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=sched.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(seed)
    curve: list[dict[str, float]] = []
    tokens_per_step = sched.batch_size * sched.seq_len
    start = time.perf_counter()
    deadline = start + sched.max_minutes * 60 if sched.max_minutes else None
    steps_done, stopped_early, ema = 0, False, None
    bar = tqdm(range(sched.steps), desc=f"train {name}", unit="step", mininterval=2.0, dynamic_ncols=True)
    for step in bar:
        model.train()
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(step)
        batch = sample_batch(stream, sched.batch_size, sched.seq_len, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), sched.grad_clip)
        opt.step()
        steps_done = step + 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        point = {"step": steps_done, "tokens": steps_done * tokens_per_step, "train_loss": loss.item()}
        if steps_done % sched.eval_every == 0 or steps_done == sched.steps:
            point["heldout_loss"] = evaluate(model, heldout)
        curve.append(point)
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{steps_done * tokens_per_step / elapsed:.0f}", refresh=False)
        if deadline is not None and time.perf_counter() > deadline and steps_done < sched.steps:
            stopped_early = True  # time cap hit: the run is no longer the configured one, recorded as such
            curve[-1].setdefault("heldout_loss", evaluate(model, heldout))
            break
    bar.close()
    wall = time.perf_counter() - start
    return {
        "steps": steps_done,
        "tokens": steps_done * tokens_per_step,
        "wall_s": round(wall, 1),
        "tokens_per_s": round(steps_done * tokens_per_step / wall, 1),
        "stopped_early_by_max_minutes": stopped_early,
        "curve": curve,
    }


def plot_curves(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Loss against training tokens for both models (train: smoothed, held-out: markers), as a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for (name, result), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        curve = result["curve"]
        tokens = [p["tokens"] / 1e6 for p in curve]
        smooth, ema = [], None
        for p in curve:
            ema = p["train_loss"] if ema is None else 0.9 * ema + 0.1 * p["train_loss"]
            smooth.append(ema)
        ax.plot(tokens, smooth, color=color, lw=1.2, label=f"{name} train (EMA)")
        held = [(p["tokens"] / 1e6, p["heldout_loss"]) for p in curve if "heldout_loss" in p]
        if held:
            ax.plot(*zip(*held, strict=True), "o--", color=color, ms=3, lw=0.8, label=f"{name} held-out")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _install(staging: Path, out_dir: Path) -> None:
    """Move finished products from ``staging`` into ``out_dir``, replacing old ones (other files are left alone)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in PRODUCTS:
        src, dst = staging / name, out_dir / name
        if dst.is_dir():
            shutil.rmtree(dst)
        os.replace(src, dst)


def _comparable(config_dict: dict[str, Any], skip: str) -> dict[str, Any]:
    return {k: v for k, v in config_dict.items() if k not in (skip, "out_dir")}


def _reuse_kept_model(config: PairConfig, out_dir: Path, staging: Path, only: str) -> tuple[str, dict[str, Any]]:
    """For ``--only``: copy the other, already built model into ``staging`` after checking it is this recipe's.

    The previous recipe.json must match the current config in everything but the rebuilt model's section, and the
    freshly trained tokenizer (deterministic) must be byte-identical to the shipped one, so the result is exactly what
    a full run of the current config gives (training is seeded and per-model).
    """
    keep = "draft" if only == "target" else "target"
    previous_path = out_dir / "recipe.json"
    if not previous_path.is_file() or not (out_dir / keep).is_dir():
        raise ValueError(f"--only {only} needs a previous full run in {out_dir} (recipe.json and {keep}/)")
    previous = json.loads(previous_path.read_text())
    if _comparable(previous["config"], only) != _comparable(config_to_dict(config), only):
        raise ValueError(f"--only {only}: the config differs from {previous_path} outside the {only!r} section")
    fresh, shipped = staging / "tokenizer" / "tokenizer.json", out_dir / "tokenizer" / "tokenizer.json"
    if fresh.read_bytes() != shipped.read_bytes():
        raise ValueError(f"--only {only}: the retrained tokenizer differs from {out_dir / 'tokenizer'}")
    shutil.copytree(out_dir / keep, staging / keep)
    return keep, previous["models"][keep]


def run_recipe(config: PairConfig, only: str | None = None) -> dict[str, Any]:
    """Run the recipe; returns the content of recipe.json. Nothing lands in ``out_dir`` until all succeeded.

    ``only="draft"`` (or ``"target"``) retrains just that model and keeps the other from a previous run of the same
    config (see :func:`_reuse_kept_model`).
    """
    from ddte_core.quiet import quiet_transformers

    with quiet_transformers(warnings=True):  # our own bars report the training; HF's would interleave with them
        return _run_recipe(config, only)


def _train_one(config: PairConfig, name: str, vocab: int, train_stream: torch.Tensor, heldout_stream: torch.Tensor,
               final_blocks: torch.Tensor) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, its result)``: the ``name`` model ("target", "draft") built, trained and rounded to the storage
    dtype, then scored on ``final_blocks`` (held out) and as many training blocks of the same length."""
    recipe: ModelRecipe = getattr(config, name)
    model = build_model(recipe, vocab, config.context_length)
    n_params = sum(p.numel() for p in model.parameters())
    heldout = eval_blocks(heldout_stream, recipe.train.seq_len, recipe.train.eval_blocks)
    result = train_model(name, model, train_stream, heldout, recipe.train, recipe.seed)
    round_to_storage(model, config.storage_dtype)
    result["parameters"] = n_params
    final_seq = final_blocks.shape[1]
    result["final_train_loss"] = evaluate(model, eval_blocks(train_stream, final_seq, len(final_blocks)))
    result["final_heldout_loss"] = evaluate(model, final_blocks)
    result["final_heldout_perplexity"] = math.exp(result["final_heldout_loss"])
    return model, result


def _run_recipe(config: PairConfig, only: str | None) -> dict[str, Any]:
    """:func:`run_recipe`'s body, with transformers' progress bars off."""
    if config.threads:
        torch.set_num_threads(config.threads)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files = subset(list_corpus(heldout_fraction=config.corpus.heldout_fraction), config.corpus.max_files)
    train_files, heldout_files = select_split(files, "train"), select_split(files, "heldout")
    if not train_files or not heldout_files:
        raise ValueError("the corpus needs at least one training and one held-out module")

    t_tok = time.perf_counter()
    tok = train_bpe((f.read() for f in train_files), config.tokenizer.vocab_size, config.tokenizer.min_frequency)
    hf_tok = wrap_for_transformers(tok, config.context_length)
    tokenizer_s = time.perf_counter() - t_tok
    train_stream, heldout_stream = encode_stream(tok, train_files), encode_stream(tok, heldout_files)
    vocab = tok.get_vocab_size()
    final_seq = config.target.train.seq_len  # one held-out block length for both models: comparable losses
    final_blocks = eval_blocks(heldout_stream, final_seq, config.final_eval_blocks)

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix=".train-pair-", dir=out_dir) as tmp:
        staging = Path(tmp)
        hf_tok.save_pretrained(staging / "tokenizer")
        if only is not None:
            keep, kept_result = _reuse_kept_model(config, out_dir, staging, only)
            results[keep] = kept_result
        for name in ("target", "draft") if only is None else (only,):
            model, results[name] = _train_one(config, name, vocab, train_stream, heldout_stream, final_blocks)
            save_model(model, hf_tok, staging / name, config.storage_dtype)
        results = {name: results[name] for name in ("target", "draft")}
        plot_curves(results, staging / "loss_curve.png")
        meta = {
            "config": config_to_dict(config),
            "python_version": python_version(),  # the corpus's: the standard library it was cut from
            "environment": environment(),
            "corpus": {
                **corpus_summary(files),
                "tokens": {"train": train_stream.numel(), "heldout": heldout_stream.numel()},
                "heldout_modules": [f.relpath for f in heldout_files],
            },
            "tokenizer": {"vocab_size": vocab, "wall_s": round(tokenizer_s, 1)},
            "seeds": {"target": config.target.seed, "draft": config.draft.seed},
            "final_eval": {"seq_len": final_seq, "heldout_blocks": len(final_blocks)},
            "models": results,
            "rebuilt_only": only,
            "wall_s_total": round(time.perf_counter() - t0, 1),
        }
        (staging / "recipe.json").write_text(json.dumps(meta, indent=1) + "\n")
        _install(staging, out_dir)
    return meta
