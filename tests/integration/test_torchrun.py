"""torchrun beyond one process on one machine, on CPU (gloo): two agents meeting through c10d train what one agent
with two ranks trains; a node with another config or other data is refused on every rank; a worker killed under
`--max-restarts` (in an update, or while rank 0 writes last.pt) is restarted and the run ends bit for bit as if
nothing had happened; a rank that waits for a stuck peer stops with one line. In a module of its own, so that the
suite's processes run it beside test_data_parallel.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    ROOT,
    assert_same_training_state,
    read_metrics,
    subprocess_env,
    tiny_config,
    write_config,
    write_corpus,
)
from transformer.model.checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

# A worker as torchrun starts it, with one planned accident (ACCIDENT, in the first start only) and, in a restart,
# rank 0 coming late (then the other rank looks in the store before the new rank 0 has written anything there).
ACCIDENT_WORKER = """
import io, os, signal, sys, time
import torch
from transformer.files import atomic_write
from transformer.training import loop

rank, start = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
what, _, when = os.environ.get("ACCIDENT", "").partition(":")


def die():
    os.kill(os.getpid(), signal.SIGKILL)  # what kill -9 does


if start == "0" and what == "kill-rank-1-after-step" and rank == "1":
    real_update = loop.train_update

    def train_update(run, update, stop):
        result = real_update(run, update, stop)
        if run.state.step == int(when):
            die()
        return result

    loop.train_update = train_update
elif start == "0" and what == "kill-rank-0-writing-last-pt-at-step" and rank == "0":
    real_save = loop.save_checkpoint

    def save_checkpoint(state, path):
        if path.name == "last.pt" and state["run"]["step"] == int(when):
            def half(f):
                whole = io.BytesIO()
                torch.save(state, whole)
                f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
                f.flush()
                die()

            atomic_write(path, half)
        real_save(state, path)

    loop.save_checkpoint = save_checkpoint
elif what == "stall-rank-1-before-joining" and rank == "1":
    time.sleep(600)
elif what == "stall-rank-0-preparing-the-data" and rank == "0":
    real_prepare = loop.prepare
    loop.prepare = lambda *args, **kwargs: (time.sleep(600), real_prepare(*args, **kwargs))[1]
elif start != "0" and rank == "0":
    time.sleep(3)  # a restarted rank 0 that is slow to start (a larger model to load, a busier node)

from transformer.cli import main

