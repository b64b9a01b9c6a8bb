"""RunLock (training/lock.py): one training process per run directory; a live holder refuses train, prepare and
finish in one line naming it, a dead one's lock is taken over, and the lock file is never written through a link."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess

import pytest

from tests.helpers import tiny_config, write_config
from transformer.errors import UserError
from transformer.training.lock import RunLock


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_run_directory_lock(tmp_path, call):
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, "run", train={"max_steps": 1, "valid_every": 1})
    config = write_config(tmp_path / "c.yaml", cfg)
    run_dir.mkdir()
    host = socket.gethostname()
    with RunLock(run_dir):  # a live training process owns it
        status, _, err = call("train", config)
    assert status == 2
    assert err == (
        f"error: train: {run_dir} is in use by pid {os.getpid()} on host {host} (lock file "
        f"{run_dir}/train.lock); wait for that run to end, or stop it\n"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == []  # released, and nothing written
    with RunLock(run_dir):  # the refusal names the command that was refused
        status, _, err = call("prepare", config)
    assert status == 2 and err.startswith(f"error: prepare: {run_dir} is in use by pid {os.getpid()}"), err

    (run_dir / "train.lock").write_text('{"pid": 1, "host": "elsewhere"}\n')
    status, _, err = call("train", config)
    assert (status, err) == (
        2,
        f"error: train: {run_dir} is in use by pid 1 on host elsewhere (lock file "
        f"{run_dir}/train.lock); if no run is going on there any more, delete the lock "
        "file\n",
    )

    dead = _dead_pid()  # a killed run's lock: taken over, with a log line
    (run_dir / "train.lock").write_text(f'{{"pid": {dead}, "host": "{host}"}}\n')
    status, _, err = call("train", config)
    assert status == 0, err
    assert (
        f"lock: {run_dir}/train.lock was left by pid {dead} on {host}, which is gone; taking it over"
        in (run_dir / "train.log").read_text()
    )
    assert not (run_dir / "train.lock").exists()  # removed when the run ends
    with RunLock(run_dir):  # finish of the run just trained: refused, and nothing written into it
        before = sorted(p.name for p in run_dir.iterdir())
        status, _, err = call("finish", run_dir)
        assert sorted(p.name for p in run_dir.iterdir()) == before
    assert status == 2 and err.startswith(f"error: finish: {run_dir} is in use by pid {os.getpid()}"), err

    # Its pid taken by another process since (pid 1 lives as long as the machine): nobody holds the file's
    # flock, so the run that wrote it is gone all the same.
    (run_dir / "train.lock").write_text(f'{{"pid": 1, "host": "{host}"}}\n')
    status, _, err = call("train", config, "--resume")
    assert status == 0, err
    assert "was left by pid 1 on" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize(
    "kind", ["link to a file", "link to an empty file", "dangling link", "hard link", "fifo", "directory"]
)
def test_the_lock_is_never_written_through_a_link_or_into_another_file(tmp_path, kind):
    """train.lock used to be opened with O_CREAT and followed links: the pid overwrote a victim file, and a dangling
    link's target was created. Now: O_CREAT|O_EXCL|O_NOFOLLOW, and only a regular file with one name is taken."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim.txt"
    run_dir.mkdir()
    lock = run_dir / "train.lock"
    contents = "" if kind == "link to an empty file" else "precious\n"  # "": read as nobody's lock, so written
    if kind != "dangling link":
        victim.write_text(contents)
    if kind.startswith("link") or kind == "dangling link":
        lock.symlink_to(victim)
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    said = {
        "link to a file": "is a symbolic link",
        "link to an empty file": "is a symbolic link",
        "dangling link": "is a symbolic link",
        "hard link": "has other names (hard links)",
        "fifo": "is not a regular file",
        "directory": "is not a regular file",
    }[kind]
    with pytest.raises(UserError, match=f"^train: {re.escape(str(lock))} {re.escape(said)}; .*delete"):
        with RunLock(run_dir):
            pass
    if kind == "dangling link":
        assert not victim.exists()  # not created through the link
    elif kind != "fifo" and kind != "directory":
        assert victim.read_text() == contents
    assert lock.is_symlink() or lock.exists()  # refused, left as it was

    # A plain lock file nobody holds (a killed run's) is still taken over, and a new one is created as before.
    shutil.rmtree(lock) if kind == "directory" else lock.unlink()
    lock.write_text(json.dumps({"pid": 999999999, "host": socket.gethostname()}) + "\n")
    with RunLock(run_dir) as held:
        assert held.took_over and json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()
    with RunLock(run_dir):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
