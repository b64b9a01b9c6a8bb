"""The run-directory lock: one training process (rank 0) per run directory, a killed one's lock taken over."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
from pathlib import Path

from transformer.errors import UserError
from transformer.run_dir import RunDir

try:
    import fcntl
except ImportError:  # not POSIX: the lock file's pid and host alone decide
    fcntl = None


class RunLock:
    """run_dir/train.lock, held by the process that trains there (rank 0), holding its pid and host.

    On one machine an flock on the file is the exclusion (the kernel drops it when the process dies): a
    lock file nobody holds was left by a killed run and is taken over, with a log line, even when its pid
    now names another process (without flock, the pid alone decides). A lock written on another host is
    refused, since that process cannot be checked from here.
    """

    def __init__(self, run_dir: Path, command: str = "train"):
        self.run_dir, self.path, self.command = run_dir, RunDir(run_dir).lock, command  # command: for messages
        self.fd: int | None = None
        self.took_over: str | None = None  # a log line for the caller, once logging is set up

    def _refuse(self, holder: dict, why: str) -> None:
        raise UserError(
            f"{self.command}: {self.run_dir} is in use by pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')} (lock file {self.path}); {why}"
        )

    def _open(self) -> int:
        """The lock file, created (O_CREAT|O_EXCL) or opened as it is, never through a symbolic link (O_NOFOLLOW), and
        only a regular file with no other name: writing our pid into it may change nothing but a lock file."""
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:  # also a link, dangling or not: O_EXCL never follows one
                pass
            try:  # O_NONBLOCK: a FIFO placed there must not hang the open (it is refused below)
                fd = os.open(self.path, flags | getattr(os, "O_NONBLOCK", 0))
            except FileNotFoundError:  # its holder removed it in between: create it
                continue
            except IsADirectoryError:
                self._refuse_file("is not a regular file")
            except OSError as e:
                if e.errno != errno.ELOOP and not self.path.is_symlink():
                    raise
                raise UserError(
                    f"{self.command}: {self.path} is a symbolic link; the lock file is never written "
                    "through one (that would overwrite what it points to): delete the link"
                ) from None
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                return fd
            os.close(fd)
            self._refuse_file("has other names (hard links)" if stat.S_ISREG(info.st_mode) else "is not a regular file")

    def _refuse_file(self, what: str) -> None:
        raise UserError(
            f"{self.command}: {self.path} {what}; the lock file is written over, so it must be a plain "
            "file of its own: delete it"
        )

    def __enter__(self) -> RunLock:
        host, pid = socket.gethostname(), os.getpid()
        while True:
            fd = self._open()
            try:
                holder = _read_lock(fd)
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError as e:
                        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                            raise  # e.g. ENOLCK: a filesystem without locks
                        self._refuse(holder, "wait for that run to end, or stop it")
                    if not _same_file(fd, self.path):  # the holder removed it as we opened it: try again
                        os.close(fd)
                        continue
                    holder = _read_lock(fd)  # what it says now that we hold it
            except BaseException:
                os.close(fd)
                raise
            break
        try:
            if holder and holder.get("host") != host:
                self._refuse(holder, "if no run is going on there any more, delete the lock file")
            if holder and holder.get("pid") != pid:
                # Holding the flock already proves its writer gone: the pid may belong to another process now.
                if fcntl is None and _alive(holder.get("pid")):
                    self._refuse(holder, "wait for that run to end, or stop it")
                self.took_over = (
                    f"lock: {self.path} was left by pid {holder.get('pid')} on {host}, which is gone; taking it over"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": pid, "host": host}).encode() + b"\n", 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> bool:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # while still holding it, so nobody takes a lock that is going away
            os.close(self.fd)
            self.fd = None
        return False


def _read_lock(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace") or "{}")
    except ValueError:
        return {"pid": "?", "host": "?"}  # torn or foreign content: someone else's lock all the same
    return holder if isinstance(holder, dict) else {"pid": "?", "host": "?"}


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except FileNotFoundError:
        return False


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unreadable: assume the worst
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True
