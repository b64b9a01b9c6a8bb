"""One optimizer update (training/update.py): the per-token mean gradient of all its micro-batches, clipped; an update
with a non-finite loss skipped, and training stopped with a message after too many in a row."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import built_run, change_training_loss, tiny_config
from transformer.config import from_dict
from transformer.errors import UserError
from transformer.model.checkpoint import load_checkpoint
from transformer.training.loop import train
from transformer.training.update import MAX_SKIPPED_IN_A_ROW, train_update


def _state(path):
    return load_checkpoint(path)


def test_non_finite_loss_skips_the_update(tmp_path, monkeypatch):
    change_training_loss(monkeypatch, lambda n, loss: loss * float("nan") if n == 3 else loss)  # the third micro-batch
    raw = tiny_config(tmp_path, train={"max_steps": 5, "valid_every": 100})
    run_dir = train(from_dict(raw), quiet=True)
    state = _state(run_dir / "last.pt")
    assert state["run"]["step"] == 5  # five good updates; the NaN one did not count
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert "non-finite loss or gradient; skipped" in (run_dir / "train.log").read_text()


def test_all_non_finite_stops_with_a_message_and_saves_no_nan(tmp_path, monkeypatch):
    change_training_loss(monkeypatch, lambda n, loss: loss * float("nan"))
    raw = tiny_config(tmp_path, train={"max_steps": 50})
    with pytest.raises(UserError, match=f"training diverged: {MAX_SKIPPED_IN_A_ROW} updates in a row"):
        train(from_dict(raw), quiet=True)
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize("clip_norm", [0.0, 0.05])
def test_an_update_steps_on_the_per_token_mean_gradient_of_all_its_batches_clipped(tmp_path, clip_norm):
    # What the optimizer gets from train_update over update_freq 2 batches of unequal size: the gradient of
    # the label-smoothed loss summed over both, divided by their target tokens, clipped to train.clip_norm.
    import copy

    from transformer.data.loader import BatchStream
    from transformer.data.vocab import PAD_ID
    from transformer.signals import StopRequested
    from transformer.training.optim import label_smoothed_loss

    # fp32: the reference below runs without autocast, which auto would turn on where the CPU has native bf16.
    cfg = from_dict(
        tiny_config(
            tmp_path,
            model={"dropout": 0.0},
            train={"update_freq": 2, "clip_norm": clip_norm, "peak_tflops": 1.0, "precision": "fp32"},
        )
    )
    run, store = built_run(cfg)
    update = BatchStream(store.corpus("train"), cfg.data, seed=1, update_freq=2).next_update()
    assert update.batches[0].n_tgt_tokens != update.batches[1].n_tgt_tokens

    reference = copy.deepcopy(run.model)
    losses = [
        label_smoothed_loss(reference(b.src, b.tgt_in, b.src_mask, b.tgt_mask), b.tgt_out, 0.1) for b in update.batches
    ]
    tokens = sum(int((b.tgt_out != PAD_ID).sum()) for b in update.batches)
    (sum(losses) / tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_norm or float("inf"))
    assert clip_norm == 0 or norm > 2 * clip_norm  # the clip takes effect

    stepped = []
    step = run.optimizer.step
    run.optimizer.step = lambda *a, **k: (
        stepped.append([p.grad.clone() for p in run.model.parameters()]),
        step(*a, **k),
    )[1]
    result = train_update(run, update, StopRequested())
    assert result.loss == pytest.approx(float(sum(losses).detach()), rel=1e-5) and not result.nonfinite
    assert len(stepped) == 1
    for got, want in zip(stepped[0], (p.grad for p in reference.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
