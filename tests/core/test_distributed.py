"""torchrun and DDP set-up (distributed.py) in this process: a dead peer explained in one line (and a SIGTERM on the
way out does not replace it), other errors passed through with the signal handlers given back, a restarted
group's prefix in torchrun's store."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch

from transformer.distributed import DistInfo, init_distributed, peer_failure_explained, peer_timeout
from transformer.errors import UserError
from transformer.signals import StopRequested, stop_at_once

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")


@pytest.fixture
def signal_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield saved
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def sigterm_on_the_way_out():
    """torchrun's SIGTERM to a surviving rank, arriving after the update loop's stop handler has let go."""
    try:
        yield
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_while_a_failed_collective_unwinds_does_not_replace_its_message(signal_handlers):
    # Without the ignoring, the SIGTERM finds resume.stop_at_once's handler, which raises SystemExit(143).
    with pytest.raises(
        UserError,
        match="rank 1: distributed training stopped, most likely because another rank "
        r"crashed .*Connection closed by peer",
    ):
        with (
            stop_at_once(lambda name: f"{name}: stopped"),
            sigterm_on_the_way_out(),
            StopRequested(),
            peer_failure_explained(DistInfo(rank=1, world_size=2)),
        ):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # to the end of the process


@pytest.mark.parametrize(
    "info, error",
    [
        (DistInfo(rank=0, world_size=2), RuntimeError("mat1 and mat2 shapes cannot be multiplied")),
        (DistInfo(), RuntimeError("Connection closed by peer")),  # no torchrun, no peers: not ours to explain
    ],
)
def test_other_errors_pass_through_and_the_handlers_come_back(signal_handlers, info, error):
    with pytest.raises(RuntimeError) as raised:
        with stop_at_once(lambda name: f"{name}: stopped"), StopRequested(), peer_failure_explained(info):
            raise error
    assert raised.value is error
    assert {sig: signal.getsignal(sig) for sig in signal_handlers} == signal_handlers


def test_a_restarted_group_meets_under_a_prefix_that_old_keys_cannot_pass(monkeypatch):
    """torchrun's agent keeps one store for every group it starts; a dead group's keys are still there. The new
    group's ranks agree on rank 0's fresh prefix whatever the old keys say, whichever rank comes first."""
    import datetime
    import threading

    from transformer.distributed import HANDSHAKE, group_store

    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for late in (0, 1):
        # What a dead group left: rank 1's hello and confirmation, rank 0's answer (a dead rank 0's prefix).
        server.set(f"{HANDSHAKE}/hello/1", "old1")
        server.set(f"{HANDSHAKE}/answer/1", "old1 deadbeef")
        server.set(f"{HANDSHAKE}/ready/1", "old1 deadbeef")
        prefixes = {}

        def join(rank):
            if rank == late:
                time.sleep(0.5)
            store = group_store(DistInfo(rank=rank, world_size=2), datetime.timedelta(seconds=30))
            store.set(f"from {rank}", "x")
            prefixes[rank] = store

        threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert prefixes[0].get("from 1") == b"x" and prefixes[1].get("from 0") == b"x"  # the same prefix
        assert "deadbeef" not in server.get(f"{HANDSHAKE}/ready/1").decode()  # rank 1 confirmed the new prefix


def test_outside_torchrun_the_group_makes_its_own_store(monkeypatch):
    from transformer.distributed import group_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert group_store(DistInfo(rank=0, world_size=2), None) is None


@pytest.mark.parametrize("value", ["abc", "1.5", "99999999999999999999", "0", "-5", ""])
def test_a_bad_peer_timeout_is_one_line_before_any_group_forms(monkeypatch, value):
    monkeypatch.setenv("TRANSFORMER_DIST_TIMEOUT", value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")  # never reached: the check comes first
    with pytest.raises(UserError, match=r"TRANSFORMER_DIST_TIMEOUT is .*: it must be a whole number of seconds"):
        init_distributed("cpu")
    monkeypatch.setenv("TRANSFORMER_DIST_TIMEOUT", "60")
    assert peer_timeout() == 60
