"""Ctrl-C and SIGTERM: stop at once outside the update loop, or a flag the loop checks between updates."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

log = logging.getLogger("transformer")


@contextlib.contextmanager
def stop_at_once(message: Callable[[str], str]) -> Iterator[None]:
    """Outside the update loop (set-up, the end), SIGINT/SIGTERM stop at once with a message: no update
    has happened since the last checkpoint, so there is nothing to save."""

    def handle(signum, frame):
        log.warning(message(signal.Signals(signum).name))
        raise SystemExit(130 if signum == signal.SIGINT else 143)

    previous = set_stop_handlers(handle)
    try:
        yield
    finally:
        restore_handlers(previous, handle)


def set_stop_handlers(handler) -> dict:
    """Install `handler` (a function, or signal.SIG_IGN) for SIGINT and SIGTERM; return the handlers it replaced."""
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    return previous


def restore_handlers(previous: dict, ours: Callable) -> None:
    """Put back the handlers `ours` replaced, unless another was installed over it since: a rank failing on a
    dead peer ignores SIGINT/SIGTERM to the end (distributed.peer_failure_explained says why)."""
    for sig, handler in previous.items():
        if signal.getsignal(sig) == ours:
            signal.signal(sig, handler)


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag checked between updates, so the loop can save and exit."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        self._previous = set_stop_handlers(self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal_name is not None:  # a second Ctrl-C: stop now, without saving
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        restore_handlers(self._previous, self._handle)
        return False
