"""What a run carries across a restart: counters, RNG states, the resumable checkpoint, the resume rules and the checks
on a new run's directory."""

from __future__ import annotations

import logging
import random
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from transformer.config import Config, apply_overrides, from_dict, read_yaml, to_dict, written_by_train
from transformer.errors import UserError
from transformer.files import TEMP_SUFFIX, atomic_write
from transformer.model.checkpoint import RESUMABLE_KEYS, load_checkpoint, weights_checkpoint
from transformer.run_dir import RunDir
from transformer.training.optim import load_optimizer_state

log = logging.getLogger("transformer")

# Model and vocabulary cannot change under a resumed run; anything else in the config may.
FROZEN_ON_RESUME = ("model", "data.vocab_size", "data.spm_model_type", "data.src_lang", "data.tgt_lang")
# Changing these reshuffles the epoch's batches: a resumed run then restarts its current epoch.
DATA_ORDER = (
    "train.seed",
    "data.source",
    "data.dir",
    "data.hub_name",
    "data.hub_config",
    "data.train_split",
    "data.max_len",
    "data.max_tokens",
    "data.pad_to_multiple",
    "data.max_train_pairs",
)


def rng_state(device: torch.device | None = None) -> dict:
    """The RNG streams a run continues with: Python's, torch's CPU one, NumPy's, and on CUDA the stream of the
    run's own GPU (`device`) alone. Not every visible GPU's, as torch.cuda.get_rng_state_all gives: restoring
    those with set_rng_state_all fails on a machine with fewer GPUs, and the others' streams are not the run's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)  # plain types: loadable weights_only
    except ImportError:
        pass
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Continue rng_state()'s streams; the CUDA one on the run's GPU `device`, when both sides have CUDA (a run
    saved on a CPU keeps its seeded CUDA stream, a run resumed on a CPU has none). Checkpoints written before
    hold every visible GPU's stream, by index: the one at the run's index is taken, else the first."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and device is not None and device.type == "cuda":
        if isinstance(cuda, (list, tuple)):  # an older checkpoint: torch.cuda.get_rng_state_all()
            index = device.index or 0
            cuda = cuda[index] if index < len(cuda) else cuda[0] if cuda else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


@dataclass
class RunState:
    """Counters that must survive a restart."""

    step: int = 0
    best: float | None = None  # best validation score so far ...
    best_metric: str = "loss"  # ... of this metric: "loss" (lower is better) or "bleu"
    bad_validations: int = 0  # validations in a row without improvement (early stopping)
    last_validation: int | None = None  # the step validated last: a finished run is not validated again
    elapsed: float = 0.0  # wall-clock seconds of training so far, across restarts
    tokens: int = 0  # source + target tokens trained on so far
    data: dict = field(default_factory=lambda: {"epoch": 0, "batches_done": 0})


def training_checkpoint(
    config: dict,
    vocab: bytes | dict,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    rngs: list,
    run: dict,
    train_order: str,
) -> dict:
    """Everything a run continues from (no learning-rate scheduler: the rate is a pure function of the step).
    train_order: Store.train_order, so that a resume can tell whether run["data"]'s position still applies."""
    return {
        **weights_checkpoint(config, vocab, model.state_dict()),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rngs,
        "run": run,
        "train_order": train_order,
    }


