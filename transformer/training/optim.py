"""What is optimised and how: label-smoothed cross entropy, Adam, and the learning rate as a pure function of the step."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from transformer.config import Config
from transformer.data.vocab import PAD_ID


def label_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float, pad_id: int = PAD_ID
) -> torch.Tensor:
    """Summed over non-pad target tokens (pad_id: the vocabulary's): (1 - eps) * NLL + eps * mean over the
    vocabulary of -log p.

    logits (B, T, V), target (B, T). The caller divides by the token count of the whole update,
    so that accumulation and data parallelism normalise per target token, as one big batch would.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        target.reshape(-1),
        ignore_index=pad_id,
        label_smoothing=smoothing,
        reduction="sum",
    )


def noam(step: int, d_model: int, warmup: int) -> float:
    """The paper's schedule: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    step = max(step, 1)
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def inverse_sqrt(step: int, warmup: int) -> float:
    """Linear warmup to 1, then decay as sqrt(warmup / step) (fairseq's inverse_sqrt)."""
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step))


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate of update number `step` (1-based): train.lr times the schedule's multiplier."""
    t = cfg.train
    if t.lr_schedule == "noam":
        return t.lr * noam(step, cfg.model.d_model, t.warmup_steps)
    if t.lr_schedule == "inverse_sqrt":
        return t.lr * inverse_sqrt(step, t.warmup_steps)
    return t.lr


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """Adam (AdamW with weight decay); its learning rate is set before every update with set_lr(lr_at(step))."""
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)  # the fused kernel does the whole update in a few launches
    opt_cls = torch.optim.AdamW if t.weight_decay > 0 else torch.optim.Adam
    kwargs = {"weight_decay": t.weight_decay} if t.weight_decay > 0 else {}
    return opt_cls(params, lr=t.lr, betas=t.adam_betas, eps=t.adam_eps, fused=fused or None, **kwargs)


# How the optimizer computes, not what: chosen for the device the run is on (build_optimizer), never taken from a
# checkpoint. Optimizer.load_state_dict restores them with the parameter groups, so a run started on a CPU and
# resumed on CUDA would keep the slow per-tensor path (and one started on CUDA would ask a CPU for fused kernels).
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load a saved optimizer state (moments, step counts, hyperparameters) into `optimizer`, keeping its own
    implementation flags (IMPLEMENTATION_FLAGS). They are put into the saved groups before loading, because
    loading also places the step counts by them (on the device for fused kernels, on the CPU otherwise)."""
    groups = [
        {**group, **{key: fresh[key] for key in IMPLEMENTATION_FLAGS if key in fresh}}
        for group, fresh in zip(saved["param_groups"], optimizer.param_groups)
    ]
    optimizer.load_state_dict({**saved, "param_groups": groups})


def set_hyperparameters(optimizer: torch.optim.Optimizer, cfg: Config, step: int) -> float:
    """Set update `step`'s learning rate (and the config's Adam settings, which a resumed run may have changed)
    on every parameter group; return the rate. Nothing about the schedule lives in the optimizer's state."""
    t, lr = cfg.train, lr_at(step, cfg)
    for group in optimizer.param_groups:
        group.update(lr=lr, betas=t.adam_betas, eps=t.adam_eps, weight_decay=t.weight_decay)
    return lr
