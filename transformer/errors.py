"""The one exception type a user sees as a one-line message instead of a traceback, and what becomes one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, arguments).

    The CLI prints ``error: <message>`` and exits with status 2. Inside the package it is caught only to
    add context to the message, or where a command goes on without the failed part (a server answering a
    request, a vocabulary that is rebuilt).
    """


# How torch and Python report an allocation that cannot be made (CPU, CUDA, or a size past int64).
_OUT_OF_MEMORY = (
    "not enough memory",
    "can't allocate memory",
    "cannot allocate memory",
    "out of memory",
    "defaultcpuallocator",
    "overflow",
    "too large",
)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, (RuntimeError, ValueError, OverflowError)) and any(k in text for k in _OUT_OF_MEMORY)


def first_line(error: BaseException, limit: int | None = 200) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


@contextmanager
def out_of_memory_names(what: str) -> Iterator[None]:
    """Turn an allocation failure inside the block into a UserError that names the settings to lower."""
    try:
        yield
    except (MemoryError, RuntimeError, ValueError, OverflowError) as e:
        if not is_out_of_memory(e):
            raise
        raise UserError(f"not enough memory for {what} ({first_line(e)})") from None
