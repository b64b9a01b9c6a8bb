"""One optimizer update: the model and its loss as one module (TrainingLoss), the loss scaler, the update over a
rank's micro-batches with its one host sync (train_update), and an update skipped for a non-finite value."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from transformer.config import Config
from transformer.data.loader import Update
from transformer.device import autocast_context
from transformer.distributed import DistInfo, all_reduce_sum
from transformer.errors import UserError
from transformer.model.transformer import Transformer
from transformer.signals import StopRequested
from transformer.training.optim import label_smoothed_loss, set_hyperparameters
from transformer.training.run_state import RunState

log = logging.getLogger("transformer")

MAX_SKIPPED_IN_A_ROW = 20


class Training(Protocol):
    """What an update needs of the run (loop.Run holds it)."""

    cfg: Config
    info: DistInfo
    device: torch.device
    precision: str
    model: Transformer
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    state: RunState
    saved_step: int | None


class TrainingLoss(nn.Module):
    """The model and its label-smoothed loss as one module: what DDP wraps and torch.compile compiles. Compiled
    together, the loss fuses with the output projection instead of reading the (batch, length, vocabulary) logits,
    the largest activation of a step, back from memory in separate kernels."""

    def __init__(self, model: Transformer, smoothing: float):
        super().__init__()
        self.model, self.smoothing = model, smoothing

    def forward(self, src, tgt_in, tgt_out, src_mask, tgt_mask) -> torch.Tensor:
        """The loss summed over the batch's target tokens (optim.label_smoothed_loss)."""
        logits = self.model(src, tgt_in, src_mask, tgt_mask)
        return label_smoothed_loss(logits, tgt_out, self.smoothing, self.model.pad_id)


def make_grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """The loss scaler, enabled for fp16 only. It starts at 2^7, as fairseq and NVIDIA's recipes do: torch's 2^16
    overflows in the first updates, and each overflow skips an update while the scale halves."""
    return torch.amp.GradScaler(device.type, init_scale=2.0**7, enabled=precision == "fp16")


@dataclass
class StepResult:
    loss: float  # summed over the update's target tokens, all ranks
    nonfinite: bool  # some rank saw a non-finite loss or gradient: the update was skipped
    stop_requested: bool  # some rank got SIGINT/SIGTERM: every rank saves and stops after this update
    grad_norm: float  # before clipping
    lr: float


def train_update(run: Training, update: Update, stop: StopRequested) -> StepResult:
    """One optimizer update over this rank's update_freq batches; gradients sync once, at the last of them."""
    info = run.info
    lr = set_hyperparameters(run.optimizer, run.cfg, run.state.step + 1)
    loss_sum = torch.zeros((), device=run.device, dtype=torch.float64)
    for i, batch in enumerate(update.batches):
        batch = batch.to(run.device, non_blocking=True)
        # DDP averages gradients over ranks; scaling by world_size / (tokens of the whole update)
        # makes the result the per-token mean of one big batch.
        sync = i == len(update.batches) - 1 or not info.enabled
        with contextlib.nullcontext() if sync else run.forward.no_sync():
            with autocast_context(run.device, run.precision):
                loss = run.forward(batch.src, batch.tgt_in, batch.tgt_out, batch.src_mask, batch.tgt_mask)
            run.scaler.scale(loss * (info.world_size / update.n_tgt_tokens)).backward()
        loss_sum += loss.detach()
    run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.clip_norm or float("inf"))
    # One small reduction and the update's one host sync: the update's loss, whether any rank saw a non-finite
    # value, whether any rank was asked to stop (so all ranks stop together), and the gradient norm for the log
    # (the same on every rank after DDP's averaging: summed, then divided). The stop flag is filled in on the
    # device: torch.tensor(flag, device=...) would copy it from pageable host memory, a sync of its own.
    stopping = torch.full((), float(stop.signal_name is not None), device=run.device, dtype=torch.float64)
    flags = torch.stack(
        [
            loss_sum,
            (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)).double(),
            stopping,
            grad_norm.double() / info.world_size,
        ]
    )
    update_loss, nonfinite, stop_requested, grad_norm = all_reduce_sum(flags, info).tolist()
    if not nonfinite:
        run.scaler.step(run.optimizer)
        run.state.step += 1
        run.state.tokens += update.n_tgt_tokens + update.n_src_tokens
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(update_loss, bool(nonfinite), bool(stop_requested), grad_norm, lr)


def skipped_update(run: Training, in_a_row: int) -> None:
    """An update skipped for a non-finite loss or gradient is logged; MAX_SKIPPED_IN_A_ROW of them end training."""
    log.warning("update %d: non-finite loss or gradient; skipped, the weights are unchanged", run.state.step + 1)
    if in_a_row >= MAX_SKIPPED_IN_A_ROW:
        held = f"last.pt holds step {run.saved_step}" if run.saved_step is not None else "no last.pt was written"
        raise UserError(
            f"training diverged: {in_a_row} updates in a row had a non-finite "
            f"loss or gradient; stopping without saving them ({held})"
        )
