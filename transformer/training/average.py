"""Checkpoint averaging: the float mean of several checkpoints' weights, saved as a checkpoint that translate and evaluate load."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from transformer.config import ModelConfig, from_dict
from transformer.errors import UserError
from transformer.files import check_output_path
from transformer.model.checkpoint import WEIGHT_KEYS, load_checkpoint, save_checkpoint, weights_checkpoint
from transformer.run_dir import RunDir


def last_step_checkpoints(run_dir: str | Path, n: int) -> list[Path]:
    """The n latest step_XXXXXXXX.pt files of a run directory, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"average: no such run directory: {run_dir}")
    if n < 1:
        raise UserError("average: --last must be at least 1")
    found = RunDir(run_dir).step_checkpoints()
    if len(found) < n:
        raise UserError(
            f"average: asked for the last {n} checkpoints but {run_dir} holds {len(found)} step_*.pt "
            "(the trainer keeps train.keep_last of them)"
        )
    return found[-n:]


def average_checkpoints(paths: Sequence[str | Path], refuse_copies: bool = False) -> dict:
    """A weights-only checkpoint whose weights are the mean of `paths`' weights; config and vocabulary of the
    first. All must share the model config and the vocabulary. refuse_copies: two inputs with the same weights are
    an error (what the user named; the end of training averages whatever its step checkpoints hold)."""
    if not paths:
        raise UserError("average: no checkpoints given")
    first = newest = load_checkpoint(paths[0])
    if not all(k in first for k in WEIGHT_KEYS):
        raise UserError(f"average: {paths[0]} lacks its config, vocabulary or weights")
    sums = {k: v.to(torch.float64) for k, v in first["model"].items()}
    # last.pt and the step checkpoint of its step, or a copy: the same weights twice would count double.
    fingerprints = {_fingerprint(first["model"]): paths[0]} if refuse_copies else {}
    for path in paths[1:]:
        newest = load_checkpoint(path)
        _check_same_model(newest, path, first, paths[0])
        if refuse_copies:
            same = fingerprints.setdefault(_fingerprint(newest["model"]), path)
            if same != path:
                raise UserError(
                    f"average: {same} and {path} hold the same weights (e.g. last.pt and the step "
                    "checkpoint of its step); each checkpoint counts once in the mean"
                )
        for k, v in newest["model"].items():
            sums[k] += v.to(torch.float64)
    # Accumulated in float64 so averaging many checkpoints loses nothing; stored in each tensor's own dtype.
    averaged = {k: (sums[k] / len(paths)).to(v.dtype) for k, v in first["model"].items()}
    about = {"averaged_from": [str(p) for p in paths]}
    if "run" in newest:  # progress of the newest input, for the record
        about["averaged_at_step"] = newest["run"]["step"]
    return weights_checkpoint(first["config"], first["vocab"], averaged, **about)


def _fingerprint(weights: dict) -> tuple:
    """Equal for equal weights, and in practice only for them: each tensor's sum and its first values."""
    return tuple((k, float(v.double().sum()), tuple(v.flatten()[:4].tolist())) for k, v in sorted(weights.items()))


def _model_settings(state: dict, path) -> ModelConfig:
    """The model settings a checkpoint means: its stored config with today's defaults for the keys an older
    revision did not write (a run resumed across revisions holds both kinds of step checkpoint)."""
    try:
        return from_dict(state["config"]).model
    except UserError as e:
        raise UserError(f"average: {path}: {e}") from None


def _check_same_model(state: dict, path, first: dict, first_path) -> None:
    if not all(k in state for k in WEIGHT_KEYS):
        raise UserError(f"average: {path} lacks its config, vocabulary or weights")
    mine, theirs = _model_settings(state, path), _model_settings(first, first_path)
    if mine != theirs:
        differ = [f.name for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]
        raise UserError(
            f"average: {path} and {first_path} have different model configs (differing: {', '.join(differ)})"
        )
    if state["vocab"] != first["vocab"]:
        raise UserError(f"average: {path} and {first_path} use different vocabularies")
    weights, reference = state["model"], first["model"]
    if weights.keys() != reference.keys() or any(weights[k].shape != reference[k].shape for k in reference):
        raise UserError(f"average: {path} and {first_path} hold differently shaped weights")


def _check_distinct(paths: Sequence[Path]) -> None:
    """The same file named twice (an overlapping glob, a symlink, a hard link) would count double in the mean:
    refused before anything loads. Copies are caught by their weights (average_checkpoints)."""
    seen: dict[tuple, Path] = {}
    for path in paths:
        try:
            stat = path.stat()
            key: tuple = (stat.st_dev, stat.st_ino)
        except OSError:  # missing: load_checkpoint names it
            key = (path,)
        if key in seen:
            same = "twice" if seen[key] == path else f"twice ({seen[key]} and {path} are the same file)"
            raise UserError(f"average: {path} is named {same}; each checkpoint counts once in the mean")
        seen[key] = path


def average(inputs: Sequence[str | Path], last: int | None, output: str | Path | None) -> tuple[Path, list[Path]]:
    """The `average` command: RUN_DIR --last N (default output RUN_DIR/averaged.pt) or files --output FILE."""
    if last is not None:
        if len(inputs) != 1 or not Path(inputs[0]).is_dir():
            raise UserError("average: --last N takes exactly one run directory")
        paths = last_step_checkpoints(inputs[0], last)
        target = Path(output) if output else RunDir(inputs[0]).averaged
    else:
        if any(Path(p).is_dir() for p in inputs):
            raise UserError("average: for a run directory, say how many step checkpoints with --last N")
        if output is None:
            raise UserError("average: give --output FILE when averaging checkpoint files")
        paths, target = [Path(p) for p in inputs], Path(output)
        _check_distinct(paths)
    # Never over an input or a training checkpoint (an earlier average's output may be replaced).
    check_output_path(target, paths, command="average", may_replace_weights=True)
    save_checkpoint(average_checkpoints(paths, refuse_copies=True), target)
    return target, paths
