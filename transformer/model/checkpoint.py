"""Checkpoints: atomic writes, checked reads, and rebuilding a model (with its vocabulary) from one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from transformer.config import Config, from_dict
from transformer.data.vocab import AnyVocab, vocab_from_stored
from transformer.errors import UserError, first_line
from transformer.files import atomic_write
from transformer.model.transformer import Transformer
from transformer.run_dir import RunDir

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
    problem = _weights_problem(state)
    if problem is not None:
        raise UserError(f"checkpoint: {path} {problem}; use another checkpoint (step_*.pt, last.pt)")
    return state


def _weights_problem(state: dict) -> str | None:
    """Why a checkpoint of our format cannot rebuild a model, or None: a key of WEIGHT_KEYS missing or of the wrong
    kind (a hand-edited file), or a vocabulary that is not one of ours (a SentencePiece model, a Marian vocabulary's
    files)."""
    missing = [key for key in WEIGHT_KEYS if key not in state]
    if missing:
        return f"has no {' or '.join(repr(k) for k in missing)} (every checkpoint holds {', '.join(WEIGHT_KEYS)})"
    kinds = {"config": dict, "vocab": (bytes, dict), "model": dict}
    wrong = [key for key, kind in kinds.items() if not isinstance(state[key], kind)]
    if wrong:
        return f"holds {' and '.join(repr(k) for k in wrong)} of the wrong kind"
    try:
        vocab_from_stored(state["vocab"])
    except UserError as e:
        return f"holds a vocabulary that is {e}"
    return None


# Every key of a checkpoint. What `transformer average` and the end of training write: weights and what
# rebuilds the model. What `transformer train` writes and --resume needs: also the optimizer, the fp16 grad
# scaler, every rank's RNG state and the run's counters (training/run_state.py's RunState, with the data position).
WEIGHT_KEYS = ("config", "vocab", "model")
RESUMABLE_KEYS = WEIGHT_KEYS + ("optimizer", "scaler", "rng", "run")


def weights_checkpoint(config: dict, vocab: bytes | dict, model: dict, **about) -> dict:
    """A checkpoint that translate, evaluate and attention load; `about` records where it came from."""
    return {"config": config, "vocab": vocab, "model": model, **about}


# What a run directory means to translate, evaluate, attention and serve: the model the end of training chose
# (with its tuned search settings), else the best validation checkpoint, else the latest.
RUN_CHECKPOINTS = RunDir.CHECKPOINTS


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
    if not p.is_file():  # a device (/dev/zero reads for ever), a FIFO (waits for a writer): never opened
        raise UserError(f"checkpoint: {p} is not a regular file (nor a run directory); give a .pt file")
    return p


def model_from_checkpoint(state: dict, device: Any = "cpu") -> tuple[Transformer, AnyVocab, Config]:
    """Rebuild the model exactly as trained, from the config and vocabulary the checkpoint carries."""
    cfg = from_dict(state["config"])
    vocab = vocab_from_stored(state["vocab"])
    model = Transformer(cfg.model, len(vocab), vocab.specials)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(f"checkpoint: weights do not match its own config ({first_line(e)})") from None
    check_finite(model.state_dict(), "checkpoint")
    return model.to(device).eval(), vocab, cfg


def check_finite(weights: dict, what: str) -> None:
    """Refuse weights that hold NaN or infinite values, naming them. Torn bytes inside the zip's tensor data, or a
    diverged run, would otherwise show up as empty or garbage translations (a NaN score never beats the search's
    stop rule), or as a fine-tuning run whose every update is skipped. A sum is NaN or infinite when any term is:
    one pass over each weight, several times cheaper than isfinite().all(), and no bool copy of each weight."""
    bad = nonfinite(weights)
    if bad:
        raise UserError(
            f"{what}: {len(bad)} weight tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): the file is corrupt or its run diverged; use another "
            "checkpoint (step_*.pt, last.pt)"
        )


def nonfinite(weights: dict) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinite value (check_finite's sum), in order."""
    return [
        name
        for name, w in weights.items()
        if w.is_floating_point() and not bool(torch.isfinite(w.sum(dtype=torch.float32)))
    ]


def load_model(run_dir_or_file: str | Path, device: Any = "cpu") -> tuple[Transformer, AnyVocab, Config]:
    return model_from_checkpoint(load_checkpoint(resolve_checkpoint(run_dir_or_file)), device)
