"""One distillation job: load the pair, train the draft against the target, track it in MLflow, write the draft.

The output folder is staged under a temporary name beside it and renamed only when the draft, its tokenizer files
and ``distill.json`` are all written, so a folder on disk is always whole. With several processes (``trainer``:
devices, num_nodes, strategy) rank 0 alone creates the MLflow run and writes the draft, and each rank trains on
batches of its own. Every problem with the input (a missing
directory, two vocabularies, a bad config value, an output that exists) is a ValueError raised before training.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ddte_core.paths import folder_is_writable, refuse_file_in_the_way
from distill.config import DistillConfig

PRODUCTS = ("config.json", "model.safetensors", "distill.json")


@dataclass
class DistillResult:
    output: Path
    run_id: str
    tracking_uri: str
    before: dict[str, float]
    after: dict[str, float]
    summary: dict


def check_output(config: DistillConfig) -> Path:
    """The output folder: new, or an existing one with ``overwrite``; never under a file."""
    output = refuse_file_in_the_way(config.output)
    if output.exists() and not config.overwrite:
        raise ValueError(f"output {output} exists: choose another, or set overwrite=true")
    if not folder_is_writable(output.parent):
        raise ValueError(f"output {output}: no folder can be made there; choose another")
    return output


def resolve_target(target: str) -> Path:
    """The target's folder or GGUF file: ``fetch:NAME`` is the folder ``ddte fetch NAME`` writes."""
    from decode.models.registry import fetch_name, require_fetched

    name = fetch_name(target)
    return require_fetched(name) if name is not None else Path(target)


def load_models(config: DistillConfig):
    """(tokenizer, target, draft): the target frozen in ``target_dtype``, the draft fp32, sharing one vocabulary;
    ValueError otherwise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decode.models.loading import check_same_vocab, load_causal_lm
    from decode.pair import find_tokenizer
    from distill.saving import DTYPES

    target_path = resolve_target(config.target)
    target = load_causal_lm(target_path, "cpu", DTYPES[config.target_dtype])
    tokenizer = find_tokenizer(target_path, config.tokenizer)
    if tokenizer is None:
        raise ValueError(f"no tokenizer found for {config.target}: set tokenizer=DIR")
    if config.init == "draft":
        draft = load_causal_lm(config.draft, "cpu", torch.float32)
    else:
        shape = config.shape
        torch.manual_seed(config.train.seed)
        draft = LlamaForCausalLM(LlamaConfig(
            vocab_size=target.config.vocab_size,
            max_position_embeddings=config.max_positions or target.config.max_position_embeddings,
            tie_word_embeddings=True, pad_token_id=target.config.pad_token_id,
            bos_token_id=target.config.bos_token_id, eos_token_id=target.config.eos_token_id,
            **dataclasses.asdict(shape),
        )).float()
        if config.init_embedding == "pca":
            pca_embedding(draft, target)
    check_same_vocab(target.config, draft.config)
    if len(tokenizer) > target.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the models' {target.config.vocab_size}")
    return tokenizer, target, draft.train()


def pca_embedding(draft, target) -> None:
    """Set the draft's (tied) embedding to the target's embedding projected on its top principal components.

    A from-scratch draft with a 49,152-token vocabulary spends most of its early steps learning which tokens are
    alike; the target's table already says so. The projection ``(V, d_target) -> (V, d_draft)`` is rescaled to the
    draft's initial row norm so the first layer sees inputs of the size it was initialised for.
    """
    source = target.get_input_embeddings().weight.detach().float()  # (V, d_target)
    centred = source - source.mean(0, keepdim=True)
    width = draft.config.hidden_size
    _, _, v = torch.pca_lowrank(centred, q=width, center=False)  # v: (d_target, width)
    projected = centred @ v  # (V, width)
    weight = draft.get_input_embeddings().weight
    with torch.no_grad():
        scale = weight.norm(dim=1).mean() / projected.norm(dim=1).mean().clamp_min(1e-8)
        weight.copy_(projected * scale)


def training_text(config: DistillConfig, tokenizer, target) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(training stream, held-out stream, what was used): the stdlib corpus split, or chat conversations with the
    target's cached responses (:mod:`distill.chat_data`)."""
    from distill.data import corpus_files, token_stream

    data = config.data
    if data.text == "stdlib":
        train_files, heldout_files = corpus_files(data.heldout_fraction, data.max_files)
        return token_stream(tokenizer, train_files), token_stream(tokenizer, heldout_files), {"text": "stdlib"}
    from ddte_core.paths import cache_root
    from decode.pair import model_fingerprint
    from distill.chat_data import fixed_sequences, stream_of, target_responses

    cache = Path(data.cache_dir) if data.cache_dir else cache_root() / "distill"
    target_path = resolve_target(config.target)
    fingerprint = f"{model_fingerprint(target_path)}:{config.target_dtype}"  # the responses follow the law as run
    start = time.perf_counter()
    responses = target_responses(target, tokenizer, fingerprint, data.responses, data.response_tokens,
                                 data.response_temperature, cache, seed=config.train.seed)
    seconds = time.perf_counter() - start
    eos = tokenizer.eos_token_id
    train = stream_of(fixed_sequences(tokenizer, "train", responses, response_weight=data.response_weight), eos)
    heldout = stream_of(fixed_sequences(tokenizer, "heldout"), eos)
    used = {"text": "chat", "responses": len(responses), "response_tokens": sum(map(len, responses.values())),
            "response_seconds": round(seconds, 1)}
    return train, heldout, used


