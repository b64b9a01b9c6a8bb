"""Atomic file writes: a crash at any moment leaves the old file or the new one, never a torn one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(f) on a temporary file in path's directory, fsync it, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; ours are as readable as any file
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def remove_stale_temporaries(directory: str | Path) -> None:
    """Delete the temporary files that a kill during atomic_write left behind."""
    for stale in Path(directory).glob(".*.tmp"):
        stale.unlink(missing_ok=True)
