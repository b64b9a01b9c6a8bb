"""Shared helpers for the training tests: a tiny synthetic corpus and a tiny YAML config."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("der die das ein eine mann frau kind hund katze haus auf dem im spielt läuft sitzt "
         "the a man woman child dog cat house on in plays runs sits red blue green big small").split()


def shared_data_dir() -> Path:
    """The real corpora: $TRANSFORMER_DATA (set by the Makefile) or ../shared/data beside the repo."""
    return Path(os.environ.get("TRANSFORMER_DATA", ROOT.parent / "shared" / "data"))


def write_corpus(directory: Path, n_train: int = 200, n_valid: int = 20, seed: int = 0) -> Path:
    """A reversal task over a small vocabulary: target = source words reversed."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("valid", n_valid)):
        src = [[rng.choice(WORDS) for _ in range(rng.randint(2, 8))] for _ in range(n)]
        (directory / f"{split}.de").write_text("".join(" ".join(s) + "\n" for s in src), encoding="utf-8")
        (directory / f"{split}.en").write_text("".join(" ".join(reversed(s)) + "\n" for s in src),
                                               encoding="utf-8")
    return directory


def tiny_config(tmp_path: Path, run: str = "run", data_dir: Path | None = None, **sections) -> dict:
    """A model of a few thousand parameters that trains in seconds; sections override key by key."""
    cfg = {
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64,
                  "dropout": 0.1, "max_positions": 64},
        "data": {"dir": str(data_dir or write_corpus(tmp_path / "corpus")), "vocab_size": 64, "max_len": 20,
                 "max_tokens": 200},
        "train": {"run_dir": str(tmp_path / run), "max_steps": 12, "lr_schedule": "noam", "lr": 2.0,
                  "warmup_steps": 10, "log_every": 1, "valid_every": 4, "seed": 3,
                  "finish": False},  # the end-of-training summary has tests of its own
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `python -m transformer ...` in a subprocess, single-threaded so parallel runs don't fight."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "transformer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, **kwargs)