main(sys.argv[1:])
"""

STEPS = 12  # validations (and checkpoints) at 4, 8 and 12


def run_config(tmp_path, run_dir: Path, data_dir: str | Path) -> Path:
    """A tiny run of STEPS updates with dropout (a resumed run matches only if every rank's RNG was restored), on
    its corpus and a second one, half of whose pairs an epoch draws, tagged (the ranks share the mixture's draw)."""
    more = [{"name": "more", "dir": str(data_dir), "split": "valid", "weight": 0.5, "tag": "<more>"}]
    raw = tiny_config(
        tmp_path,
        train={"run_dir": str(run_dir), "max_steps": STEPS, "valid_every": 4},
        data={"max_tokens": 120, "dir": str(data_dir), "corpora": more},
    )
    return write_config(tmp_path / f"{run_dir.name}.yaml", raw)


def launch(*torchrun_args: str, config: Path, accident: str = "", cwd: Path = ROOT, extra=(), **env):
    """torchrun ARGS WORKER train CONFIG --resume (the documented command line) in the background -> (the launcher,
    the file its stdout and stderr go to: two launchers that wait for each other must not block on a full pipe)."""
    worker = config.parent / "worker.py"
    worker.write_text(ACCIDENT_WORKER, encoding="utf-8")
    output = config.parent / f"torchrun-{time.monotonic_ns()}.log"
    with output.open("w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(worker)]
            + ["train", str(config), "--resume", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=subprocess_env(ACCIDENT=accident, **env),
            cwd=cwd,
        )
    return launcher, output


def finish(*launched, timeout: float = 300) -> list[tuple[int, str]]:
    """Each launcher's exit status and output, once all have ended."""
    return [(launcher.wait(timeout=timeout), output.read_text()) for launcher, output in launched]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(config: Path, cwds=(ROOT, ROOT), extra_b=()) -> list[tuple[int, str]]:
    """Two torchrun agents on this machine, one rank each, meeting through c10d on 127.0.0.1 (each in its working
    directory; the second with extra arguments)."""
    common = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d"]
    common += ["--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "two-nodes"]
    return finish(
        launch(*common, config=config, cwd=cwds[0]), launch(*common, config=config, cwd=cwds[1], extra=extra_b)
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """last.pt of the run as one agent with two ranks trains it, without an accident."""
    root = tmp_path_factory.mktemp("uninterrupted")
    config = run_config(root, root / "run", write_corpus(root / "corpus"))
    [(status, err)] = finish(launch("--standalone", "--nproc_per_node", "2", config=config))
    assert status == 0, err[-3000:]
    return root / "run" / "last.pt"


def test_two_nodes_train_the_run_one_node_with_two_ranks_trains(uninterrupted, tmp_path):
    """`--nnodes 2 --nproc_per_node 1` (c10d rendezvous): the same weights, bit for bit, as one agent with two ranks
    (one thread per rank on both); the run directory, store and checkpoints written once, by global rank 0."""
    config = run_config(tmp_path, tmp_path / "run", uninterrupted.parent.parent / "corpus")
    (a_status, a_err), (b_status, b_err) = two_nodes(config)
    assert a_status == b_status == 0, (a_err[-2000:], b_err[-2000:])
    assert_same_training_state(uninterrupted, tmp_path / "run" / "last.pt")
    assert (a_err + b_err).count("store: preparing") == 1 and (a_err + b_err).count("done: 12 steps") == 1
    assert [m["step"] for m in read_metrics(tmp_path / "run") if m.get("split") == "train"] == list(range(1, 13))


def test_a_node_with_another_config_or_other_data_is_refused_on_every_rank(uninterrupted, tmp_path):
    corpus = uninterrupted.parent.parent / "corpus"
    config = run_config(tmp_path, tmp_path / "run", corpus)
    outcomes = two_nodes(config, extra_b=("--set", "train.lr=1.0"))
    for status, err in outcomes:
        assert status != 0 and f'File "{ROOT / "transformer"}' not in err, err[-3000:]  # torchrun's own traceback only
        (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
        assert "was started with another config than rank 0" in line and "train.lr is" in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was written

    # The same config on both, but data.dir (relative) names another corpus on the second node.
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    write_corpus(node_a / "corpus", seed=1)
    write_corpus(node_b / "corpus", seed=2)
    shared = run_config(tmp_path, tmp_path / "shared_run", "corpus")
    (a_status, a_err), (b_status, b_err) = two_nodes(shared, cwds=(node_a, node_b))
    lines = [line for err in (a_err, b_err) for line in err.splitlines() if line.startswith("error: ")]
    assert a_status != 0 and b_status != 0 and len(lines) == 2, (a_err[-2000:], b_err[-2000:])
    assert all("does not match this rank's data" in line and "corpus/train." in line for line in lines), lines
    assert sum("could not read the prepared data" in line for line in lines) == 1  # the other rank's line says why
    assert not (tmp_path / "shared_run" / "last.pt").exists()


@pytest.mark.parametrize("accident", ["kill-rank-1-after-step:6", "kill-rank-0-writing-last-pt-at-step:8"])
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_nothing_happened(uninterrupted, tmp_path, accident):
    """kill -9 of a worker under `torchrun --max-restarts 1 ... --resume`: the restarted group used to hang (it read
    the dead group's keys in torchrun's store); now it resumes from the last checkpoint by itself and ends bit for bit
    where the uninterrupted run ends. Killed during the write of last.pt, the run resumes from the one before."""
    config = run_config(tmp_path, tmp_path / "run", uninterrupted.parent.parent / "corpus")
    [(status, err)] = finish(
        launch("--standalone", "--nproc_per_node", "2", "--max-restarts", "1", config=config, accident=accident)
    )
    assert status == 0, err[-3000:]
    assert err.count("resume: continuing") == 1, err[-3000:]
    assert_same_training_state(uninterrupted, tmp_path / "run" / "last.pt")  # dropout on: every rank's RNG restored
    assert len(load_checkpoint(tmp_path / "run" / "last.pt")["rng"]) == 2  # one RNG state per rank
    events = [m["event"] for m in read_metrics(tmp_path / "run") if "event" in m]
    assert events.count("resume") == 1 and events.count("done") == 1  # restarted once
    assert not list((tmp_path / "run").glob(".*.transformer-tmp"))  # the torn write's temporary file removed


@pytest.mark.parametrize(
    "accident, message",
    [
        ("stall-rank-1-before-joining", "rank 0: rank(s) 1 did not join within 5 s (TRANSFORMER_DIST_TIMEOUT)"),
        (
            "stall-rank-0-preparing-the-data",
            "rank 1: distributed training stopped: another rank kept this one waiting for more than 5 s",
        ),
    ],
)
def test_a_rank_that_waits_for_a_stuck_peer_stops_with_one_line(tmp_path, accident, message):
    config = run_config(tmp_path, tmp_path / "run", write_corpus(tmp_path / "corpus"))
    launcher = launch(
        "--standalone", "--nproc_per_node", "2", config=config, accident=accident, TRANSFORMER_DIST_TIMEOUT="5"
    )
    [(status, err)] = finish(launcher, timeout=120)
    assert status != 0 and message in err, err[-3000:]


def test_init_from_a_device_is_refused_at_once_on_every_rank(tmp_path):
    """train.init_from=/dev/zero hung every rank for good, hashing an endless file."""
    config = run_config(tmp_path, tmp_path / "run", write_corpus(tmp_path / "corpus"))
    launched = launch(
        "--standalone", "--nproc_per_node", "2", config=config, extra=("--set", "train.init_from=/dev/zero")
    )
    [(status, err)] = finish(launched, timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status != 0 and len(lines) == 2, err[-3000:]
    assert all("train.init_from: checkpoint: /dev/zero is not a regular file" in line for line in lines), lines
