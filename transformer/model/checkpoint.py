"""Checkpoints: atomic writes, checked reads, and rebuilding a model (with its vocabulary) from one."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from transformer.files import atomic_write
from transformer.config import Config, from_dict
from transformer.errors import UserError, first_line
from transformer.model.transformer import Transformer
from transformer.training.optim import load_optimizer_state
from transformer.training.run_state import RunState
from transformer.data.vocab import Vocab

FORMAT = "transformer-checkpoint-v1"


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write atomically: a crash at any moment leaves either the old checkpoint or the new one."""
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **state}, f))


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict:
    path = Path(path)
    if path.is_dir():
        path = resolve_checkpoint(path)
    if not path.is_file():
        raise UserError(f"checkpoint: no such file: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception:  # torch.load reports a torn or foreign file through many exception types
        raise UserError(f"checkpoint: {path} is not a checkpoint, or is truncated or corrupt") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"checkpoint: {path} is not a checkpoint written by this package")
    return state


# Every key of a checkpoint. What `transformer average` and the end of training write: weights and what
# rebuilds the model. What `transformer train` writes and --resume needs: also the optimizer, the fp16 grad
# scaler, every rank's RNG state and the run's counters (resume.RunState, with the data position).
WEIGHT_KEYS = ("config", "vocab", "model")
RESUMABLE_KEYS = WEIGHT_KEYS + ("optimizer", "scaler", "rng", "run")


def weights_checkpoint(config: dict, vocab: bytes, model: dict, **about) -> dict:
    """A checkpoint that translate, evaluate and attention load; `about` records where it came from."""
    return {"config": config, "vocab": vocab, "model": model, **about}


def training_checkpoint(config: dict, vocab: bytes, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        scaler: torch.amp.GradScaler, rngs: list, run: dict, train_order: str) -> dict:
    """Everything a run continues from (no learning-rate scheduler: the rate is a pure function of the step).
    train_order: Store.train_order, so that a resume can tell whether run["data"]'s position still applies."""
    return {**weights_checkpoint(config, vocab, model.state_dict()), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "rng": rngs, "run": run, "train_order": train_order}


def restore_training(saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler) -> None:
    """Load a resumable checkpoint's weights, optimizer and scaler (the caller restores counters and RNG)."""
    model.load_state_dict(saved["model"])
    load_optimizer_state(optimizer, saved["optimizer"])  # with the flags of this run's device
    if saved["scaler"]:  # empty when the run was saved without fp16
        scaler.load_state_dict(saved["scaler"])


def load_resumable(path: str | Path) -> dict:
    """A checkpoint that a run can continue from, or a UserError saying why this one cannot be."""
    state = load_checkpoint(path)
    missing = [key for key in RESUMABLE_KEYS if key not in state]
    if missing:
        what = "weights only, as `transformer average` writes" if "optimizer" in missing else "an incomplete state"
        raise UserError(f"resume: {path} cannot be resumed: it holds {what} (no {', '.join(missing)}); put the "
                        "run's own last.pt back, or start a new run in another train.run_dir")
    counters, saved = {f.name for f in fields(RunState)}, state["run"]
    if not isinstance(saved, dict) or set(saved) != counters:
        found = set(saved) if isinstance(saved, dict) else set()
        unknown, lacking = ", ".join(sorted(found - counters)) or "none", ", ".join(sorted(counters - found))
        raise UserError(f"resume: {path} cannot be resumed by this version of transformer: its run counters "
                        f"differ (unknown: {unknown}; missing: {lacking or 'none'}); resume with the version that "
                        "wrote it, or start a new run in another train.run_dir")
    return state


# What a run directory means to translate, evaluate, attention and serve: the model the end of training chose
# (with its tuned search settings), else the best validation checkpoint, else the latest.
RUN_CHECKPOINTS = ("final.pt", "best.pt", "last.pt")


def resolve_checkpoint(run_dir_or_file: str | Path) -> Path:
    """A run directory means its final.pt, else best.pt, else last.pt; a file means itself."""
    p = Path(run_dir_or_file)
    if p.is_dir():
        for name in RUN_CHECKPOINTS:
            if (p / name).is_file():
                return p / name
        raise UserError(f"checkpoint: {p} holds no final.pt, best.pt or last.pt")
    if not p.exists():
        raise UserError(f"checkpoint: no such file or run directory: {p}")
    return p


def model_from_checkpoint(state: dict, device: Any = "cpu") -> tuple[Transformer, Vocab, Config]:
    """Rebuild the model exactly as trained, from the config and vocabulary the checkpoint carries."""
    cfg = from_dict(state["config"])
    vocab = Vocab(state["vocab"])
    model = Transformer(cfg.model, len(vocab))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(f"checkpoint: weights do not match its own config ({first_line(e)})") from None
    # Torn bytes inside the zip's tensor data, or a diverged run, would otherwise show up as empty or garbage
    # translations (a NaN score never beats the search's stop rule).
    # A sum is NaN or infinite when any term is: 0.026 s against 0.18 s for isfinite().all() over 67M parameters
    # on a 2-core EPYC, and no bool copy of each weight.
    bad = [name for name, w in model.state_dict().items()
           if w.is_floating_point() and not bool(torch.isfinite(w.sum(dtype=torch.float32)))]
    if bad:
        raise UserError(f"checkpoint: {len(bad)} weight tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
                        f"{', ...' if len(bad) > 3 else ''}): the file is corrupt or its run diverged; use another "
                        "checkpoint (step_*.pt, last.pt)")
    return model.to(device).eval(), vocab, cfg


def load_model(run_dir_or_file: str | Path, device: Any = "cpu") -> tuple[Transformer, Vocab, Config]:
    return model_from_checkpoint(load_checkpoint(resolve_checkpoint(run_dir_or_file)), device)
