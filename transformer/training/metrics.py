"""What a run writes as it goes: train.log and the console (above the progress bar), metrics.jsonl (the source of
truth), and optionally TensorBoard."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

from transformer.distributed import DistInfo
from transformer.errors import UserError
from transformer.inference.scoring import NAMES
from transformer.model.transformer import training_flops
from transformer.peak import Peak
from transformer.run_dir import RunDir

log = logging.getLogger("transformer")

PROGRESS_SECONDS = 30.0  # a training line at least this often, so a job without a terminal always shows life
FIRST_LINE_AFTER = 5  # ... and one after the first few updates


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


def setup_logging(run_dir: Path | None, info: DistInfo) -> None:
    log.setLevel(logging.INFO if info.is_main else logging.WARNING)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    prefix = f"[rank {info.rank}] " if info.enabled else ""
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.addHandler(console)
    if run_dir is not None and info.is_main:
        file_handler = _LogFile(RunDir(run_dir).log, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file_handler)
    log.propagate = False


def _tensorboard_writer(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(
            "train.tensorboard needs the tensorboard package: pip install 'transformer[tensorboard]' "
            "(or pip install tensorboard), or set train.tensorboard: false"
        ) from None
    return SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard))


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl (rank 0 only), each stamped with the training
    wall time so far (`elapsed`, seconds, across resumes); train and valid numbers also go to TensorBoard."""

    SCALARS = ("loss", "nll", "ppl", *NAMES, "lr", "tokens_per_s", "grad_norm", "mfu", "data_wait")

    def __init__(self, run_dir: Path, enabled: bool, elapsed_before: float, started: float, tensorboard: bool = False):
        """elapsed_before: training time of earlier runs of this training; started: this run's start
        (time.perf_counter), so that the time to quality counts the set-up too."""
        self.path = RunDir(run_dir).metrics
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


class Progress:
    """Training lines: every train.log_every updates, after the first few, and at least every 30 seconds. Each
    goes to metrics.jsonl and train.log, and to the console when no progress bar shows it. MFU is against `peak`
    (peak.Peak), never above 100 %: a rate above the peak changes the peak first, and the log says so."""

    def __init__(
        self,
        metrics: MetricsLog,
        bar: tqdm,
        prefetch,
        model,
        log_every: int,
        max_steps: int,
        first_step: int,
        peak: Peak,
    ):
        self.metrics, self.bar, self.prefetch, self.model = metrics, bar, prefetch, model
        self.log_every, self.max_steps, self.first_step, self.peak = log_every, max_steps, first_step, peak
        self._reset()

    def _reset(self) -> None:
        self.loss = self.flops = 0.0
        self.tgt_tokens = self.src_tokens = 0
        self.since, self.wait_before = time.perf_counter(), self.prefetch.wait_seconds

    def add(self, update, loss: float) -> None:
        """Count a successful update (data.Update) whose summed loss over all ranks was `loss`."""
        self.loss += loss
        self.tgt_tokens += update.n_tgt_tokens
        self.src_tokens += update.n_src_tokens
        # MFU counts this rank's share: its own batches' real tokens and padded shapes.
        shapes = [(b.src.size(0), b.src.size(1), b.tgt_in.size(1)) for b in update.batches]
        self.flops += training_flops(
            self.model.cfg,
            self.model.vocab_size,
            sum(b.n_src_tokens for b in update.batches),
            sum(b.n_tgt_tokens for b in update.batches),
            shapes,
        )
        self.bar.update(1)

    def due(self, step: int) -> bool:
        return (
            step % self.log_every == 0
            or step == self.max_steps
            or step == self.first_step + FIRST_LINE_AFTER
            or time.perf_counter() - self.since >= PROGRESS_SECONDS
        )

    def write(self, step: int, epoch: int, lr: float, grad_norm: float) -> None:
        seconds = time.perf_counter() - self.since
        mfu, changed = self.peak.utilisation(self.flops / seconds / 1e12)
        if changed:
            log.warning("step %d: %s", step, changed)
        entry = {
            "step": step,
            "split": "train",
            "loss": self.loss / max(self.tgt_tokens, 1),
            "lr": lr,
            "tgt_tokens_per_s": self.tgt_tokens / seconds,
            "tokens_per_s": (self.tgt_tokens + self.src_tokens) / seconds,
            "epoch": epoch,
            "grad_norm": grad_norm,
            "mfu": mfu,
            "peak_tflops": self.peak.tflops,
            "data_wait": (self.prefetch.wait_seconds - self.wait_before) / seconds,
        }
        self.metrics.record(entry)
        log.info(
            "step %d: loss %.4f, lr %.3g, %.0f tokens/s, MFU %.1f%%, grad norm %.3g, epoch %d, waiting for data %.1f%%",
            step,
            entry["loss"],
            lr,
            entry["tokens_per_s"],
            100 * entry["mfu"],
            grad_norm,
            epoch,
            100 * entry["data_wait"],
            extra={"console": bool(self.bar.disable)},
        )
        self.bar.set_postfix(
            loss=f"{entry['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{entry['tokens_per_s']:.0f}", epoch=epoch
        )
        self._reset()


def read_metrics(path: str | Path) -> list[dict]:
    """metrics.jsonl as a list of dicts; a run directory means its metrics.jsonl.

    A line that does not parse is skipped: the last one may be half-written by a running job.
    """
    path = Path(path)
    if path.is_dir():
        path = RunDir(path).metrics
    if not path.is_file():
        raise UserError(f"no metrics file at {path} (a run directory from `transformer train` has one)")
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no metrics yet")
    return rows
