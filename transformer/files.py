"""File writes: atomic (a crash at any moment leaves the old file or the new one), and never over what must survive;
reads of small files that can neither hang (a FIFO) nor take all memory (/dev/zero, a huge file)."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from transformer.errors import UserError
from transformer.run_dir import RunDir

# Temporary files are named .NAME.XXXXXXXX.transformer-tmp (XXXXXXXX from mkstemp), so that cleaning up
# after a kill removes only files that atomic_write made, never a user's own *.tmp.
TEMP_SUFFIX = ".transformer-tmp"
_TEMP_NAME = re.compile(r"\..+\.[A-Za-z0-9_]{8}" + re.escape(TEMP_SUFFIX))
# The most a JSON file read whole may hold (read_regular's limit): the largest a model directory holds is its
# vocab.json, about 1.5 MB for 64,000 pieces; parsed, a JSON file takes several times its size in memory.
JSON_LIMIT = 16 << 20


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in blocks (a checkpoint may be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def read_regular(path: str | Path, limit: int, what: str) -> bytes:
    """A regular file's bytes, refused in one line (prefixed by `what`) when it is missing, not a regular file (a
    FIFO waits for a writer for ever, /dev/zero never ends) or larger than `limit` bytes. Opened without blocking and
    checked on the open descriptor, so that what is read is what was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(f"{what}: {path} is missing") from None
    except OSError as e:
        raise UserError(f"{what}: cannot read {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{what}: {path} is not a regular file (a directory, a pipe or a device); give the file")
        data = f.read(limit + 1) if info.st_size <= limit else b""
    if info.st_size > limit or len(data) > limit:
        raise UserError(f"{what}: {path} is larger than {limit / (1 << 20):g} MiB; that is not the file it should be")
    return data


def current_umask() -> int:
    """The process's umask (reading it means setting it; it is put back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(f) on a temporary file in path's directory, fsync it, then rename it over `path`: `path` is
    always the old file or the whole new one, and an error (Ctrl-C included) removes the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    except OSError as e:  # e.g. a read-only directory: name the file asked for, not a temporary name
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it private; ours are as readable as any file
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # e.g. a full disk: say which file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """atomic_write for a writer that takes a file name (an encoder in a child process): yields a temporary path in
    path's directory, renamed over `path` when the block ends, removed when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def remove_stale_temporaries(directory: str | Path) -> None:
    """Delete the temporary files that a kill during atomic_write left behind (and nothing else)."""
    for stale in Path(directory).glob(".*" + TEMP_SUFFIX):
        if _TEMP_NAME.fullmatch(stale.name) and stale.is_file() and not stale.is_symlink():
            stale.unlink(missing_ok=True)


def _checkpoint_keys(path: Path) -> frozenset | None:
    """The top-level keys of a PyTorch file (an empty set when it cannot be read); None if it is no PyTorch file."""
    if not path.is_file():  # a device (/dev/full reads zeros for ever), a pipe: no checkpoint
        return None
    try:
        with zipfile.ZipFile(path) as z:  # torch.save writes a zip archive holding .../data.pkl
            if not any(name.endswith("/data.pkl") or name == "data.pkl" for name in z.namelist()):
                return None
    except (zipfile.BadZipFile, OSError):
        return None
    import torch

    try:  # mmap: only the pickle is read, not the tensors
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return frozenset()
    return frozenset(state) if isinstance(state, dict) else frozenset()


def refuse_directory(output: str | Path, command: str) -> Path:
    """The output as a Path, unless it is or names a directory ("DIR/"), which a command must not turn into a
    sibling file (DIR.png) or write into."""
    out = Path(output)
    if out.is_dir() or str(output).endswith(os.sep):
        being = "is" if out.is_dir() else "names"
        raise UserError(f"{command}: the output {output} {being} a directory; give a file name")
    return out


def check_output_path(
    output: str | Path, inputs: Iterable[str | Path | None] = (), *, command: str, may_replace_weights: bool = False
) -> Path:
    """Refuse, in one line, an output path whose writing would destroy something: one of the command's
    inputs, a file of a training run (RunDir.owning: its config, vocabulary, logs, lock, checkpoints, store,
    end-of-training outputs), or a checkpoint holding training state. A weights-only checkpoint (an earlier
    `average`) may be replaced when may_replace_weights; otherwise no checkpoint is written over."""
    out = refuse_directory(output, command)
    if not out.exists():
        return out
    for given in inputs:
        if given is not None and Path(given).exists() and os.path.samefile(out, given):
            raise UserError(f"{command}: the output {out} is also an input ({given}); write to another file")
    run = RunDir.owning(out)
    if run is not None:
        raise UserError(
            f"{command}: refusing to overwrite {out}: it belongs to the training run in {run}; write to another file"
        )
    keys = _checkpoint_keys(out)
    if keys is not None:
        training = "optimizer" in keys
        if training or not keys or not may_replace_weights:
            what = "a training checkpoint (what --resume needs)" if training else "a checkpoint"
            raise UserError(f"{command}: refusing to overwrite {out}: it is {what}; write to another file")
    return out
