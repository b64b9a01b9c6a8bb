"""Loss, learning-rate schedules and the optimizer built from a config."""

from __future__ import annotations

import math

import pytest
import torch

from transformer.config import Config, TrainConfig, from_dict
from transformer.data.vocab import PAD_ID
from transformer.training.optim import (
    build_optimizer,
    inverse_sqrt,
    label_smoothed_loss,
    lr_at,
    noam,
    set_hyperparameters,
)


def hand_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """sum over non-pad tokens of (1 - eps) * -log p(target) + eps * mean_v(-log p(v))."""
    logits = logits.double()
    logp = logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))
    total = torch.zeros((), dtype=torch.float64)
    b, t, v = logits.shape
    for i in range(b):
        for j in range(t):
            y = int(target[i, j])
            if y == PAD_ID:
                continue
            nll = -logp[i, j, y]
            smooth = -logp[i, j].sum() / v
            total = total + (1 - eps) * nll + eps * smooth
    return total


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_by_hand(eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = PAD_ID
    target[2, 1:] = PAD_ID
    got = label_smoothed_loss(logits, target, eps)
    assert got.shape == ()
    torch.testing.assert_close(got.double(), hand_loss(logits, target, eps), atol=1e-4, rtol=1e-6)


def test_label_smoothed_loss_ignores_pad_logits():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 7)
    target = torch.randint(1, 7, (2, 4))
    target[1, 2:] = PAD_ID
    changed = logits.clone()
    changed[1, 2:] = torch.randn(2, 7) * 100
    torch.testing.assert_close(label_smoothed_loss(changed, target, 0.1), label_smoothed_loss(logits, target, 0.1))
    # All padding: nothing to sum.
    assert label_smoothed_loss(logits, torch.zeros_like(target), 0.1).item() == 0.0


def test_label_smoothed_loss_is_a_sum_and_has_gradients():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 9, requires_grad=True)
    target = torch.randint(1, 9, (2, 3))
    whole = label_smoothed_loss(logits, target, 0.1)
    parts = label_smoothed_loss(logits[:1], target[:1], 0.1) + label_smoothed_loss(logits[1:], target[1:], 0.1)
    torch.testing.assert_close(whole, parts)
    whole.backward()
    # d loss / d logits = softmax - ((1 - eps) onehot + eps / V), summed per token -> each row sums to 0.
    torch.testing.assert_close(logits.grad.sum(-1), torch.zeros(2, 3), atol=1e-6, rtol=0)


def test_noam_values():
    d, w = 512, 4000
    for step in (1, 10, 100, 3999, 4000, 4001, 10000, 100000):
        expected = d**-0.5 * min(step**-0.5, step * w**-1.5)
        assert noam(step, d, w) == pytest.approx(expected, rel=1e-12)
    # Linear during warmup ...
    assert noam(2000, d, w) == pytest.approx(2 * noam(1000, d, w))
    # ... then inverse square root.
    assert noam(16000, d, w) == pytest.approx(noam(4000, d, w) / 2)
    # Step 0 is treated as step 1 (no zero rate, no division by zero).
    assert noam(0, d, w) == noam(1, d, w) > 0


def test_noam_peaks_at_warmup():
    d, w = 256, 100
    values = [noam(s, d, w) for s in range(1, 1000)]
    assert max(range(len(values)), key=values.__getitem__) + 1 == w
    assert values[w - 1] == pytest.approx(d**-0.5 * w**-0.5)


def test_inverse_sqrt_values():
    w = 1000
    for step in (1, 250, 999, 1000, 1001, 4000, 250000):
        expected = min(step / w, math.sqrt(w / step))
        assert inverse_sqrt(step, w) == pytest.approx(expected, rel=1e-12)
    assert inverse_sqrt(w, w) == pytest.approx(1.0)
    assert max(inverse_sqrt(s, w) for s in range(1, 5000)) == pytest.approx(1.0)
    assert inverse_sqrt(4 * w, w) == pytest.approx(0.5)


def cfg_with(**train) -> Config:
    raw = {
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
        "train": train,
    }
    return from_dict(raw)


@pytest.mark.parametrize("schedule, lr", [("noam", 2.0), ("inverse_sqrt", 5e-4), ("constant", 3e-4)])
def test_lr_at(schedule, lr):
    cfg = cfg_with(lr_schedule=schedule, lr=lr, warmup_steps=10)
    for step in (1, 5, 10, 20, 1000):
        if schedule == "noam":
            expected = lr * 32**-0.5 * min(step**-0.5, step * 10**-1.5)
        elif schedule == "inverse_sqrt":
            expected = lr * min(step / 10, math.sqrt(10 / step))
        else:
            expected = lr
        assert lr_at(step, cfg) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("schedule, lr", [("noam", 2.0), ("inverse_sqrt", 5e-4), ("constant", 3e-4)])
def test_each_update_runs_at_lr_at_its_step(schedule, lr):
    cfg = cfg_with(lr_schedule=schedule, lr=lr, warmup_steps=4)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, cfg)
    for step in range(1, 9):  # update `step` (1-based) runs at lr_at(step)
        assert set_hyperparameters(optimizer, cfg, step) == lr_at(step, cfg)
        for group in optimizer.param_groups:
            assert group["lr"] == lr_at(step, cfg)
        before = model.weight.detach().clone()
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        # Adam's first step moves each weight by about lr: the rate set is the rate used.
        if step == 1:
            assert (model.weight.detach() - before).abs().max().item() == pytest.approx(lr_at(1, cfg), rel=1e-3)
    assert "lr_schedule" not in str(optimizer.state_dict())  # nothing about the schedule to save or restore


def test_a_resumed_run_takes_the_new_adam_settings():
    optimizer = build_optimizer(torch.nn.Linear(3, 2), cfg_with(adam_betas=[0.9, 0.98], adam_eps=1e-9))
    set_hyperparameters(optimizer, cfg_with(adam_betas=[0.8, 0.95], adam_eps=1e-6, lr=0.5), 3)
    group = optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6


def test_adam_settings_from_config():
    cfg = cfg_with(adam_betas=[0.8, 0.95], adam_eps=1e-6)
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, cfg)
    assert type(optimizer) is torch.optim.Adam
    group = optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.8, 0.95)
    assert group["eps"] == 1e-6
    assert group["weight_decay"] == 0
    assert {id(p) for p in group["params"]} == {id(p) for p in model.parameters()}


def test_paper_defaults_and_weight_decay():
    defaults = TrainConfig()
    assert defaults.adam_betas == (0.9, 0.98) and defaults.adam_eps == 1e-9
    cfg = cfg_with(weight_decay=0.01)
    optimizer = build_optimizer(torch.nn.Linear(3, 2), cfg)
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert group["weight_decay"] == 0.01
    assert tuple(group["betas"]) == (0.9, 0.98) and group["eps"] == 1e-9


def test_frozen_parameters_not_optimised():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    optimizer = build_optimizer(model, cfg_with())
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert id(model[0].weight) not in ids and id(model[1].weight) in ids