def training_laws(config: DistillConfig, tokenizer, target, log=print):
    """The target's responses to the first ``data.responses`` training chat prompts, each sampled at every
    ``data.sample_temperatures``, with its laws (:mod:`distill.teacher_cache`): read from the cache, else sampled
    once and cached."""
    from data_gen.chat_prompts import build_chat_prompts
    from ddte_core.paths import cache_root
    from decode.pair import model_fingerprint, render_chat
    from distill.teacher_cache import TeacherLaws, cache_path, sample_responses

    data = config.data
    cache = Path(data.cache_dir) if data.cache_dir else cache_root() / "distill"
    records = build_chat_prompts("train", count=data.responses)
    plan = [(r["id"], t) for t in data.sample_temperatures for r in records]
    fingerprint = f"{model_fingerprint(resolve_target(config.target))}:{config.target_dtype}"
    path = cache_path(cache, fingerprint, plan, data.response_tokens, config.teacher_topk, config.temperatures,
                      config.train.seed)
    if path.is_file():
        return TeacherLaws.load(path), path
    prompts = {r["id"]: list(tokenizer(render_chat(tokenizer, r["messages"]))["input_ids"]) for r in records}
    laws = sample_responses(target, tokenizer, [prompts[i] for i, _ in plan], [t for _, t in plan],
                            data.response_tokens, config.teacher_topk, config.temperatures, seed=config.train.seed,
                            log=log)
    laws.save(path)
    return laws, path


def distill(config: DistillConfig, progress: bool = True) -> DistillResult | None:
    """Run the job (see the module docstring); returns where the draft went and what it reached (None on every rank
    of a multi-process job but 0)."""
    from ddte_core.distributed import is_rank_zero
    from ddte_core.tracking import git_commit, lightning_logger, resolve_tracking_uri
    from distill.data import evenly_spaced_windows
    from distill.module import DistillModule

    output = check_output(config)
    uri = resolve_tracking_uri(config.tracking.tracking_uri)  # a bad URI is refused before hours of work
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    tokenizer, target, draft = load_models(config)
    windows, heldout_stream, train_tokens, text = training_batches(config, tokenizer, target)
    val_blocks = evenly_spaced_windows(heldout_stream, config.data.seq_len, config.data.val_blocks)
    steering = make_steering(config, draft, target) if config.steer.enabled else None
    module = DistillModule(draft, target, config.divergence, config.temperatures, config.data, config.train,
                           config.teacher_topk, steering)

    lead = is_rank_zero()  # one MLflow run per job, and one writer of the draft
    run_name = config.tracking.run_name or f"distill-{config.divergence}"
    logger = lightning_logger(uri, config.tracking.experiment, run_name,
                              {"ddte.divergence": config.divergence}) if lead else False
    trainer = make_trainer(config, logger, progress)
    before, after, seconds = _fit(trainer, module, windows, val_blocks, config)
    if not lead:
        return None
    summary = {
        "config": dataclasses.asdict(config), "before": before, "after": after, "train_seconds": round(seconds, 1),
        "target_forward_seconds": round(module.target_seconds, 1), "steps": trainer.global_step,
        "tokens": {"train": train_tokens, "heldout": int(heldout_stream.numel())}, "text": text,
        "parameters": sum(p.numel() for p in draft.parameters()),
        "steering": None if steering is None else {**dataclasses.asdict(steering.spec),
                                                   "parameters": sum(p.numel() for p in steering.parameters())},
        "run_id": logger.run_id, "git_commit": git_commit(),
    }
    _write(draft, tokenizer, config, output, summary, steering)
    _log_run(logger, summary, output, seconds)
    return DistillResult(output, logger.run_id, uri, before, after, summary)


def training_batches(config: DistillConfig, tokenizer, target):
    """``(training batches, held-out token stream (T,), training tokens, what the text was)``: the target's own
    responses with their laws (``data.text=laws``, held out on chat text), else random windows of a token stream."""
    from distill.data import RandomWindows

    if config.data.text != "laws":
        train_stream, heldout_stream, text = training_text(config, tokenizer, target)
        windows = RandomWindows(train_stream, config.data.seq_len, config.data.batch_size, config.train.seed)
        return windows, heldout_stream, int(train_stream.numel()), text
    from distill.teacher_cache import LawBatches

    laws, laws_path = training_laws(config, tokenizer, target)
    windows = LawBatches(laws, config.data.batch_size, config.data.seq_len, config.train.seed)
    heldout_stream = training_text(replace_text(config, "chat"), tokenizer, target)[1]
    text = {"text": "laws", "cache": str(laws_path), "sequences": len(laws),
            "response_tokens": laws.response_token_count(), "sample_seconds": round(laws.seconds, 1),
            "cache_mb": round(laws_path.stat().st_size / 2**20, 1)}
    return windows, heldout_stream, int(laws.tokens.numel()), text


