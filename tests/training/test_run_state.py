"""What survives a restart (training/run_state.py): the resume rules (the model and vocabulary cannot change, nor
Adam become AdamW), the fp16 loss scale put back, and checkpoints that are not a resumable run of ours refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_config
from transformer.config import from_dict
from transformer.errors import UserError
from transformer.model.checkpoint import load_checkpoint
from transformer.training.loop import train
from transformer.training.run_state import check_resume_config, load_resumable, restore_training


@pytest.mark.parametrize(
    "key, value",
    [
        ("data.vocab_size", 48),
        ("data.src_lang", "fr"),
        ("data.tgt_lang", "fr"),
        ("data.spm_model_type", "unigram"),
        ("model.d_ff", 128),
    ],
)
def test_resume_refuses_a_change_to_the_model_or_its_vocabulary(tmp_path, key, value):
    section, name = key.split(".")
    saved = from_dict(tiny_config(tmp_path, data_dir=tmp_path))
    changed = from_dict(tiny_config(tmp_path, data_dir=tmp_path, **{section: {name: value}}))
    with pytest.raises(
        UserError,
        match=f"resume: {key} was .* in the checkpoint and is {value!r} now; the model and vocabulary cannot change",
    ):
        check_resume_config(saved, changed)


@pytest.mark.parametrize("before, after, allowed", [(0.0, 0.01, False), (0.01, 0.0, False), (0.01, 0.1, True)])
def test_resume_refuses_switching_between_adam_and_adamw(tmp_path, before, after, allowed):
    saved, new = (
        from_dict(tiny_config(tmp_path, data_dir=tmp_path, train={"weight_decay": w})) for w in (before, after)
    )
    if allowed:
        changes = check_resume_config(saved, new)
        assert [(c.key, c.before, c.after) for c in changes] == [("train.weight_decay", 0.01, 0.1)]
    else:
        with pytest.raises(UserError, match=r"cannot switch between 0 \(Adam\) and > 0 \(AdamW\)"):
            check_resume_config(saved, new)


def test_restore_training_puts_back_the_fp16_loss_scale():
    """Without it a resumed fp16 run starts again at 65,536 and skips updates on overflow until the scale has
    come down: the continuation would no longer be the uninterrupted run."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    trained = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": trained.state_dict()}
    fresh = torch.amp.GradScaler("cpu")
    restore_training(saved, model, optimizer, fresh)
    assert fresh.state_dict() == trained.state_dict() and fresh.get_scale() == 1024.0


def test_foreign_files_and_incomplete_counters_are_refused(tmp_path):
    torch.save({"model": {}}, tmp_path / "foreign.pt")  # a dict, but not one this package wrote
    with pytest.raises(UserError, match="is not a checkpoint written by this package"):
        load_checkpoint(tmp_path / "foreign.pt")
    state = _state_of_a_short_run(tmp_path)
    del state["run"]["tokens"]  # a counter missing, none unknown
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(UserError, match=r"run counters differ \(unknown: none; missing: tokens\)"):
        load_resumable(tmp_path / "partial.pt")


def _state_of_a_short_run(tmp_path) -> dict:
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 1, "valid_every": 1})), quiet=True)
    return torch.load(tmp_path / "run" / "last.pt", weights_only=True)
