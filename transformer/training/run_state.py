"""What a run carries across a restart: counters, RNG states, the resumable checkpoint, the resume rules, the checks
on a new run's directory, and the run-directory lock."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shlex
import shutil
import socket
import stat
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Sequence

import torch

from transformer.files import TEMP_SUFFIX, atomic_write
from transformer.config import Config, apply_overrides, from_dict, read_yaml, to_dict, written_by_train
from transformer.errors import UserError
from transformer.run_dir import RunDir
from transformer.model.checkpoint import RESUMABLE_KEYS, load_checkpoint, weights_checkpoint
from transformer.training.optim import load_optimizer_state

try:
    import fcntl
except ImportError:  # not POSIX: the lock file's pid and host alone decide
    fcntl = None

log = logging.getLogger("transformer")

# Model and vocabulary cannot change under a resumed run; anything else in the config may.
FROZEN_ON_RESUME = ("model", "data.vocab_size", "data.spm_model_type", "data.src_lang", "data.tgt_lang")
# Changing these reshuffles the epoch's batches: a resumed run then restarts its current epoch.
DATA_ORDER = ("train.seed", "data.source", "data.dir", "data.hub_name", "data.hub_config", "data.train_split",
              "data.max_len", "data.max_tokens", "data.pad_to_multiple", "data.max_train_pairs")

def rng_state(device: Optional[torch.device] = None) -> dict:
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


def set_rng_state(state: dict, device: Optional[torch.device] = None) -> None:
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
    best: Optional[float] = None          # best validation score so far ...
    best_metric: str = "loss"             # ... of this metric: "loss" (lower is better) or "bleu"
    bad_validations: int = 0              # validations in a row without improvement (early stopping)
    last_validation: Optional[int] = None  # the step validated last: a finished run is not validated again
    elapsed: float = 0.0                  # wall-clock seconds of training so far, across restarts
    tokens: int = 0                       # source + target tokens trained on so far
    data: dict = field(default_factory=lambda: {"epoch": 0, "batches_done": 0})


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


@dataclass(frozen=True)
class ConfigChange:
    """One config value that differs between a checkpoint and the config it resumes under."""

    key: str        # section.key
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
                raise UserError(f"resume: {section}.{key} was {before!r} in the checkpoint and is {value!r} now; "
                                "the model and vocabulary cannot change under a resumed run")
            if f"{section}.{key}" == "train.weight_decay" and (before > 0) != (value > 0):
                raise UserError("resume: train.weight_decay cannot switch between 0 (Adam) and > 0 (AdamW) "
                                "under a resumed run")
            changes.append(ConfigChange(f"{section}.{key}", before, value))
    return changes


def resume_command(config_path: Optional[str], overrides: Sequence[str], run_dir: str) -> str:
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
        raise UserError(f"train --resume: {run_dir} holds no config.yaml, so it is not a run directory "
                        f"(start a run there with: transformer train CONFIG --set train.run_dir={run_dir})")
    if any(item.split("=", 1)[0].strip() == "train.run_dir" for item in overrides):
        raise UserError(f"train: --resume {run_dir} continues the run in {run_dir}; --set train.run_dir cannot "
                        "move it")
    saved = read_yaml(path)
    if not saved:  # defaults would then be compared against the checkpoint's config, and mislead
        raise UserError(f"train --resume: {path} is empty, so the run's settings are not known; restore it (transformer "
                        f"train writes it), or resume with the config the run was started with: transformer train "
                        f"CONFIG --set train.run_dir={run_dir} --resume")
    raw = apply_overrides(saved, list(overrides))
    if not isinstance(raw.get("train"), dict):
        raw["train"] = {}
    raw["train"]["run_dir"] = str(run_dir)
    return from_dict(raw)


def put_back(source: Path, run_dir: Path, saved: dict) -> None:
    """What the save that was killed had not written yet: last.pt, and best.pt when `source` was the best
    validation so far. From here on the run directory is as if that save had completed."""
    names = [RunDir.LAST] + ([RunDir.BEST] if not RunDir(run_dir).best.exists() and
                             saved["run"]["bad_validations"] == 0 else [])

    def copy(f) -> None:
        with source.open("rb") as checkpoint:
            shutil.copyfileobj(checkpoint, f, 1 << 24)

    for name in names:
        atomic_write(run_dir / name, copy)
    log.info("resume: %s copied to %s", source.name, " and ".join(names))


def continue_hint(run_dir: Path) -> str:
    """How to continue from another checkpoint of the run, for a message about its last.pt; empty if none."""
    other = RunDir(run_dir).newest_resumable()
    return "" if other is None else \
        f"; to continue from {other.name} instead: cp {shlex.quote(str(other))} {shlex.quote(str(RunDir(run_dir).last))}"


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
    checkpoints = sorted(p.name for p in run_dir.iterdir()
                         if RunDir.is_checkpoint(p.name))
    if checkpoints:
        shown = ", ".join(checkpoints[:3]) + (f" and {len(checkpoints) - 3} more" if len(checkpoints) > 3 else "")
        how = f"add --resume to continue from {other.name}; " if other is not None else ""
        raise UserError(f"train.run_dir {run_dir} holds checkpoints ({shown}) but no last.pt; {how}to start a new "
                        "run, set train.run_dir to a new directory")
    from transformer.data.store import is_ours  # numpy and the corpus readers: only where a run directory is checked

    foreign = sorted(p.name for p in run_dir.iterdir()
                     if not (RunDir.is_run_file(p.name) or p.name == RunDir.EVAL or p.name.endswith(TEMP_SUFFIX))
                     or (p.name == RunDir.CONFIG and not written_by_train(p))
                     or (p.name == RunDir.STORE and not is_ours(p)))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"train.run_dir {run_dir} holds files that are not a run's ({shown}); a new run needs a "
                        "new or empty directory: set train.run_dir")


def make_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"train.run_dir {run_dir}: cannot create it ({e.strerror})") from None


class RunLock:
    """run_dir/train.lock, held by the process that trains there (rank 0), holding its pid and host.

    On one machine an flock on the file is the exclusion (the kernel drops it when the process dies): a
    lock file nobody holds was left by a killed run and is taken over, with a log line, even when its pid
    now names another process (without flock, the pid alone decides). A lock written on another host is
    refused, since that process cannot be checked from here.
    """

    def __init__(self, run_dir: Path, command: str = "train"):
        self.run_dir, self.path, self.command = run_dir, RunDir(run_dir).lock, command  # command: for messages
        self.fd: Optional[int] = None
        self.took_over: Optional[str] = None  # a log line for the caller, once logging is set up

    def _refuse(self, holder: dict, why: str) -> None:
        raise UserError(f"{self.command}: {self.run_dir} is in use by pid {holder.get('pid', '?')} on host "
                        f"{holder.get('host', '?')} (lock file {self.path}); {why}")

    def _open(self) -> int:
        """The lock file, created (O_CREAT|O_EXCL) or opened as it is, never through a symbolic link (O_NOFOLLOW), and
        only a regular file with no other name: writing our pid into it may change nothing but a lock file."""
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:  # also a link, dangling or not: O_EXCL never follows one
                pass
            try:  # O_NONBLOCK: a FIFO placed there must not hang the open (it is refused below)
                fd = os.open(self.path, flags | getattr(os, "O_NONBLOCK", 0))
            except FileNotFoundError:  # its holder removed it in between: create it
                continue
            except IsADirectoryError:
                self._refuse_file("is not a regular file")
            except OSError as e:
                if e.errno != errno.ELOOP and not self.path.is_symlink():
                    raise
                raise UserError(f"{self.command}: {self.path} is a symbolic link; the lock file is never written "
                                "through one (that would overwrite what it points to): delete the link") from None
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                return fd
            os.close(fd)
            self._refuse_file("has other names (hard links)" if stat.S_ISREG(info.st_mode) else "is not a regular file")

    def _refuse_file(self, what: str) -> None:
        raise UserError(f"{self.command}: {self.path} {what}; the lock file is written over, so it must be a plain "
                        "file of its own: delete it")

    def __enter__(self) -> "RunLock":
        host, pid = socket.gethostname(), os.getpid()
        while True:
            fd = self._open()
            try:
                holder = _read_lock(fd)
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError as e:
                        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                            raise  # e.g. ENOLCK: a filesystem without locks
                        self._refuse(holder, "wait for that run to end, or stop it")
                    if not _same_file(fd, self.path):  # the holder removed it as we opened it: try again
                        os.close(fd)
                        continue
                    holder = _read_lock(fd)  # what it says now that we hold it
            except BaseException:
                os.close(fd)
                raise
            break
        try:
            if holder and holder.get("host") != host:
                self._refuse(holder, "if no run is going on there any more, delete the lock file")
            if holder and holder.get("pid") != pid:
                # Holding the flock already proves its writer gone: the pid may belong to another process now.
                if fcntl is None and _alive(holder.get("pid")):
                    self._refuse(holder, "wait for that run to end, or stop it")
                self.took_over = (f"lock: {self.path} was left by pid {holder.get('pid')} on {host}, which is "
                                  "gone; taking it over")
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": pid, "host": host}).encode() + b"\n", 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> bool:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # while still holding it, so nobody takes a lock that is going away
            os.close(self.fd)
            self.fd = None
        return False


def _read_lock(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace") or "{}")
    except ValueError:
        return {"pid": "?", "host": "?"}  # torn or foreign content: someone else's lock all the same
    return holder if isinstance(holder, dict) else {"pid": "?", "host": "?"}


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except FileNotFoundError:
        return False


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unreadable: assume the worst
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True