def make_trainer(config: DistillConfig, logger, progress: bool):
    """The Lightning trainer of the job: a step budget, validation every ``val_every`` steps on every rank."""
    import lightning.pytorch as pl

    return pl.Trainer(
        **dataclasses.asdict(config.trainer), use_distributed_sampler=False,  # every rank validates every block
        max_steps=config.train.steps, val_check_interval=config.train.val_every,
        check_val_every_n_epoch=None, logger=logger, enable_checkpointing=False, enable_progress_bar=progress,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=10,
        gradient_clip_val=config.train.grad_clip,
        max_time={"minutes": config.train.max_minutes} if config.train.max_minutes else None,
    )


def _fit(trainer, module, windows, val_blocks, config: DistillConfig) -> tuple[dict, dict, float]:
    """``(held-out metrics before, after, training seconds)``; the draft is rounded to its storage dtype before the
    second validation, so what is shipped is what is measured (the steering map stays float32)."""
    from torch.utils.data import DataLoader

    from ddte_core.signals import training_interrupts
    from ddte_core.tracking import quiet_lightning
    from distill.saving import round_to_storage

    val_loader = DataLoader(val_blocks, batch_size=config.data.batch_size)
    torch.manual_seed(config.train.seed)  # the draft's own samples (on-policy batches) are seeded too
    # Ctrl-C: exit 130 as every ddte command, never inside a write to the run's store
    with quiet_lightning(), training_interrupts(getattr(trainer.logger, "experiment", None)):
        before = _validate(trainer, module, val_loader)
        start = time.perf_counter()
        trainer.fit(module, DataLoader(windows, batch_size=None), val_loader)
        seconds = time.perf_counter() - start
        round_to_storage(module.draft, config.storage_dtype)
        after = _validate(trainer, module, val_loader)
    return before, after, seconds


def _log_run(logger, summary: dict, output: Path, seconds: float) -> None:
    """The config as params, the written draft as artifacts and the training time, on the job's MLflow run."""
    from ddte_core.tracking import flatten_params

    client = logger.experiment
    for key, value in flatten_params("config", summary["config"]).items():
        client.log_param(logger.run_id, key, value)
    client.log_artifacts(logger.run_id, str(output), "draft")
    client.log_metric(logger.run_id, "train_seconds", seconds)
    client.set_terminated(logger.run_id)


def replace_text(config: DistillConfig, text: str) -> DistillConfig:
    """``config`` with ``data.text`` set to ``text`` and no target responses (the held-out text of that kind)."""
    return dataclasses.replace(config, data=dataclasses.replace(config.data, text=text, responses=0))


def _validate(trainer, module, loader) -> dict[str, float]:
    metrics = trainer.validate(module, loader, verbose=False)[0]
    return {k.removeprefix("val/"): float(v) for k, v in metrics.items()}


def make_steering(config: DistillConfig, draft, target):
    """A new steering map for this draft and target (zero output: the draft starts as it was), bound to the target's
    fingerprint."""
    from decode.models.steering import SteeringMap, SteeringSpec, draft_mlp_shape
    from decode.pair import model_fingerprint

    layers, ffn = draft_mlp_shape(draft)
    depth = int(target.config.num_hidden_layers)
    chosen = config.steer.target_layers or sorted({max(1, round(depth / 10)), depth // 2, round(9 * depth / 10)})
    if max(chosen) > depth:
        raise ValueError(f"steer.target_layers {chosen}: the target has hidden states 0..{depth}")
    torch.manual_seed(config.train.seed)
    return SteeringMap(SteeringSpec(tuple(chosen), int(target.config.hidden_size), config.steer.rank, layers, ffn,
                                    model_fingerprint(resolve_target(config.target)), config.steer.max_offset))


def _write(draft, tokenizer, config: DistillConfig, output: Path, summary: dict, steering=None) -> None:
    """The draft (safetensors, storage dtype), its tokenizer files, its steering map and draft vocabulary when it has
    them, and distill.json, staged then renamed."""
    from decode.models.draft_vocab import DraftVocab
    from distill.saving import save_model

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        save_model(draft, tokenizer, staging, config.storage_dtype)
        if steering is not None:
            steering.save(staging)
        vocab = DraftVocab.load(config.draft) if config.init == "draft" else None
        if vocab is not None:  # the parent's reduced output vocabulary still fits: it was chosen from the target
            vocab.save(staging)
        (staging / "distill.json").write_text(json.dumps(summary, indent=1) + "\n")
        for path in staging.iterdir():  # ordinary shared files, whatever the writers' temporary modes
            path.chmod(0o644)
        staging.chmod(0o755)
        if output.exists():  # overwrite: the old folder goes only once the new one is whole
            old = output.with_name(f".{output.name}-old-{time.time_ns()}")
            output.rename(old)
            staging.rename(output)
            shutil.rmtree(old)
        else:
            staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
