"""Checkpoint averaging: the float mean of several checkpoints' weights, saved as a checkpoint that translate and evaluate load."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from transformer.atomic import check_output_path
from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.errors import UserError

STEP_NAME = re.compile(r"step_(\d+)\.pt$")


def last_step_checkpoints(run_dir: str | Path, n: int) -> list[Path]:
    """The n latest step_XXXXXXXX.pt files of a run directory, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"average: no such run directory: {run_dir}")
    if n < 1:
        raise UserError("average: --last must be at least 1")
    found = sorted((int(m.group(1)), p) for p in run_dir.glob("step_*.pt") if (m := STEP_NAME.search(p.name)))
    if len(found) < n:
        raise UserError(f"average: asked for the last {n} checkpoints but {run_dir} holds {len(found)} step_*.pt "
                        "(the trainer keeps train.keep_last of them)")
    return [p for _, p in found[-n:]]


def average_checkpoints(paths: Sequence[str | Path]) -> dict:
    """A checkpoint state whose weights are the mean of `paths`' weights; config and vocabulary of the
    first, no optimizer state. All must share the model config and the vocabulary."""
    if not paths:
        raise UserError("average: no checkpoints given")
    first: Optional[dict] = None
    newest_run: Optional[dict] = None  # the training progress of the last input, for the record
    sums: dict[str, torch.Tensor] = {}
    for path in paths:
        state = load_checkpoint(path)
        if not all(k in state for k in ("config", "vocab", "model")):
            raise UserError(f"average: {path} lacks its config, vocabulary or weights")
        newest_run = state.get("run")
        if first is None:
            first, first_path = state, path
            sums = {k: v.to(torch.float64) for k, v in state["model"].items()}
            continue
        if state["config"].get("model") != first["config"].get("model"):
            differ = sorted(k for k in set(state["config"].get("model", {})) | set(first["config"].get("model", {}))
                            if state["config"]["model"].get(k) != first["config"]["model"].get(k))
            raise UserError(f"average: {path} and {first_path} have different model configs "
                            f"(differing: {', '.join(differ) or 'section'})")
        if state["vocab"] != first["vocab"]:
            raise UserError(f"average: {path} and {first_path} use different vocabularies")
        weights = state["model"]
        if weights.keys() != sums.keys() or any(weights[k].shape != sums[k].shape for k in sums):
            raise UserError(f"average: {path} and {first_path} hold differently shaped weights")
        for k, v in weights.items():
            sums[k] += v.to(torch.float64)
    assert first is not None
    # Accumulated in float64 so averaging many checkpoints loses nothing; stored in each tensor's own dtype.
    averaged = {k: (sums[k] / len(paths)).to(v.dtype) for k, v in first["model"].items()}
    out = {"config": first["config"], "vocab": first["vocab"], "model": averaged,
           "averaged_from": [str(p) for p in paths]}
    if newest_run is not None:
        out["averaged_at_step"] = newest_run["step"]
    return out


def average(inputs: Sequence[str | Path], last: Optional[int], output: Optional[str | Path]) -> tuple[Path, list[Path]]:
    """The `average` command: RUN_DIR --last N (default output RUN_DIR/averaged.pt) or files --output FILE."""
    if last is not None:
        if len(inputs) != 1 or not Path(inputs[0]).is_dir():
            raise UserError("average: --last N takes exactly one run directory")
        paths = last_step_checkpoints(inputs[0], last)
        target = Path(output) if output else Path(inputs[0]) / "averaged.pt"
    else:
        if any(Path(p).is_dir() for p in inputs):
            raise UserError("average: for a run directory, say how many step checkpoints with --last N")
        if output is None:
            raise UserError("average: give --output FILE when averaging checkpoint files")
        paths, target = [Path(p) for p in inputs], Path(output)
    # Never over an input or a training checkpoint (an earlier average's output may be replaced).
    check_output_path(target, paths, command="average", may_replace_weights=True)
    save_checkpoint(average_checkpoints(paths), target)
    return target, paths
