"""Typed configuration of ``ddte distill`` (``configs/distill/*.yaml``; every key overridable as ``key=value``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ddte_core.schedule import OptimSchedule
from ddte_core.yamlconfig import load_yaml_config
from distill.divergences import DIVERGENCES


@dataclass
class ModelShape:
    """Llama architecture sizes of one model (vocabulary and context come from elsewhere): a draft built from
    scratch here (``init: scratch``), either model of the pair recipe."""

    hidden_size: int = 384
    intermediate_size: int = 1536
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 6

    def problem(self) -> str | None:
        """What makes these sizes no Llama (heads that do not split the width, a rotary head of odd size), or None.
        Sizes below 1 are the caller's check."""
        if min(dataclasses.astuple(self)) < 1:
            return None
        heads, groups = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads:
            return f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {heads}"
        if heads % groups:
            return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}"
        if (self.hidden_size // heads) % 2:
            return f"the head size hidden_size / num_attention_heads = {self.hidden_size // heads} must be even"
        return None


@dataclass
class DistillData:
    """What the draft learns from: stdlib training-split text, and sequences it samples itself (on-policy)."""

    seq_len: int = 128  # tokens per fixed-data window
    batch_size: int = 16
    heldout_fraction: float = 0.1  # the corpus split of the pair's recipe: held-out modules are never trained on
    max_files: int | None = None  # cap on corpus files per split (tests)
    onpolicy_fraction: float = 0.5  # after the warm start, this share of the batches is sampled by the draft
    target_fraction: float = 0.0  # and this share is continued by the target: the contexts decoding drafts from
    onpolicy_prefix: int = 48  # real tokens before the draft's own continuation
    onpolicy_tokens: int = 48  # tokens the draft samples per sequence
    onpolicy_temperature: float = 1.0
    warm_start_steps: int = 100  # fixed data only before on-policy batches start
    val_blocks: int = 32  # held-out windows of seq_len for the validation acceptance
    text: str = "stdlib"  # stdlib (the shipped pair's corpus split), chat (distill.chat_data: ../shared/data), or
    # laws (distill.teacher_cache: the target's responses with its laws, sampled once and cached; no target in training)
    responses: int = 0  # chat: training prompts the target answers once (cached token ids) to train on
    response_tokens: int = 128  # chat: most tokens per target response
    response_temperature: float = 1.0  # chat: the target's sampling temperature for its responses
    response_weight: int = 1  # chat: copies of each target response in the training stream (they are few and
    # they are what decoding meets, while reference answers are many)
    sample_temperatures: list[float] = field(default_factory=lambda: [0.6, 1.0])  # laws: each prompt is answered
    # once at each of these (decoding meets the contexts of every temperature it serves)
    cache_dir: str | None = None  # chat: where target responses are cached (null: $DDTE_CACHE/distill)


@dataclass
class DistillSchedule(OptimSchedule):
    """Optimisation of the draft (:class:`OptimSchedule`, with distillation's defaults), its validation and seed."""

    steps: int = 1500
    warmup_steps: int = 50
    weight_decay: float = 0.0
    val_every: int = 250
    seed: int = 0
    threads: int | None = 2


@dataclass
class DistillTrainer:
    """Where Lightning runs the job: ``devices`` per node, ``num_nodes`` and ``strategy`` (auto, ddp, ...) spread it
    over several processes; rank 0 alone tracks it and writes the draft, and each rank draws its own batches."""

    accelerator: str = "cpu"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"


@dataclass
class Steer:
    """SD² steering (decode.models.steering, algorithms.md §9): train a low-rank map from the target's states at token
    t − k to a bias on every draft MLP's up projection at token t, k drawn in 1..max_offset per batch, together with
    the draft. Needs a target pass per batch (data.text stdlib or chat, not laws)."""

    enabled: bool = False
    target_layers: list[int] | None = None  # HF hidden_states indices (layer inputs); null: ~1/10, 1/2 and 9/10 deep
    rank: int = 64  # the bottleneck (the paper's full-rank map would outweigh a small draft)
    max_offset: int = 8  # offsets 1..max_offset: the root is steered at k = 1, a node d deep at k = d + 1


@dataclass
class Tracking:
    tracking_uri: str | None = None  # null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db (absolute)
    experiment: str = "ddte-distill"
    run_name: str | None = None


@dataclass
class DistillConfig:
    """The whole job: which pair, where the draft starts, the divergence, the data and the schedule."""

    target: str = "models/target"
    draft: str | None = "models/draft"  # the draft to start from (null with init: scratch)
    tokenizer: str | None = "models/tokenizer"
    target_dtype: str = "float32"  # the teacher's dtype (the dtype the pair runs it in: its laws are the target's)
    init: str = "draft"  # draft (continue from `draft`) or scratch (a new draft of `shape`)
    init_embedding: str = "random"  # scratch: random, or pca (the target's embedding projected on its top components)
    max_positions: int | None = None  # scratch: the draft's max_position_embeddings (null: the target's)
    shape: ModelShape = field(default_factory=lambda: ModelShape(128, 512, 1, 2, 2))
    output: str = "runs/distill/draft"
    overwrite: bool = False
    divergence: str = "jsd"
    temperatures: list[float] = field(default_factory=lambda: [0.6, 1.0])  # the loss is averaged over these
    teacher_topk: int | None = None  # train on both laws coarsened to the teacher's top k + the rest (large vocab)
    storage_dtype: str = "float16"
    data: DistillData = field(default_factory=DistillData)
    train: DistillSchedule = field(default_factory=DistillSchedule)
    trainer: DistillTrainer = field(default_factory=DistillTrainer)
    steer: Steer = field(default_factory=Steer)
    tracking: Tracking = field(default_factory=Tracking)


def load_distill_config(path: str | Path | None, overrides: list[str] | None = None) -> DistillConfig:
    """Read, override and check a distill config; ValueError naming the first bad key."""
    config = load_yaml_config(DistillConfig, path, overrides)
    data, train = config.data, config.train
    checks = [
        (config.divergence in DIVERGENCES, f"divergence must be one of {', '.join(DIVERGENCES)}"),
        (config.init in ("draft", "scratch"), "init must be draft or scratch"),
        (config.init_embedding in ("random", "pca"), "init_embedding must be random or pca"),
        (config.target_dtype in ("float32", "bfloat16", "float16"), "target_dtype: float32, bfloat16 or float16"),
        (data.text in ("stdlib", "chat", "laws"), "data.text must be stdlib, chat or laws"),
        (data.text != "laws" or (data.responses >= 1 and config.teacher_topk is not None
                                 and bool(data.sample_temperatures) and min(data.sample_temperatures) > 0),
         "data.text=laws needs responses >= 1, teacher_topk set and sample_temperatures > 0"),
        (config.teacher_topk is None or config.teacher_topk >= 1, "teacher_topk must be >= 1 (or null)"),
        (data.responses >= 0 and data.response_tokens >= 1 and data.response_temperature > 0
         and data.response_weight >= 1,
         "data: responses >= 0, response_tokens >= 1, response_temperature > 0, response_weight >= 1"),
        (config.init == "scratch" or bool(config.draft), "init: draft needs a draft directory"),
        (bool(config.temperatures) and all(t > 0 for t in config.temperatures), "temperatures must be > 0"),
        (config.storage_dtype in ("float32", "float16", "bfloat16"), "storage_dtype: float32, float16 or bfloat16"),
        (data.seq_len >= 2 and data.batch_size >= 1 and data.val_blocks >= 1, "data: seq_len >= 2, batch_size and "
         "val_blocks >= 1"),
        (0.0 <= data.onpolicy_fraction and 0.0 <= data.target_fraction
         and data.onpolicy_fraction + data.target_fraction <= 1.0,
         "data.onpolicy_fraction and data.target_fraction must be >= 0 with a sum <= 1"),
        (data.onpolicy_prefix >= 1 and data.onpolicy_tokens >= 1 and data.onpolicy_temperature > 0,
         "data: onpolicy_prefix and onpolicy_tokens >= 1, onpolicy_temperature > 0"),
        (data.warm_start_steps >= 0, "data.warm_start_steps must be >= 0"),
        (0.0 < data.heldout_fraction < 1.0, "data.heldout_fraction must be in (0, 1)"),
        (train.val_every >= 1, "train: val_every must be >= 1"),
        (train.problem() is None, f"train: {train.problem()}"),
        (config.trainer.devices >= 1 and config.trainer.num_nodes >= 1, "trainer: devices and num_nodes must be >= 1"),
        (not config.steer.enabled or data.text != "laws",
         "steer.enabled needs the target's states in training: data.text stdlib or chat, not laws"),
        (config.steer.rank >= 1 and config.steer.max_offset >= 1, "steer: rank and max_offset must be >= 1"),
        (config.steer.target_layers is None or (bool(config.steer.target_layers)
                                                and min(config.steer.target_layers) >= 0),
         "steer.target_layers: a non-empty list of layer indices >= 0 (or null)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    for key, value in dataclasses.asdict(config.shape).items():
        if value < 1:
            raise ValueError(f"shape.{key} must be >= 1, got {value}")
    if problem := config.shape.problem():
        raise ValueError(f"shape: {problem}")
    return config
