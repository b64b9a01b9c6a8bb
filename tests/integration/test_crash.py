"""Nothing lost: SIGKILL at a random step resumes bit-identically; SIGTERM saves; torn writes never win."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import (
    ROOT,
    assert_same_training_state,
    change_training_loss,
    read_metrics,
    small_vocab,
    subprocess_env,
    tiny_config,
    write_config,
    write_corpus,
)
from transformer.files import remove_stale_temporaries
from transformer.model.checkpoint import load_checkpoint

_children: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_training_left_behind():
    """A test that fails midway leaves no training behind (some are set to run 100,000 steps): each process this
    module started that still runs at the end of its test is killed."""
    yield
    while _children:
        proc = _children.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _start_training(config, *extra):
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer", "train", str(config), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
    )
    _children.append(proc)
    return proc


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


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path, random_seed, call):
    corpus = write_corpus(tmp_path / "c")
    # Dropout on, several epochs (the epoch boundary is inside the run), checkpoints every 3 updates.
    common = {"train": {"max_steps": 16, "valid_every": 3}, "data": {"max_tokens": 120}}
    straight = write_config(tmp_path / "straight.yaml", tiny_config(tmp_path, "straight", corpus, **common))
    killed = write_config(tmp_path / "killed.yaml", tiny_config(tmp_path, "killed", corpus, **common))

    status, _, err = call("train", straight)  # the reference and the resumption in this process, the kill in a child
    assert status == 0, err

    # Random on purpose: any step must be safe, even before the first save.
    kill_after = random.Random(random_seed).randint(1, 14)
    proc = _start_training(killed)
    _wait_for_step(proc, tmp_path / "killed", kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    status, _, err = call("train", killed, "--resume")
    assert status == 0, f"seed {random_seed}: killed after step {kill_after}: {err}"
    assert_same_training_state(tmp_path / "straight" / "last.pt", tmp_path / "killed" / "last.pt")
    assert (tmp_path / "straight" / "best.pt").read_bytes() and (tmp_path / "killed" / "best.pt").exists()


def test_sigterm_saves_last_and_tells_how_to_resume(tmp_path, capsys):
    import socket

    from transformer.cli import main

    raw = tiny_config(tmp_path, train={"max_steps": 100000, "valid_every": 100000})
    config = write_config(tmp_path / "c.yaml", raw)
    proc = _start_training(config)
    _wait_for_step(proc, tmp_path / "run", 3)
    with pytest.raises(SystemExit) as second:  # a second training process on the same directory is refused
        main(["train", str(config), "--resume"])
    assert second.value.code == 2
    assert capsys.readouterr().err == (
        f"error: train: {tmp_path / 'run'} is in use by pid {proc.pid} on host "
        f"{socket.gethostname()} (lock file {tmp_path / 'run' / 'train.lock'}); "
        "wait for that run to end, or stop it\n"
    )
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert f"continue with: transformer train {config} --resume" in stderr
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    logged = max(m["step"] for m in read_metrics(tmp_path / "run") if m.get("split") == "train")
    assert state["run"]["step"] == logged >= 3  # saved where it stopped, not at an old validation


def test_kill_during_checkpoint_write_leaves_previous_checkpoint_loadable(tmp_path, random_seed):
    """A child rewrites a large checkpoint in a loop; SIGKILL it mid-write several times."""
    target = tmp_path / "run" / "last.pt"
    (tmp_path / "spm.model").write_bytes(small_vocab())
    script = f"""
import torch, itertools
from pathlib import Path
from transformer.model.checkpoint import save_checkpoint, weights_checkpoint
vocab = Path({str(tmp_path / "spm.model")!r}).read_bytes()
for i in itertools.count():
    weights = {{"w": torch.full((4_000_000,), float(i))}}
    save_checkpoint({{**weights_checkpoint({{}}, vocab, weights), "run": {{"step": i}}}}, {str(target)!r})
    print(i, flush=True)
"""
    last_seen = -1
    rng = random.Random(random_seed)
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=subprocess_env())
        _children.append(proc)  # it writes for ever
        proc.stdout.readline()  # at least one complete write
        wait = rng.uniform(0.0, 0.3)
        time.sleep(wait)  # then die somewhere inside a later write
        proc.kill()
        proc.wait()
        state = load_checkpoint(target)
        step = state["run"]["step"]
        # The file is one whole write: its tensor is complete and agrees with its own step.
        where = f"seed {random_seed}: kill {attempt} after {wait:.3f} s"
        assert state["model"]["w"].numel() == 4_000_000, where
        assert torch.equal(state["model"]["w"], torch.full((4_000_000,), float(step))), where
        last_seen = max(last_seen, step)
    assert last_seen >= 0
    # Besides last.pt, the kills leave at most atomic_write's own temporaries, which the trainer's start removes.
    assert all(p.name == "last.pt" or p.name.startswith(".last.pt.") for p in target.parent.iterdir())
    remove_stale_temporaries(target.parent)
    assert [p.name for p in target.parent.iterdir()] == ["last.pt"], f"seed {random_seed}"
    assert load_checkpoint(target)["run"]["step"] == step


# A child that trains like `python -m transformer ...` but SIGKILLs itself right after writing one given
# checkpoint file at one given step: a kill inside a validation step's set of writes, every time. The patch
# lives here, in the test; the package has no hook for it.
KILL_AFTER_WRITE = """
import os, signal, sys
from pathlib import Path
import transformer.training.loop
name, step = sys.argv[1], int(sys.argv[2])
real = transformer.training.loop.save_checkpoint
def save_then_die(state, path):
    real(state, path)
    if Path(path).name == name and state["run"]["step"] == step:
        os.kill(os.getpid(), signal.SIGKILL)
