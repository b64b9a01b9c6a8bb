"""What training logs (training/metrics.py): progress lines without a terminal, MFU against the configured peak,
TensorBoard's scalars, and metrics.jsonl read back."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers import read_metrics, tiny_config
from transformer.config import from_dict
from transformer.errors import UserError
from transformer.inference.scoring import NAMES
from transformer.training import metrics
from transformer.training.loop import train


def test_without_a_terminal_progress_shows_early_and_at_least_every_30_seconds(tmp_path, capsys, monkeypatch):
    raw = tiny_config(tmp_path, train={"max_steps": 9, "log_every": 1000, "valid_every": 1000})
    train(from_dict(raw), quiet=True)  # quiet: no bar, as without a terminal
    steps = [
        int(line.split()[1].rstrip(":"))
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("step ") and ": loss" in line
    ]
    assert steps == [5, 9]  # after the first few updates, and the last
    monkeypatch.setattr(metrics, "PROGRESS_SECONDS", 0.0)  # every update is "30 seconds later"
    raw = tiny_config(tmp_path, "timed", train={"max_steps": 4, "log_every": 1000, "valid_every": 1000})
    train(from_dict(raw), quiet=True)
    steps = [
        int(line.split()[1].rstrip(":"))
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("step ") and ": loss" in line
    ]
    assert steps == [1, 2, 3, 4]


def test_training_lines_carry_mfu_against_the_configured_peak(tmp_path):
    raw = tiny_config(tmp_path, train={"max_steps": 6, "peak_tflops": 1e-6, "log_every": 1})
    run_dir = train(from_dict(raw), quiet=True)
    lines = [m for m in read_metrics(run_dir) if m.get("split") == "train"]
    # 1 MFLOP/s of peak: a real update does far more. No MFU above 100 % is ever logged: the peak is raised to
    # the rate training reached, and the log says so and which peak it uses from there.
    assert len(lines) == 6 and all(0.0 < m["mfu"] <= 1.0 for m in lines)
    assert lines[0]["mfu"] == 1.0 and all(m["peak_tflops"] > 1e-6 for m in lines)
    assert all(0.0 <= m["data_wait"] < 1.0 and m["elapsed"] > 0 for m in lines)
    log = (run_dir / "train.log").read_text()
    assert "MFU below is against 1e-06 TFLOP/s (train.peak_tflops)" in log
    assert "above the peak of 1e-06: MFU from here is against" in log and "raised to the rate training reached" in log


def test_tensorboard_gets_the_scalars_or_a_one_line_error(tmp_path, monkeypatch):
    raw = tiny_config(tmp_path, train={"max_steps": 4, "tensorboard": True})
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(UserError, match=r"pip install 'transformer\[tensorboard\]'"):
            train(from_dict(raw), quiet=True)
        return
    run_dir = train(from_dict(raw), quiet=True)
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(run_dir / "tensorboard")).Reload().Tags()["scalars"]
    assert {"train/loss", "train/mfu", "valid/loss", "valid/ppl"} <= set(scalars)


def test_metrics_rows_without_a_numeric_step_are_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"split": "valid", "loss": 1}\n{"step": "x"}\n[1, 2]\n{"step": 5, "loss": 2}\n', encoding="utf-8")
    assert metrics.read_metrics(path) == [{"step": 5, "loss": 2}]
    path.write_text('{"split": "valid", "loss": 1}\n', encoding="utf-8")
    with pytest.raises(UserError, match="holds no metrics yet"):
        metrics.read_metrics(path)


def test_tensorboard_gets_every_score_a_validation_logged(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = metrics.MetricsLog(tmp_path, True, 0.0, 0.0, tensorboard=True)
    log.record({"step": 2, "split": "valid", "loss": 1.0, **{name: 10.0 for name in NAMES}})
    log.close()
    scalars = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]
    assert {f"valid/{name}" for name in NAMES} <= set(scalars)
