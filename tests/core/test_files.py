"""Files (files.py): a write that fails names the file and leaves neither a torn file nor a temporary behind, and the
start of a run removes only the temporaries atomic_write leaves."""

from __future__ import annotations

import errno
import os

import pytest

from transformer.files import TEMP_SUFFIX, atomic_path, atomic_write, remove_stale_temporaries


def test_a_full_disk_names_the_file_and_leaves_no_temporary(run, monkeypatch, tmp_path, call):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    status, _, err = call("average", run, "--last", "2", "--output", tmp_path / "avg.pt")
    assert (status, err) == (2, f"error: {tmp_path}/avg.pt: No space left on device\n")
    assert list(tmp_path.iterdir()) == []


def test_remove_stale_temporaries_removes_only_ours(tmp_path):
    mine = [tmp_path / n for n in (".notes.tmp", "draft.tmp", ".last.pt.abc.tmp", f"x{TEMP_SUFFIX}")]
    for path in mine:
        path.write_text("keep")
    ours = tmp_path / f".last.pt.a1b2c3d4{TEMP_SUFFIX}"  # what a kill inside atomic_write leaves
    ours.write_text("torn")
    atomic_write(tmp_path / "last.pt", lambda f: f.write(b"whole"))
    remove_stale_temporaries(tmp_path)
    assert not ours.exists()
    assert all(p.read_text() == "keep" for p in mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in mine] + ["last.pt"])


def test_a_write_that_fails_midway_leaves_the_file_as_it_was(tmp_path):
    target = tmp_path / "out.txt"
    target.write_bytes(b"yesterday\n")

    def torn(f):
        f.write(b"half of today")
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, torn)
    assert target.read_bytes() == b"yesterday\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    atomic_write(target, lambda f: f.write(b"today\n"))
    assert target.read_bytes() == b"today\n" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_path_renames_a_whole_file_into_place_or_leaves_the_old_one(tmp_path):
    """For writers that take a file name (ffmpeg): the temporary name is one a restart cleans up."""
    target = tmp_path / "walk.mp4"
    target.write_bytes(b"old")
    with pytest.raises(OSError):
        with atomic_path(target) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".walk.mp4.") and tmp.name.endswith(TEMP_SUFFIX)
            tmp.write_bytes(b"half")
            raise OSError(28, "No space left on device")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["walk.mp4"]
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["walk.mp4"]
