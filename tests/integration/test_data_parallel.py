"""Data-parallel training through torchrun on CPU (gloo): the same model as accumulation; a killed rank or SIGTERM
ends the run with a message and a checkpoint. Resuming under torchrun, bit for bit: test_torchrun.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import ROOT, cli, read_metrics, subprocess_env, tiny_config, write_config, write_corpus
from transformer.model.checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")


def torchrun(nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "transformer",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=ROOT)


# A command run the way torchrun runs a worker, with a handler that shows whether the interpreter finalized.
WORKER = """
import atexit, sys
atexit.register(lambda: print("finalized", flush=True))
from transformer.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "argv, status, out, err",
    [
        (["train", "--help"], 0, "usage: transformer train", ""),
        (["train", "/nonexistent.yaml"], 2, "", "error: config: no such file"),
    ],
)
def test_a_torchrun_worker_ends_without_finalizing_and_keeps_its_output(argv, status, out, err):
    """Under torchrun (WORLD_SIZE > 1) a command ends through os._exit: gloo's threads, which outlive the process
    group, get no chance to abort the interpreter's finalization. The exit status and output stay the same."""
    runs = {
        world: subprocess.run(
            [sys.executable, "-c", WORKER, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(WORLD_SIZE=world),
            cwd=ROOT,
        )
        for world in ("1", "2")
    }
    for world, run in runs.items():
        assert run.returncode == status, (world, run.stderr[-2000:])
        assert out in run.stdout and err in run.stderr
    assert "finalized" in runs["1"].stdout  # a plain process finalizes: the check above can tell
    assert "finalized" not in runs["2"].stdout


def weights(path):
    return load_checkpoint(path)["model"]


def test_two_ranks_equal_one_rank_with_update_freq_2(tmp_path):
    corpus = write_corpus(tmp_path / "c")
    # No dropout: ranks draw different dropout masks than a single process would.
    common = {"model": {"dropout": 0.0}, "data": {"max_tokens": 120}}
    single = tiny_config(tmp_path, "single", corpus, train={"max_steps": 6, "update_freq": 2}, **common)
    ddp = tiny_config(tmp_path, "ddp", corpus, train={"max_steps": 6, "update_freq": 1}, **common)
    one = cli("train", str(write_config(tmp_path / "single.yaml", single)))
    assert one.returncode == 0, one.stderr
    two = torchrun(2, "train", str(write_config(tmp_path / "ddp.yaml", ddp)))
    assert two.returncode == 0, two.stderr[-3000:]

    a, b = weights(tmp_path / "single" / "last.pt"), weights(tmp_path / "ddp" / "last.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    # The runs saw the same tokens per update, and only rank 0 wrote logs.
    tok_single = [m["loss"] for m in read_metrics(tmp_path / "single") if m.get("split") == "train"]
    tok_ddp = [m["loss"] for m in read_metrics(tmp_path / "ddp") if m.get("split") == "train"]
    assert tok_single == pytest.approx(tok_ddp, rel=1e-5)
    assert len(tok_ddp) == 6  # one line per update, not one per rank
    valid_single = [m["loss"] for m in read_metrics(tmp_path / "single") if m.get("split") == "valid"]
    valid_ddp = [m["loss"] for m in read_metrics(tmp_path / "ddp") if m.get("split") == "valid"]
    assert valid_single == pytest.approx(valid_ddp, rel=1e-5)  # validation reduced over both ranks' shares


def start_long_ddp_run(tmp_path):
    """A 2-rank torchrun training that would run for ever; returns (launcher, config) once 3 updates are logged."""
    raw = tiny_config(tmp_path, train={"max_steps": 100000, "valid_every": 100000, "log_every": 1})
    config = write_config(tmp_path / "c.yaml", raw)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "transformer",
            "train",
            str(config),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline and launcher.poll() is None, "training did not start"
        time.sleep(0.1)
    return launcher, config


def _environ(pid: int) -> dict:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_a_killed_rank_ends_the_run_with_a_message_not_a_hang(tmp_path):
    launcher, config = start_long_ddp_run(tmp_path)
    ranks = subprocess.run(["pgrep", "-f", f"transformer train {config}"], capture_output=True, text=True)
    workers = [int(p) for p in ranks.stdout.split() if int(p) != launcher.pid]
    assert len(workers) == 2
    rank_of = {pid: _environ(pid).get("RANK") for pid in workers}  # set by torchrun for each worker
    os.kill(next(pid for pid, rank in rank_of.items() if rank == "1"), signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=120)  # no hang
    assert launcher.returncode != 0
    assert "error: rank 0: distributed training stopped, most likely because another rank crashed" in stderr, stderr[
        -3000:
    ]
    assert "exitcode  : -9" in stderr


def test_sigterm_to_torchrun_saves_once_and_stops_every_rank(tmp_path):
    launcher, _ = start_long_ddp_run(tmp_path)
    launcher.send_signal(signal.SIGTERM)  # what a scheduler's pre-emption sends
    _, stderr = launcher.communicate(timeout=120)
    assert "saved" in stderr and "--resume" in stderr, stderr[-2000:]
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    logged = max(m["step"] for m in read_metrics(tmp_path / "run") if m.get("split") == "train")
    assert state["run"]["step"] == logged >= 3
    assert len(state["rng"]) == 2
