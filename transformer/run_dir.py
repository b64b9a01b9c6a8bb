"""A training run's directory: the name of every file and folder in it, which of them a run directory means to the
commands that read a model, and which files belong to a run (so that no other command writes over them)."""

from __future__ import annotations

import re
from pathlib import Path


class RunDir:
    """The files of the run in `path`; the names are the class's, the paths the instance's."""

    CONFIG = "config.yaml"  # the effective config (file + --set), written by train
    VOCAB = "spm.model"  # the SentencePiece model (from `prepare` on)
    # An imported Marian vocabulary's files, verbatim, in place of spm.model (import hf, and runs started from one)
    MARIAN_VOCAB = ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json")
    IMPORT = "transformer-import.json"  # `import hf`'s record: where the model came from, and the files it wrote
    STORE = "store"  # the prepared, encoded corpus (data/store.py owns what lies inside)
    METRICS = "metrics.jsonl"  # one JSON record per log line and validation
    LOG = "train.log"
    LOCK = "train.lock"  # held by the process training there (training/lock.py)
    LAST = "last.pt"  # the latest resumable checkpoint
    BEST = "best.pt"  # the best validation so far, resumable too
    FINAL = "final.pt"  # what the end of training chose, with its tuned search settings
    AVERAGED = "averaged.pt"  # the end of training's (or `average`'s) average of the last step checkpoints
    SUMMARY = "summary.json"  # the end of training's record
    EVAL = "eval"  # test translations and `evaluate`'s results
    TENSORBOARD = "tensorboard"
    CT2 = "ct2"  # CTranslate2 conversions, one folder per checkpoint
    SHORTLIST = "shortlist.txt"  # `transformer shortlist`'s lists, which --shortlist reads (inference/shortlist.py)
    STEP = re.compile(r"step_(\d+)\.pt")  # step_XXXXXXXX.pt, kept when train.keep_last > 0
    FINAL_HYP = re.compile(r".+\.final\.hyp")  # eval/SPLIT.final.hyp, the end of training's test translations

    # What a training run writes in its directory (besides step_XXXXXXXX.pt and eval/): no other command may write
    # over these, and a new run refuses a directory that holds anything else.
    FILES = (
        CONFIG,
        VOCAB,
        *MARIAN_VOCAB,
        IMPORT,
        METRICS,
        LOG,
        LOCK,
        LAST,
        BEST,
        STORE,
        FINAL,
        SUMMARY,
        TENSORBOARD,
        CT2,
    )
    # Inside a run directory, also run files: whatever lies under the directories that training fills, and the test
    # translations that the end of training writes to eval/ (evaluate's own eval/ results, by settings, may go).
    SUBDIRS = (STORE, TENSORBOARD, CT2)
    # A run directory holds one of these from its first step on (spm.model or source.spm from `prepare`, the record
    # from `import hf`). An export's spm.model or source.spm makes its directory look like a run too: that errs on
    # the side of refusing.
    MARKERS = (LAST, VOCAB, MARIAN_VOCAB[0], IMPORT, LOCK)
    # What a run directory means to translate, evaluate, attention and serve: the model the end of training chose
    # (with its tuned search settings), else the best validation checkpoint, else the latest.
    CHECKPOINTS = (FINAL, BEST, LAST)

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    config = property(lambda self: self.path / self.CONFIG)
    vocab = property(lambda self: self.path / self.VOCAB)
    store = property(lambda self: self.path / self.STORE)
    metrics = property(lambda self: self.path / self.METRICS)
    log = property(lambda self: self.path / self.LOG)
    lock = property(lambda self: self.path / self.LOCK)
    last = property(lambda self: self.path / self.LAST)
    best = property(lambda self: self.path / self.BEST)
    final = property(lambda self: self.path / self.FINAL)
    averaged = property(lambda self: self.path / self.AVERAGED)
    summary = property(lambda self: self.path / self.SUMMARY)
    eval = property(lambda self: self.path / self.EVAL)
    tensorboard = property(lambda self: self.path / self.TENSORBOARD)

    def step(self, step: int) -> Path:
        return self.path / f"step_{step:08d}.pt"

    def final_hyp(self, split: str) -> Path:
        return self.path / self.EVAL / f"{split}.final.hyp"

    def step_checkpoints(self) -> list[Path]:
        """Every step_XXXXXXXX.pt, oldest first (by step: names outgrow 8 digits)."""
        found = sorted((int(m.group(1)), p) for p in self.path.glob("step_*.pt") if (m := self.STEP.fullmatch(p.name)))
        return [p for _, p in found]

    def newest_resumable(self) -> Path | None:
        """The checkpoint with training state to continue from when last.pt is gone or torn: the newer of the
        newest step checkpoint and best.pt (both written with the optimizer and RNG state, before last.pt)."""
        candidates = self.step_checkpoints()[-1:] + [p for p in [self.best] if p.is_file()]
        return max(candidates, key=lambda p: p.stat().st_mtime_ns, default=None)

    @classmethod
    def is_run_file(cls, name: str) -> bool:
        return name in cls.FILES or bool(cls.STEP.fullmatch(name))

    @classmethod
    def is_checkpoint(cls, name: str) -> bool:
        """A checkpoint's name in a run directory, besides last.pt."""
        return name in (cls.BEST, cls.FINAL, cls.AVERAGED) or bool(cls.STEP.fullmatch(name))

    @classmethod
    def owning(cls, path: str | Path) -> Path | None:
        """The training run directory that `path` is one of the files of (is_run_file, SUBDIRS, FINAL_HYP), if any."""
        path = Path(path).resolve()
        candidates = [d.parent for d in path.parents if d.name in cls.SUBDIRS]
        if cls.is_run_file(path.name):
            candidates.append(path.parent)
        if path.parent.name == cls.EVAL and cls.FINAL_HYP.fullmatch(path.name):
            candidates.append(path.parent.parent)
        return next((c for c in candidates if any((c / name).exists() for name in cls.MARKERS)), None)
