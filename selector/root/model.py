"""The selector network (algorithms.md §3.6) and its LightningModule with two objectives.

``SelectorNet``: one Linear projection per hidden-state block to d (128 in the paper), each followed by LayerNorm;
concatenated with the standardised scalars; MLP 512 → 32 → one output per action, GELU, dropout. Standardisation
(log1p on heavy-tailed scalars, then (x − mean) / std) and the mask of actions that never have a label are buffers
used inside ``forward``, so the exported ONNX graph takes RAW scalars and never scores an invalid action high.

Objectives (``SelectorModule(objective=...)``):

* ``policy`` — the paper's Eq. 12. π = softmax of the scores over the root's valid actions,
  TPŜ_π = Σ π·be / Σ π·step_ms, r = TPŜ_π / TPŜ(a_base);
  L = mean(−log r) + λ · mean over the worst α-fraction of the batch of max(1 − r, 0)².
  Decision: argmax of the score ("argmax").
* ``be`` — regression of Ê[τ+1] per action (MSE over valid actions). Decision: argmax of
  predicted_be / step_ms ("throughput"), with step_ms from the decoder's latency model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from decode.policies.features import HIDDEN_NAMES, SCALAR_NAMES
from decode.policies.files.selector_file import OBJECTIVES
from selector.root.info import SelectorInfo

# Score given to actions that never had a label for this verifier: finite (ONNX parity compares it exactly, and
# −inf would turn be/step_ms decisions into NaN arithmetic) yet below any real score.
INVALID_SCORE = -1.0e9


class SelectorNet(nn.Module):
    """Scores per action from root features.

    Args:
        hidden_sizes: width of each hidden block, keyed by ``HIDDEN_NAMES`` names.
        num_scalars: S, the length of the scalar vector (``SCALAR_NAMES``).
        num_actions: A, one output per action.
        d_proj: projection width per hidden block.
        mlp_hidden: widths of the MLP's hidden layers.
        dropout: dropout after every hidden MLP layer (training only).
    """

    def __init__(self, hidden_sizes: Mapping[str, int], num_scalars: int, num_actions: int, d_proj: int = 128,
                 mlp_hidden: Sequence[int] = (512, 32), dropout: float = 0.1):
        super().__init__()
        self.proj = nn.ModuleDict(
            {name: nn.Sequential(nn.Linear(int(hidden_sizes[name]), d_proj), nn.LayerNorm(d_proj))
             for name in HIDDEN_NAMES}
        )
        layers: list[nn.Module] = []
        width = len(HIDDEN_NAMES) * d_proj + num_scalars
        for h in mlp_hidden:
            layers += [nn.Linear(width, h), nn.GELU(), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, num_actions))
        self.mlp = nn.Sequential(*layers)
        self.register_buffer("scalar_mean", torch.zeros(num_scalars))
        self.register_buffer("scalar_std", torch.ones(num_scalars))
        self.register_buffer("scalar_log1p", torch.zeros(num_scalars, dtype=torch.bool))
        self.register_buffer("action_valid", torch.ones(num_actions, dtype=torch.bool))

    def set_normalisation(self, mean: Sequence[float], std: Sequence[float], log_mask: Sequence[bool]) -> None:
        """Store the training split's standardisation (fitted outside, on the training rows only)."""
        self.scalar_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.scalar_std.copy_(torch.as_tensor(std, dtype=torch.float32))
        self.scalar_log1p.copy_(torch.as_tensor(np.asarray(log_mask, dtype=bool)))

    def set_valid_actions(self, valid: Sequence[bool]) -> None:
        """(A,) bool: actions that have a label for this verifier somewhere in the training data."""
        self.action_valid.copy_(torch.as_tensor(np.asarray(valid, dtype=bool)))

    def standardise(self, scalars: torch.Tensor) -> torch.Tensor:
        """Raw scalars (B, S) -> standardised (B, S): log1p(max(x, 0)) on the masked columns, then (x − mean) / std."""
        x = torch.where(self.scalar_log1p, torch.log1p(scalars.clamp_min(0.0)), scalars)
        return (x - self.scalar_mean) / self.scalar_std

    def forward(self, target_hidden_prev: torch.Tensor, draft_hidden_prev: torch.Tensor,
                draft_hidden_root: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        """(B, H_t), (B, H_d), (B, H_d), raw (B, S) -> scores (B, A); never-valid actions get ``INVALID_SCORE``."""
        blocks = (target_hidden_prev, draft_hidden_prev, draft_hidden_root)
        parts = [self.proj[name](x) for name, x in zip(HIDDEN_NAMES, blocks, strict=True)]
        scores = self.mlp(torch.cat([*parts, self.standardise(scalars)], dim=-1))
        return scores.masked_fill(~self.action_valid, INVALID_SCORE)


class DeployedSelector(nn.Module):
    """What the exported ONNX file computes: the network, then, for the policy objective, π = softmax over actions.

    Probabilities instead of raw logits: the policy is shift-invariant, so its logits drift to magnitudes of ~100
    where one float32 ulp is ~1e-5 and torch/onnxruntime parity could not be held to 1e-5; π lies in [0, 1]. The
    argmax (the decision) is the same. Never-valid actions get π = 0. The be objective outputs predicted Ê as is.
    """

    def __init__(self, net: SelectorNet, objective: str):
        super().__init__()
        self.net = net
        self.objective = objective

    def forward(self, target_hidden_prev: torch.Tensor, draft_hidden_prev: torch.Tensor,
                draft_hidden_root: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        """Same inputs as ``SelectorNet.forward`` -> (B, A): π(a | root) (policy) or predicted Ê[τ+1] (be)."""
        scores = self.net(target_hidden_prev, draft_hidden_prev, draft_hidden_root, scalars)
        return torch.softmax(scores, dim=-1) if self.objective == "policy" else scores

    @property
    def invalid_score(self) -> float:
        """The output of an action that never had a label for the verifier."""
        return 0.0 if self.objective == "policy" else INVALID_SCORE


# ---------------------------------------------------------------------------------------------------- objectives


def policy_loss(scores: torch.Tensor, be: torch.Tensor, step_ms: torch.Tensor, valid: torch.Tensor,
                base_index: torch.Tensor, lam: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 12 of the paper. Returns (loss scalar, ratio (B,) = TPŜ_π / TPŜ_base).

    Args:
        scores: (B, A) logits. be, step_ms: (B, A) labels (be is 0 where invalid). valid: (B, A) bool.
        base_index: (B,) the static baseline action of each row's sampling configuration.
        lam: weight λ of the tail penalty. alpha: fraction α of the batch (largest penalties) it averages over.
    """
    pi = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)  # invalid actions: π = 0 exactly
    tp_pi = (pi * be).sum(-1) / (pi * step_ms).sum(-1)
    base = base_index[:, None]
    tp_base = be.gather(1, base)[:, 0] / step_ms.gather(1, base)[:, 0]
    ratio = tp_pi / tp_base
    penalty = torch.clamp(1.0 - ratio, min=0.0) ** 2
    k = max(1, math.ceil(alpha * ratio.shape[0]))
    tail = torch.topk(penalty, k).values.mean()  # CVaR-style: only the worst α-fraction of the batch
    return (-torch.log(ratio)).mean() + lam * tail, ratio


def be_loss(predicted: torch.Tensor, be: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """MSE between predicted and true Ê[τ+1] over valid actions only; (B, A) each -> scalar."""
    err = torch.where(valid, predicted - be, torch.zeros_like(be))
    return (err**2).sum() / valid.sum().clamp_min(1)


def choose_actions(scores: torch.Tensor, step_ms: torch.Tensor, valid: torch.Tensor, objective: str) -> torch.Tensor:
    """The decision rule of an objective: (B, A) scores -> (B,) action index, never an invalid action."""
    value = scores / step_ms if objective == "be" else scores
    return value.masked_fill(~valid, float("-inf")).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------------- lightning


class SelectorModule(pl.LightningModule):
    """SelectorNet + objective + offline metrics, trained by Lightning.

    Args:
        hidden_sizes: hidden block widths (linked from the data module by ``ddte train``).
        num_actions: A (linked from the data module).
        num_scalars: S, the scalar vector length.
        objective: ``policy`` (Eq. 12, decision argmax) or ``be`` (Ê regression, decision argmax be/step_ms).
        d_proj: projection width per hidden block (paper: 128).
        mlp_hidden: MLP hidden widths (paper: 512, 32).
        dropout: dropout rate in the MLP (paper: not given).
        lr: peak AdamW learning rate; cosine decay to ``lr · min_lr_ratio`` over the run.
        weight_decay: AdamW weight decay.
        lam: λ of Eq. 12 (tail penalty weight).
        alpha: α of Eq. 12 (tail fraction of the batch).
        min_lr_ratio: final learning rate as a fraction of ``lr``.
    """

    def __init__(
        self,
        hidden_sizes: dict[str, int] | None = None,
        num_actions: int = 0,
        num_scalars: int = len(SCALAR_NAMES),
        objective: Literal["policy", "be"] = "policy",
        d_proj: int = 128,
        mlp_hidden: list[int] | None = None,
        dropout: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        lam: float = 1.0,
        alpha: float = 0.1,
        min_lr_ratio: float = 0.1,
    ):
        super().__init__()
        if not hidden_sizes or num_actions < 1:
            raise ValueError("SelectorModule needs hidden_sizes and num_actions (taken from the data set)")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got '{objective}'")
        if mlp_hidden is None:
            mlp_hidden = [512, 32]
        self.save_hyperparameters()
        self.net = SelectorNet(hidden_sizes, num_scalars, num_actions, d_proj, mlp_hidden, dropout)
        # What the exported file needs besides weights (actions, verifier, fingerprints, standardisation, guard): set
        # from the data module at fit time and carried in the checkpoint, beside the MLflow run that trained it.
        self.info: SelectorInfo | None = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self._outputs: dict[str, list[dict[str, np.ndarray]]] = {}

    @property
    def objective(self) -> str:
        return self.hparams.objective

    @property
    def decision(self) -> str:
        return OBJECTIVES[self.objective][0]  # (decision, output) per objective: the selector file's contract

    def forward(self, target_hidden_prev, draft_hidden_prev, draft_hidden_root, scalars) -> torch.Tensor:
        return self.net(target_hidden_prev, draft_hidden_prev, draft_hidden_root, scalars)

    def deployed(self) -> DeployedSelector:
        """The module that gets exported (eval mode): network + the objective's output transform."""
        return DeployedSelector(self.net, self.objective).eval()

    # -------------------------------------------------------------- data hand-over

    def setup(self, stage: str) -> None:
        """At fit time take standardisation, valid actions and data description from the data module."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if stage != "fit" or dm is None or getattr(dm, "normalisation", None) is None:
            return
        if dict(dm.hidden_sizes) != dict(self.hparams.hidden_sizes) or dm.num_actions != self.hparams.num_actions:
            raise ValueError(f"model built for hidden sizes {dict(self.hparams.hidden_sizes)} and "
                             f"{self.hparams.num_actions} actions, data has {dm.hidden_sizes} and {dm.num_actions}")
        norm = dm.normalisation
        self.net.set_normalisation(norm.mean, norm.std, norm.log_mask())
        self.net.set_valid_actions(dm.valid_actions)
        self.info = SelectorInfo(dm.facts(), self.objective, norm.to_dict())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        run = {k: v for k, v in (("run_id", self.run_id), ("tracking_uri", self.tracking_uri)) if v}
        checkpoint["ddte"] = (self.info.to_dict() if self.info is not None else {}) | run

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("ddte", {})
        self.info = SelectorInfo.from_dict(saved) if saved.get("actions") else None
        self.run_id, self.tracking_uri = saved.get("run_id"), saved.get("tracking_uri")

    # -------------------------------------------------------------- steps

    def _scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(*(batch[name] for name in HIDDEN_NAMES), batch["scalars"])

    def _loss(self, scores: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        valid = batch["valid"] & self.net.action_valid
        if self.objective == "policy":
            loss, _ = policy_loss(scores, batch["be"], batch["step_ms"], valid, batch["base_index"],
                                  self.hparams.lam, self.hparams.alpha)
            return loss
        return be_loss(scores, batch["be"], valid)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(self._scores(batch), batch)
        self.log("train/loss", loss, on_step=False, on_epoch=True, batch_size=batch["scalars"].shape[0],
                 sync_dist=True)
        return loss

    def _eval_step(self, split: str, batch: dict[str, torch.Tensor]) -> None:
        scores = self._scores(batch)
        self.log(f"{split}/loss", self._loss(scores, batch), on_step=False, on_epoch=True,
                 batch_size=batch["scalars"].shape[0], sync_dist=True)
        valid = batch["valid"]
        self._outputs.setdefault(split, []).append({
            "chosen": choose_actions(scores, batch["step_ms"], valid, self.objective),
            "be": torch.where(valid, batch["be"], torch.full_like(batch["be"], float("nan"))),
            "step_ms": batch["step_ms"],
            "sampling_index": batch["sampling_index"],
            "base_index": batch["base_index"],
        })

    def _log_offline_metrics(self, split: str) -> None:
        """Offline metrics over the whole split (ratios of sums). Every rank evaluates every row of the split
        (selector/root/train.py shares out only the training loader), so each holds the same figures."""
        from selector.root.metrics import offline_metrics

        parts = self._outputs.pop(split, [])
        if not parts:
            return
        arr = {k: torch.cat([p[k] for p in parts]).cpu().numpy() for k in parts[0]}
        per_step = self.info is not None and self.info.data.per_step  # how the data set's roots stand for a stream
        metrics = offline_metrics(arr["chosen"], arr["be"], arr["step_ms"], arr["sampling_index"], arr["base_index"],
                                  per_step)
        self.log_dict(metrics.as_dict(f"{split}/"), sync_dist=True)  # equal on every rank: no warning, no change

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step("val", batch)

    def on_validation_epoch_end(self) -> None:
        self._log_offline_metrics("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step("test", batch)

    def on_test_epoch_end(self) -> None:
        self._log_offline_metrics("test")

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        scores = self._scores(batch)
        return {"scores": scores, "chosen": choose_actions(scores, batch["step_ms"], batch["valid"], self.objective)}

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total,
                                                           eta_min=self.hparams.lr * self.hparams.min_lr_ratio)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