def restore_training(
    saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> None:
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
        raise UserError(
            f"resume: {path} cannot be resumed: it holds {what} (no {', '.join(missing)}); put the "
            "run's own last.pt back, or start a new run in another train.run_dir"
        )
    counters, saved = {f.name for f in fields(RunState)}, state["run"]
    if not isinstance(saved, dict) or set(saved) != counters:
        found = set(saved) if isinstance(saved, dict) else set()
        unknown, lacking = ", ".join(sorted(found - counters)) or "none", ", ".join(sorted(counters - found))
        raise UserError(
            f"resume: {path} cannot be resumed by this version of transformer: its run counters "
            f"differ (unknown: {unknown}; missing: {lacking or 'none'}); resume with the version that "
            "wrote it, or start a new run in another train.run_dir"
        )
    return state


@dataclass(frozen=True)
class ConfigChange:
    """One config value that differs between a checkpoint and the config it resumes under."""

    key: str  # section.key
    before: object
    after: object

    def __str__(self) -> str:
        return f"{self.key}: {self.before!r} -> {self.after!r}"

    @property
    def reorders_data(self) -> bool:
        return self.key in DATA_ORDER


def check_resume_config(saved: Config, new: Config) -> list[ConfigChange]:
    """Refuse changes to frozen values; return the changes that will apply."""
    old_d, new_d = to_dict(saved), to_dict(new)
    changes = []
    for section in new_d:
        for key, value in new_d[section].items():
            before = old_d[section][key]
            if before == value:
                continue
            if section in FROZEN_ON_RESUME or f"{section}.{key}" in FROZEN_ON_RESUME:
                raise UserError(
                    f"resume: {section}.{key} was {before!r} in the checkpoint and is {value!r} now; "
                    "the model and vocabulary cannot change under a resumed run"
                )
            if f"{section}.{key}" == "train.weight_decay" and (before > 0) != (value > 0):
                raise UserError(
                    "resume: train.weight_decay cannot switch between 0 (Adam) and > 0 (AdamW) under a resumed run"
                )
            changes.append(ConfigChange(f"{section}.{key}", before, value))
    return changes


def resume_command(config_path: str | None, overrides: Sequence[str], run_dir: str) -> str:
    """The command that continues this run, --set overrides included, quoted for a POSIX shell."""
    sets = [word for item in overrides for word in ("--set", item)]
    if config_path is None:
        return shlex.join(["transformer", "train", "--resume", run_dir, *sets])
    return shlex.join(["transformer", "train", config_path, *sets, "--resume"])


def run_config(run_dir: str, overrides: Sequence[str]) -> Config:
    """`train --resume RUN_DIR`: the run's own config.yaml plus --set overrides; train.run_dir is RUN_DIR
    itself (so a moved run directory still resumes)."""
    path = RunDir(run_dir).config
    if not Path(run_dir).is_dir():
        raise UserError(f"train --resume: no such run directory: {run_dir}")
    if not path.is_file():
        raise UserError(
            f"train --resume: {run_dir} holds no config.yaml, so it is not a run directory "
            f"(start a run there with: transformer train CONFIG --set train.run_dir={run_dir})"
        )
    if any(item.split("=", 1)[0].strip() == "train.run_dir" for item in overrides):
        raise UserError(f"train: --resume {run_dir} continues the run in {run_dir}; --set train.run_dir cannot move it")
    saved = read_yaml(path)
    if not saved:  # defaults would then be compared against the checkpoint's config, and mislead
        raise UserError(
            f"train --resume: {path} is empty, so the run's settings are not known; restore it (transformer "
            f"train writes it), or resume with the config the run was started with: transformer train "
            f"CONFIG --set train.run_dir={run_dir} --resume"
        )
    raw = apply_overrides(saved, list(overrides))
    if not isinstance(raw.get("train"), dict):
        raw["train"] = {}
    raw["train"]["run_dir"] = str(run_dir)
    return from_dict(raw)


def put_back(source: Path, run_dir: Path, saved: dict) -> None:
    """What the save that was killed had not written yet: last.pt, and best.pt when `source` was the best
    validation so far. From here on the run directory is as if that save had completed."""
    names = [RunDir.LAST] + (
        [RunDir.BEST] if not RunDir(run_dir).best.exists() and saved["run"]["bad_validations"] == 0 else []
    )

    def copy(f) -> None:
        with source.open("rb") as checkpoint:
            shutil.copyfileobj(checkpoint, f, 1 << 24)

    for name in names:
        atomic_write(run_dir / name, copy)
    log.info("resume: %s copied to %s", source.name, " and ".join(names))


def continue_hint(run_dir: Path) -> str:
    """How to continue from another checkpoint of the run, for a message about its last.pt; empty if none."""
    other = RunDir(run_dir).newest_resumable()
    return (
        ""
        if other is None
        else f"; to continue from {other.name} instead: cp {shlex.quote(str(other))} {shlex.quote(str(RunDir(run_dir).last))}"
    )


def check_run_dir(run_dir: Path, resume: bool = False) -> None:
    """A run directory is a directory; a new run (no last.pt) must not write into one holding other files, nor
    over the checkpoints of a run whose last.pt is gone (--resume continues from newest_resumable)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"train.run_dir {run_dir} is a file, not a directory")
    if not run_dir.is_dir() or RunDir(run_dir).last.exists():
        return
    other = RunDir(run_dir).newest_resumable()
    if resume and other is not None:
        return
    checkpoints = sorted(p.name for p in run_dir.iterdir() if RunDir.is_checkpoint(p.name))
    if checkpoints:
        shown = ", ".join(checkpoints[:3]) + (f" and {len(checkpoints) - 3} more" if len(checkpoints) > 3 else "")
        how = f"add --resume to continue from {other.name}; " if other is not None else ""
        raise UserError(
            f"train.run_dir {run_dir} holds checkpoints ({shown}) but no last.pt; {how}to start a new "
            "run, set train.run_dir to a new directory"
        )
    from transformer.data.store import is_ours  # numpy and the corpus readers: only where a run directory is checked

    foreign = sorted(
        p.name
        for p in run_dir.iterdir()
        if not (RunDir.is_run_file(p.name) or p.name == RunDir.EVAL or p.name.endswith(TEMP_SUFFIX))
        or (p.name == RunDir.CONFIG and not written_by_train(p))
        or (p.name == RunDir.STORE and not is_ours(p))
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(
            f"train.run_dir {run_dir} holds files that are not a run's ({shown}); a new run needs a "
            "new or empty directory: set train.run_dir"
        )


def make_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"train.run_dir {run_dir}: cannot create it ({e.strerror})") from None
