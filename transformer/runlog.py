"""What a run writes as it goes: train.log and the console (above the progress bar), metrics.jsonl (the source of
truth), and optionally TensorBoard."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from transformer.distributed import DistInfo
from transformer.errors import UserError

log = logging.getLogger("transformer")


class _TqdmHandler(logging.StreamHandler):
    """Console logging that prints above the progress bar instead of through it; records logged with
    extra={"console": False} (what the bar already shows) go to train.log only."""

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, "console", True):
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _LogFile(logging.FileHandler):
    """train.log; a write that fails (a full disk) stops the run with the file named, not a traceback per line."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, self.baseFilename) from None
        super().handleError(record)


def setup_logging(run_dir: Optional[Path], info: DistInfo) -> None:
    log.setLevel(logging.INFO if info.is_main else logging.WARNING)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    prefix = f"[rank {info.rank}] " if info.enabled else ""
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.addHandler(console)
    if run_dir is not None and info.is_main:
        file_handler = _LogFile(run_dir / "train.log", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file_handler)
    log.propagate = False


def _tensorboard_writer(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("train.tensorboard needs the tensorboard package: pip install 'transformer[tensorboard]' "
                        "(or pip install tensorboard), or set train.tensorboard: false") from None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl (rank 0 only), each stamped with the training
    wall time so far (`elapsed`, seconds, across resumes); train and valid numbers also go to TensorBoard."""

    SCALARS = ("loss", "nll", "ppl", "bleu", "lr", "tokens_per_s", "grad_norm", "mfu", "data_wait")

    def __init__(self, run_dir: Path, enabled: bool, elapsed_before: float, started: float, tensorboard: bool = False):
        """elapsed_before: training time of earlier runs of this training; started: this run's start
        (time.perf_counter), so that the time to quality counts the set-up too."""
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a", encoding="utf-8") if enabled else None
        self.tensorboard = _tensorboard_writer(run_dir) if enabled and tensorboard else None
        self.elapsed_before, self.started = elapsed_before, started

    def elapsed(self) -> float:
        """Training wall time so far: earlier runs of this training (from the checkpoint) plus this one."""
        return self.elapsed_before + time.perf_counter() - self.started

    def record(self, entry: dict) -> None:
        if self.file is None:
            return
        entry = {**entry, "elapsed": round(self.elapsed(), 3)}
        try:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: name the file
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if self.tensorboard is not None and "split" in entry:
            for key in self.SCALARS:
                if isinstance(entry.get(key), (int, float)):
                    self.tensorboard.add_scalar(f"{entry['split']}/{key}", entry[key], entry["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