transformer.training.loop.save_checkpoint = save_then_die
from transformer.cli import main
main(sys.argv[3:])
"""


def test_sigkill_between_the_checkpoint_writes_of_a_validation_step(tmp_path):
    """Killed after best.pt of the last validation (before last.pt), and after step_8 (before best.pt and
    last.pt): --resume redoes the step, and every file ends as in a run that was never killed."""
    corpus = write_corpus(tmp_path / "c")
    common = {
        "train": {"max_steps": 10, "valid_every": 4, "keep_last": 2, "device": "cpu"},  # bit-identical
        "data": {"max_tokens": 120},
    }
    straight = tiny_config(tmp_path, "straight", corpus, **common)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed child (OMP_NUM_THREADS=1): bit-identical sums
    try:
        _kill_between_writes_then_resume(tmp_path, corpus, common, straight)
    finally:
        torch.set_num_threads(threads)


def _kill_between_writes_then_resume(tmp_path, corpus, common, straight):
    from transformer.cli import main
    from transformer.config import from_dict
    from transformer.training.loop import train

    train(from_dict(straight), quiet=True)
    names = sorted(p.name for p in (tmp_path / "straight").glob("*.pt"))
    assert names == ["best.pt", "last.pt", "step_00000008.pt", "step_00000010.pt"]
    assert load_checkpoint(tmp_path / "straight" / "best.pt")["run"]["step"] == 10  # so best.pt is written at 10
    env = subprocess_env()
    for name, step in (("best.pt", 10), ("step_00000008.pt", 8)):
        run = f"killed_{step}"
        config = write_config(tmp_path / f"{run}.yaml", tiny_config(tmp_path, run, corpus, **common))
        child = subprocess.run(
            [sys.executable, "-c", KILL_AFTER_WRITE, name, str(step), "train", str(config)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=300,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
        killed = tmp_path / run
        assert load_checkpoint(killed / name)["run"]["step"] == step  # the window: written, and last.pt older
        assert load_checkpoint(killed / "last.pt")["run"]["step"] < step
        main(["train", "--resume", str(killed)])
        assert sorted(p.name for p in killed.glob("*.pt")) == names
        for file in names:
            assert_same_training_state(tmp_path / "straight" / file, killed / file)


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_the_final_validation_saves_and_says_so(tmp_path, monkeypatch, sig, status):
    """In-process: the process signals itself while the last validation runs (validations at 2, 4, then 5)."""
    from transformer.cli import main
    from transformer.config import from_dict
    from transformer.training import loop as train_module

    real, calls = train_module.evaluate_loss, []

    def signal_in_third(*args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), sig)
        return real(*args)

    monkeypatch.setattr(train_module, "evaluate_loss", signal_in_third)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        train_module.train(from_dict(tiny_config(tmp_path, train={"max_steps": 5, "valid_every": 2})), quiet=True)
    assert stopped.value.code == status
    assert load_checkpoint(run / "last.pt")["run"]["step"] == 5
    name = signal.Signals(sig).name
    assert (
        f"{name}: saved {run}/last.pt at step 5; continue with: transformer train --resume {run}"
        in (run / "train.log").read_text()
    )
    monkeypatch.undo()
    main(["train", "--resume", str(run)])  # the run is complete: nothing to do, and no second last validation
    assert [m["step"] for m in read_metrics(run) if m.get("split") == "valid"] == [2, 4, 5]


def test_sigterm_before_training_starts_says_so(tmp_path, monkeypatch, capsys):
    from transformer.config import from_dict
    from transformer.training import loop as train_module

    real = train_module.prepare

    def terminated_while_preparing(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(train_module, "prepare", terminated_while_preparing)
    with pytest.raises(SystemExit) as stopped:
        train_module.train(from_dict(tiny_config(tmp_path)), quiet=True)
    assert stopped.value.code == 143
    run = tmp_path / "run"
    assert (
        f"SIGTERM: stopped (no checkpoint yet); continue with: transformer train --resume {run}"
        in capsys.readouterr().err
    )
    assert not (run / "train.lock").exists()


def test_printed_resume_command_keeps_the_overrides_and_continues_the_same_run(tmp_path, monkeypatch):
    """The run directory has a space in its name: the command is quoted for a shell, and running it (or
    `train --resume RUN_DIR`) continues that run, not a fresh one elsewhere."""
    import shlex

    from transformer.cli import main

    config = write_config(tmp_path / "tiny.yaml", tiny_config(tmp_path, "default run"))
    run = tmp_path / "my run"

    def sigterm_in_third_update(n, loss):
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    change_training_loss(monkeypatch, sigterm_in_third_update)
    with pytest.raises(SystemExit) as stopped:
        main(["train", str(config), "--set", f"train.run_dir={run}", "--set", "train.max_steps=6"])
    assert stopped.value.code == 143
    monkeypatch.undo()
    line = next(x for x in (run / "train.log").read_text().splitlines() if "continue with: " in x)
    command = line.split("continue with: ", 1)[1]
    assert command == shlex.join(
        ["transformer", "train", str(config), "--set", f"train.run_dir={run}", "--set", "train.max_steps=6", "--resume"]
    )
    main(shlex.split(command)[1:])
    metrics = read_metrics(run)
    assert any(m.get("event") == "resume" and m["step"] == 3 for m in metrics)
    assert [m["step"] for m in metrics if m.get("split") == "train"] == [1, 2, 3, 4, 5, 6]
    main(["train", "--resume", str(run), "--set", "train.max_steps=8"])  # the run's own config, one more change
    assert load_checkpoint(run / "last.pt")["run"]["step"] == 8
    assert not (tmp_path / "default run").exists()
