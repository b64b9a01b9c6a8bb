"""Nothing lost: SIGKILL at a random step resumes bit-identically; SIGTERM saves; torn writes never win."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch

from tests.trainutil import ROOT, cli, read_metrics, tiny_config, write_config, write_corpus
from transformer.checkpoint import load_checkpoint


def _start_training(config, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "transformer", "train", str(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _wait_for_step(proc, run_dir, step, timeout=120):
    """Block until the run's metrics log shows `step` finished (log_every=1)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training ended early: {proc.communicate()[1][-2000:]}")
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(m.get("step", 0) >= step for m in _metrics_so_far(path)):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def _metrics_so_far(path):
    import json
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written right now
            pass
    return out


def _assert_identical(a_path, b_path):
    a, b = load_checkpoint(a_path), load_checkpoint(b_path)
    assert a["run"]["step"] == b["run"]["step"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"{key} differs"
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path):
    corpus = write_corpus(tmp_path / "c")
    # Dropout on, several epochs (the epoch boundary is inside the run), checkpoints every 3 updates.
    common = {"train": {"max_steps": 16, "valid_every": 3}, "data": {"max_tokens": 120}}
    straight = write_config(tmp_path / "straight.yaml", tiny_config(tmp_path, "straight", corpus, **common))
    killed = write_config(tmp_path / "killed.yaml", tiny_config(tmp_path, "killed", corpus, **common))

    reference = cli("train", str(straight))
    assert reference.returncode == 0, reference.stderr

    kill_after = random.Random().randint(1, 14)  # random on purpose: any step must be safe, even before the first save
    proc = _start_training(killed)
    _wait_for_step(proc, tmp_path / "killed", kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    resumed = cli("train", str(killed), "--resume")
    assert resumed.returncode == 0, f"killed after step {kill_after}: {resumed.stderr}"
    _assert_identical(tmp_path / "straight" / "last.pt", tmp_path / "killed" / "last.pt")
    assert (tmp_path / "straight" / "best.pt").read_bytes() and (tmp_path / "killed" / "best.pt").exists()


def test_sigterm_saves_last_and_tells_how_to_resume(tmp_path):
    raw = tiny_config(tmp_path, train={"max_steps": 100000, "valid_every": 100000})
    config = write_config(tmp_path / "c.yaml", raw)
    proc = _start_training(config)
    _wait_for_step(proc, tmp_path / "run", 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert f"continue with: transformer train {config} --resume" in stderr
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    logged = max(m["step"] for m in read_metrics(tmp_path / "run") if m.get("split") == "train")
    assert state["run"]["step"] == logged >= 3  # saved where it stopped, not at an old validation


def test_kill_during_checkpoint_write_leaves_previous_checkpoint_loadable(tmp_path):
    """A child rewrites a large checkpoint in a loop; SIGKILL it mid-write several times."""
    target = tmp_path / "last.pt"
    script = f"""
import torch, itertools
from transformer.checkpoint import save_checkpoint
for i in itertools.count():
    save_checkpoint({{"run": {{"step": i}}, "model": {{"w": torch.full((4_000_000,), float(i))}}}}, {str(target)!r})
    print(i, flush=True)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    last_seen = -1
    rng = random.Random()
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
        proc.stdout.readline()  # at least one complete write
        time.sleep(rng.uniform(0.0, 0.3))  # then die somewhere inside a later write
        proc.kill()
        proc.wait()
        state = load_checkpoint(target)
        step = state["run"]["step"]
        # The file is one whole write: its tensor is complete and agrees with its own step.
        assert state["model"]["w"].numel() == 4_000_000
        assert torch.equal(state["model"]["w"], torch.full((4_000_000,), float(step)))
        last_seen = max(last_seen, step)
    assert last_seen >= 0
    # Stale temporary files may remain from the kills; the trainer removes them at start.
    leftovers = list(tmp_path.glob(".last.pt.*.tmp"))
    assert all(p.name.endswith(".tmp") for p in leftovers)


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    from transformer.checkpoint import save_checkpoint
    from transformer.errors import UserError
    import pytest

    good = tmp_path / "good.pt"
    save_checkpoint({"run": {"step": 1}, "model": {"w": torch.zeros(100_000)}}, good)
    data = good.read_bytes()
    cases = {
        "truncated.pt": data[: len(data) // 2],
        "text.pt": b"hello\n",
        "empty.pt": b"",
        "zeros.pt": bytes(4096),
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=f"{name} is not a checkpoint, or is truncated or corrupt"):
            load_checkpoint(tmp_path / name)
    torch.save({"model": {}}, tmp_path / "foreign.pt")  # a valid torch file, not ours
    with pytest.raises(UserError, match="not a checkpoint written by this package"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(UserError, match="no such file"):
        load_checkpoint(tmp_path / "missing.pt")
    assert load_checkpoint(good)["run"]["step"] == 1
