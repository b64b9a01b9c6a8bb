"""CUDA-only behaviour (skipped on machines without a GPU): mixed precision training steps, bf16 translation."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import LINES, read_metrics, tiny_config
from transformer import train as train_module
from transformer.checkpoint import load_checkpoint
from transformer.config import from_dict
from transformer.train import train
from transformer.translate import Translator

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_fp16_overflow_lowers_the_loss_scale_and_skips_the_update(tmp_path, monkeypatch):
    real_loss = train_module.label_smoothed_loss
    calls = {"n": 0}

    def overflow_once(logits, target, smoothing):
        calls["n"] += 1
        loss = real_loss(logits, target, smoothing)
        return loss * 1e8 if calls["n"] == 5 else loss  # finite in fp32, inf once scaled into fp16 gradients

    monkeypatch.setattr(train_module, "label_smoothed_loss", overflow_once)
    raw = tiny_config(tmp_path, train={"max_steps": 8, "valid_every": 100, "precision": "fp16", "device": "cuda"})
    run_dir = train(from_dict(raw), quiet=True)
    state = load_checkpoint(run_dir / "last.pt")
    assert state["run"]["step"] == 8
    assert state["scaler"]["scale"] < 2.0 ** 16  # lowered from GradScaler's initial 65536
    assert "non-finite loss or gradient; skipped" in (run_dir / "train.log").read_text()
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_training_learns(tmp_path, precision):
    raw = tiny_config(tmp_path, train={"max_steps": 30, "valid_every": 10, "precision": precision,
                                       "device": "cuda", "lr_schedule": "inverse_sqrt", "lr": 3e-3})
    run_dir = train(from_dict(raw), quiet=True)
    valid = [m["loss"] for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert valid[-1] < valid[0]


def test_auto_dtype_on_cuda_is_bf16_and_close_to_fp32(copy_model):
    auto = Translator(copy_model, device="cuda", beam=3, dtype="auto")
    assert auto.dtype == ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32")
    assert next(auto.model.parameters()).dtype == (torch.bfloat16 if auto.dtype == "bf16" else torch.float32)
    fp32 = Translator(copy_model, device="cuda", beam=3, dtype="fp32").translate(LINES)
    assert sum(a == b for a, b in zip(fp32, auto.translate(LINES))) >= 0.75 * len(LINES)
    cpu = Translator(copy_model, device="cpu", beam=3, dtype="fp32").translate(LINES)
    assert sum(a == b for a, b in zip(fp32, cpu)) >= 0.9 * len(LINES)  # the same search on either device
