"""Ctrl-C and SIGTERM (signals.py) in this process: a flag the update loop checks, a second signal that stops at
once, stop_at_once's exit status and message, and the handlers given back afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest

from transformer.signals import StopRequested, stop_at_once


def test_a_second_signal_stops_at_once_without_saving():
    """The first Ctrl-C asks the loop to save and stop after the update; a second one must not wait for that."""
    with StopRequested() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes of this thread
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stop_at_once_exits_with_the_signals_status_and_message_then_gives_the_handlers_back(sig, status, caplog):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with caplog.at_level("WARNING", logger="transformer"), pytest.raises(SystemExit) as stopped:
        with stop_at_once(lambda name: f"{name}: stopped while preparing; nothing to save"):
            os.kill(os.getpid(), sig)
            time.sleep(0.5)  # the handler runs between bytecodes of this thread
    assert stopped.value.code == status
    assert f"{signal.Signals(sig).name}: stopped while preparing; nothing to save" in caplog.text
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_handler_installed_over_ours_is_left_in_place():
    """A rank that failed on a dead peer ignores SIGINT and SIGTERM to the end: leaving the context must not undo it."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        with StopRequested():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
