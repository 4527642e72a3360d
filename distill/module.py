"""The distillation step as a LightningModule: the draft learns the target's next-token laws (DistillSpec).

Each training batch holds windows of training-split text. After the warm start, a configured share of batches is
*on-policy*: the draft continues each window's first ``onpolicy_prefix`` tokens with ``onpolicy_tokens`` of its
own samples, and the loss is taken only where the draft predicts from its own drawn tokens, the contexts it meets
when it drafts. Another share (``target_fraction``) is continued by the target instead: the contexts a draft
starts from in decoding, where every accepted token is the target's. The target, frozen, gives p on the fly; the
loss is the chosen divergence between p_T and q_T, averaged over positions and over the configured temperatures T
(both laws at the same T, as decoding uses them).
Validation reports β = 1 − TV on held-out windows at each temperature.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from distill.divergences import DIVERGENCES, EPS, acceptance
from distill.teacher_cache import LawBatch


class DistillModule(pl.LightningModule):
    """Trains ``draft`` (a registered submodule) against a frozen ``target`` (kept out of the module's parameters,
    optimizer and checkpoints)."""

    def __init__(self, draft, target, divergence: str, temperatures: list[float], data, schedule,
                 teacher_topk: int | None = None, steering=None) -> None:
        super().__init__()
        self.teacher_topk = teacher_topk
        self.draft = draft
        # SD² steering (decode.models.steering): the map trains with the draft; its δ enters the draft through hooks
        self.steering = steering
        self._up_bias = None
        if steering is not None:
            from decode.models.hooks import UpProjectionBias

            self._up_bias = UpProjectionBias(draft)
        object.__setattr__(self, "_target", target.eval().requires_grad_(False))
        self.divergence = DIVERGENCES[divergence]
        self.temperatures = list(temperatures)
        self.data, self.schedule = data, schedule
        self._coin = torch.Generator().manual_seed(schedule.seed + 1)
        self._val: dict[float, list[torch.Tensor]] = {}
        self.target_seconds = 0.0

    # -------------------------------------------------------------- the loss

    def _loss(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, dict[float, torch.Tensor]]:
        """Mean divergence over positions ``start ..`` (row i predicts token i + 1) and temperatures; β per T.

        With ``teacher_topk`` set (training only), both laws are first coarsened to the teacher's top-k tokens plus
        one bucket for the rest (:func:`coarsen`), and β is measured on the batch's first sequence only.
        """
        import time

        clock = time.perf_counter()
        with torch.no_grad():
            out = self._target(input_ids=ids, output_hidden_states=self.steering is not None)
            target_logits = out.logits[:, start:-1].float()  # (B, n, V)
        self.target_seconds += time.perf_counter() - clock
        if self.steering is not None:
            self._up_bias.delta = self._steering_bias(out.hidden_states)
        try:
            draft_logits = self.draft(input_ids=ids).logits[:, start:-1].float()
        finally:
            if self._up_bias is not None:
                self._up_bias.delta = None
        topk = self.teacher_topk if self.training else None
        if topk:
            top = target_logits.topk(topk, dim=-1).indices  # (B, n, k)
        losses, betas = [], {}
        for t in self.temperatures:
            log_p = torch.log_softmax(target_logits / t, dim=-1)
            log_q = torch.log_softmax(draft_logits / t, dim=-1)
            if topk:
                with torch.no_grad():
                    betas[t] = acceptance(log_p[:1].exp(), log_q[:1].detach().exp())
                p_coarse, log_q_coarse = coarsen(log_p, log_q, top)
                losses.append(self.divergence(p_coarse, log_q_coarse).mean())
            else:
                p = log_p.exp()
                losses.append(self.divergence(p, log_q).mean())
                betas[t] = acceptance(p, log_q.exp()).detach()
        return torch.stack(losses).mean(), betas

    def _steering_bias(self, hidden_states) -> torch.Tensor:
        """δ ``(B, S, L, d_ff)``: token t steered by the target's states at t − k, one offset k per batch drawn
        uniformly in 1..max_offset (SD²); tokens with no state k back get none."""
        spec = self.steering.spec
        states = torch.stack([hidden_states[i] for i in spec.target_layers], dim=2).float()  # (B, S, taps, d_T)
        k = int(torch.randint(1, spec.max_offset + 1, (1,), generator=self._coin))
        delta = self.steering(states)  # (B, S, L, d_ff): the bias each token's state gives k tokens later
        shifted = torch.zeros_like(delta)
        if k < delta.shape[1]:
            shifted[:, k:] = delta[:, :-k]
        return shifted

    def _on_policy(self, windows: torch.Tensor, sampler=None) -> torch.Tensor:
        """``(B, prefix + tokens)``: each window's prefix continued by ``sampler``'s samples (the draft's own by
        default; the target's for decode-time contexts), without gradient."""
        sampler = self.draft if sampler is None else sampler
        prefix = windows[:, : self.data.onpolicy_prefix]
        was_training = self.draft.training
        self.draft.eval()
        with torch.no_grad():
            out = sampler.generate(
                prefix, do_sample=True, temperature=self.data.onpolicy_temperature, top_k=None, top_p=None,
                max_new_tokens=self.data.onpolicy_tokens, min_new_tokens=self.data.onpolicy_tokens,
                pad_token_id=self.draft.config.pad_token_id, attention_mask=torch.ones_like(prefix),
            )
        self.draft.train(was_training)
        return out

    # -------------------------------------------------------------- lightning

    def _law_loss(self, batch: LawBatch) -> tuple[torch.Tensor, dict[float, torch.Tensor]]:
        """The coarsened divergence against cached teacher laws (:mod:`distill.teacher_cache`), averaged over the
        masked positions and the training temperatures (the laws' own, checked when the batches were built); no
        target pass. β per T is 1 − TV between the coarsened laws, a lower bound of the acceptance."""
        draft_logits = self.draft(input_ids=batch.ids).logits[:, :-1].float()  # (B, S-1, V)
        losses, betas = [], {}
        for index, t in enumerate(self.temperatures):
            log_q = torch.log_softmax(draft_logits / t, dim=-1)
            p, log_q_coarse = coarsen_top(batch.log_p_top[index], log_q.gather(-1, batch.top_ids))  # (B, S-1, k+1)
            losses.append(self.divergence(p, log_q_coarse)[batch.mask].mean())
            with torch.no_grad():
                betas[t] = acceptance(p, log_q_coarse.exp())[batch.mask]
        return torch.stack(losses).mean(), betas

    def training_step(self, batch: torch.Tensor | LawBatch, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, LawBatch):
            loss, betas = self._law_loss(batch)
            self.log("train/loss", loss, prog_bar=True, batch_size=batch.size)
            for t, beta in betas.items():
                self.log(f"train/acceptance_T{t:g}", beta.mean(), prog_bar=t == max(self.temperatures),
                         batch_size=batch.size)
            return loss
        coin = float(torch.rand(1, generator=self._coin))
        warm = self.global_step < self.data.warm_start_steps
        on_policy = not warm and coin < self.data.onpolicy_fraction
        by_target = not warm and not on_policy and coin < self.data.onpolicy_fraction + self.data.target_fraction
        if on_policy or by_target:  # the loss only where the sampled continuation is predicted
            ids = self._on_policy(batch, self._target if by_target else None)
            start = self.data.onpolicy_prefix - 1
        else:
            ids, start = batch, 0
        loss, betas = self._loss(ids, start)
        size = ids.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/on_policy", float(on_policy), batch_size=size)
        self.log("train/target_sampled", float(by_target), batch_size=size)
        for t, beta in betas.items():
            self.log(f"train/acceptance_T{t:g}", beta.mean(), prog_bar=t == max(self.temperatures), batch_size=size)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, betas = self._loss(batch, 0)
        self.log("val/loss", loss, batch_size=batch.shape[0])
        for t, beta in betas.items():
            self._val.setdefault(t, []).append(beta.reshape(-1))

    def on_validation_epoch_end(self) -> None:
        for t, parts in self._val.items():
            self.log(f"val/acceptance_T{t:g}", torch.cat(parts).mean(), prog_bar=True)
        self._val = {}

    def configure_optimizers(self):
        schedule = self.schedule
        trained = list(self.draft.parameters()) + (list(self.steering.parameters()) if self.steering else [])
        decay = [p for p in trained if p.ndim >= 2]
        no_decay = [p for p in trained if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": schedule.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=schedule.lr, betas=(0.9, 0.95))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.lr_at(step) / schedule.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def coarsen(log_p: torch.Tensor, log_q: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both laws over the k tokens ``top`` ``(..., k)`` plus one bucket for every other token: ``(p, log q)`` of
    shape ``(..., k + 1)``.

    A divergence between coarsened laws is a lower bound of the divergence between the full laws (data processing)
    and, for fkl, tvd and jsd, equals it when the teacher's mass lies in its top k; it costs a gather instead of
    several passes over a 49,152-token vocabulary. The draft's gradient still reaches every logit through its
    normaliser.
    """
    return coarsen_top(log_p.gather(-1, top), log_q.gather(-1, top))


def coarsen_top(log_p_top: torch.Tensor, log_q_top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, log q)`` ``(..., k + 1)`` from both laws' log-probabilities on the same k tokens ``(..., k)``: the k
    tokens plus one bucket holding the rest of each law's mass."""
    p_top = log_p_top.exp()
    p_rest = (1 - p_top.sum(-1, keepdim=True)).clamp_min(0)
    q_rest = (1 - log_q_top.exp().sum(-1, keepdim=True)).clamp_min(EPS)
    return torch.cat([p_top, p_rest], -1), torch.cat([log_q_top, q_rest.log()], -1)

