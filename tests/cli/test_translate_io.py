"""translate's lines in and out (cli/translate_io.py): stdin streamed line by line whatever the pipe delivers, a long
line kept up to its bound, --input from files, pipes, FIFOs and devices, --output through FILE.partial (never a
file it did not create), closed standard streams, /dev/stdout and links written in place."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import SENTENCES, subprocess_env
from transformer.cli import translate_io
from transformer.inference.translator import Translator


@pytest.fixture(scope="module")
def same_txt(tmp_path_factory) -> Path:
    """Two lines to translate, in a directory of their own (the tests look at what their tmp_path holds)."""
    path = tmp_path_factory.mktemp("input") / "same.txt"
    path.write_text("ein hund\nzwei katzen\n", encoding="utf-8")
    return path


def test_closed_standard_streams_in_process(run, monkeypatch, call):
    monkeypatch.setattr(sys, "stdin", None)  # what Python sets for `<&-`
    status, _, err = call("translate", run)
    assert status == 2
    assert err == "error: translate: standard input is closed; give sentences as arguments or --input FILE\n"
    monkeypatch.setattr(sys, "stdout", None)  # `>&-`
    status, _, err = call("translate", run, "x")
    assert (status, err) == (2, "error: translate: standard output is closed; give --output FILE\n")


def test_closed_standard_streams_for_real(run):
    """Real closed descriptors: `<&-` and `>&-` in a shell."""
    environ = subprocess_env()
    shell = f"{sys.executable} -m transformer translate {run} <&- ; echo status $? >&2"
    result = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, env=environ, timeout=120)
    assert result.stderr == (
        "error: translate: standard input is closed; give sentences as arguments or --input FILE\nstatus 2\n"
    )
    shell = f"{sys.executable} -m transformer translate {run} 'ein hund' >&- ; echo status $? >&2"
    result = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, env=environ, timeout=120)
    assert result.stderr == "error: translate: standard output is closed; give --output FILE\nstatus 2\n"


@pytest.mark.parametrize("failure, status", [(KeyboardInterrupt, 130), (OSError(errno.EIO, "I/O error"), 2)])
def test_translate_that_fails_keeps_the_previous_output(run, same_txt, monkeypatch, tmp_path, call, failure, status):
    output = tmp_path / "out.txt"
    output.write_text("yesterday's translations\n", encoding="utf-8")

    def fail(*args, **kwargs):  # after the output was opened: the model is loaded, the input read
        raise failure

    monkeypatch.setattr(Translator, "translate_lines", fail)
    assert call("translate", run, "--input", same_txt, "--output", output)[0] == status
    assert output.read_text(encoding="utf-8") == "yesterday's translations\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # and no temporary file left beside it
    monkeypatch.undo()
    assert call("translate", run, "--input", same_txt, "--output", output)[0] == 0
    assert len(output.read_text(encoding="utf-8").splitlines()) == 2  # the next run replaces it
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_translate_stopped_midway_keeps_the_output_and_what_it_translated(
    run, same_txt, monkeypatch, tmp_path, call, signal_name, status
):
    """Ctrl-C, or SIGTERM (kill, a job scheduler), mid-file: FILE unchanged, FILE.partial named."""
    output = tmp_path / "out.txt"
    output.write_text("yesterday's translations\n", encoding="utf-8")
    output.chmod(0o600)  # private translations stay private when replaced
    real, calls, before = Translator.translate_lines, [], signal.getsignal(signal.SIGTERM)

    def stop_in_second_chunk(self, lines, *options, **keywords):
        calls.append(lines)
        if len(calls) == 2 and signal_name == "SIGINT":
            raise KeyboardInterrupt
        if len(calls) == 2:
            handler = signal.getsignal(signal.SIGTERM)
            assert callable(handler), "SIGTERM would end the process before FILE.partial is reported"
            handler(signal.SIGTERM, None)  # as its delivery would, without risking this test process
        return real(self, lines, *options, **keywords)

    monkeypatch.setattr(translate_io, "CHUNK_LINES", 1)
    monkeypatch.setattr(Translator, "translate_lines", stop_in_second_chunk)
    got, _, err = call("translate", run, "--input", same_txt, "--output", output)
    assert got == status and output.read_text(encoding="utf-8") == "yesterday's translations\n"
    partial = tmp_path / "out.txt.partial"
    assert len(partial.read_text(encoding="utf-8").splitlines()) == 1  # the first line's translation
    assert f"{output} is unchanged, and what was translated is in {partial}" in err
    assert signal.getsignal(signal.SIGTERM) == before  # given back

    monkeypatch.setattr(Translator, "translate_lines", real)
    kept = partial.read_text(encoding="utf-8")  # the lines done: never written over by the next run
    status, _, err = call("translate", run, "--input", same_txt, "--output", output)
    assert (status, err) == (
        2,
        f"error: translate: {partial} exists (what a stopped translation kept, or a file of "
        f"yours); it is never written over: move it away or delete it, then translate into "
        f"{output} again\n",
    )
    assert partial.read_text(encoding="utf-8") == kept
    partial.rename(tmp_path / "kept.txt")
    assert call("translate", run, "--input", same_txt, "--output", output)[0] == 0
    assert len(output.read_text(encoding="utf-8").splitlines()) == 2 and not partial.exists()
    assert output.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("case", ["input", "own file", "link"])
def test_translate_never_writes_over_or_removes_a_partial_it_did_not_create(run, same_txt, tmp_path, call, case):
    """`translate --input X.partial --output X` truncated the input and renamed it over X; a user's own X.partial
    was overwritten and removed; a link named X.partial was written through. Now each is refused before the model
    loads, and every file is as it was."""
    output, partial, elsewhere = tmp_path / "out.txt", tmp_path / "out.txt.partial", tmp_path / "elsewhere.txt"
    if case == "link":
        elsewhere.write_text("ein hund\n", encoding="utf-8")
        partial.symlink_to(elsewhere)
    else:
        partial.write_text("ein hund\nzwei katzen\n", encoding="utf-8")
    before = {p.name: (p.is_symlink(), p.read_bytes()) for p in tmp_path.iterdir()}
    given = ("--input", partial) if case == "input" else ("--input", same_txt)
    status, _, err = call("translate", run, *given, "--output", output)
    assert status == 2 and err.count("\n") == 1, err
    if case == "input":
        assert err == (
            f"error: translate: --input {partial} is {partial}, where --output {output} is written as "
            "lines are translated; rename the input, or write to another file\n"
        )
    else:
        assert f"error: translate: {partial} exists" in err
    assert {p.name: (p.is_symlink(), p.read_bytes()) for p in tmp_path.iterdir()} == before


def test_a_partial_that_appears_while_the_model_loads_is_not_written_over(run, same_txt, tmp_path, monkeypatch, call):
    """Checked again where it is created (O_EXCL): a file made between the check and the open stays as it was."""
    output, partial = tmp_path / "out.txt", tmp_path / "out.txt.partial"
    real = translate_io.check_partial

    def then_appears(out, input=None):
        found = real(out, input)
        partial.write_text("mine\n", encoding="utf-8")
        return found

    monkeypatch.setattr(translate_io, "check_partial", then_appears)
    status, _, err = call("translate", run, "--input", same_txt, "--output", output)
    assert status == 2 and f"error: translate: {partial} exists" in err
    assert partial.read_text(encoding="utf-8") == "mine\n" and not output.exists()


def translate_appending_to(log: Path, *args) -> subprocess.CompletedProcess:
    """`python -m transformer translate ARGS >> LOG`: its standard output is LOG, opened for appending."""
    with log.open("a") as stdout:
        return subprocess.run(
            [sys.executable, "-m", "transformer", "translate", *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
            timeout=120,
        )


def test_translate_output_dev_stdout_appended_to_a_log(run, same_txt, tmp_path):
    """--output /dev/stdout under `>> LOG`: LOG itself, in place; neither truncated nor renamed over."""
    log = tmp_path / "log"
    log.write_text("earlier\n")
    result = translate_appending_to(log, run, "--input", same_txt, "--output", "/dev/stdout")
    assert result.returncode == 0, result.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier" and len(lines) == 3
    # The same through a link to it: still the shell's file, in place, though it is a regular file.
    (tmp_path / "link").symlink_to(log)
    result = translate_appending_to(log, run, "--input", same_txt, "--output", tmp_path / "link")
    assert result.returncode == 0, result.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier" and len(lines) == 5 and (tmp_path / "link").is_symlink()


def test_translate_input_file_with_empty_lines(run, singles, tmp_path, call):
    lines = [SENTENCES[0], "", SENTENCES[1], "   ", SENTENCES[2], ""]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    status, out, _ = call("translate", run, "--dtype", "fp32", "--input", src, "--output", tmp_path / "out.txt")
    assert status == 0 and out == ""
    got = (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert got == [singles[0], "", singles[1], "", singles[2], ""]


def test_translate_stdin(run, singles, call):
    status, out, _ = call("translate", run, "--dtype", "fp32", stdin="\n".join(SENTENCES) + "\n")
    assert status == 0 and out.splitlines() == singles


def test_translate_input_that_is_no_regular_file(run, singles, tmp_path, call):
    """A pipe (what bash's <(zcat x.gz) gives), a FIFO, a device and `-` (stdin) are read like a file, once."""
    read_end, write_end = os.pipe()
    os.write(write_end, ("\n".join(SENTENCES) + "\n").encode("utf-8"))
    os.close(write_end)
    try:
        status, out, err = call("translate", run, "--dtype", "fp32", "--input", f"/dev/fd/{read_end}")
    finally:
        os.close(read_end)
    assert (status, out.splitlines()) == (0, singles), err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(SENTENCES[0] + "\n",), daemon=True)  # until read
    writer.start()
    try:
        status, out, err = call("translate", run, "--dtype", "fp32", "--input", fifo)
    finally:
        writer.join(timeout=60)
    assert (status, out.splitlines()) == (0, singles[:1]), err
    assert call("translate", run, "--dtype", "fp32", "--input", os.devnull)[:2] == (0, "")
    status, out, _ = call("translate", run, "--dtype", "fp32", "--input", "-", stdin="\n".join(SENTENCES) + "\n")
    assert (status, out.splitlines()) == (0, singles)
    status, _, err = call("translate", run, "--dtype", "fp32", "--input", tmp_path)
    assert (status, err) == (2, f"error: data: {tmp_path} is a directory, not a file\n")


@pytest.mark.parametrize("seed", range(4))
def test_stdin_lines_do_not_depend_on_how_the_pipe_delivers_them(seed):
    """Lines from standard input equal those of the whole text split on newlines, whatever the sizes of the
    pieces the pipe delivers (a long line spans many reads; pieces end inside lines and inside characters)."""
    rng = random.Random(seed)
    lines = [rng.choice(["", "ein hund\r", "zwei kätzchen", "x" * rng.randrange(1, 300_000)]) for _ in range(40)]
    data = "\n".join(lines).encode("utf-8") + (b"\n" if seed % 2 else b"")
    read_end, write_end = os.pipe()

    def write():
        with os.fdopen(write_end, "wb", buffering=0) as f:
            at = 0
            while at < len(data):
                size = rng.choice([1, 7, 4096, 70_000, 200_000])
                f.write(data[at : at + size])
                at += size

    writer = threading.Thread(target=write)
    writer.start()
    try:
        got = [line for chunk in translate_io._fd_chunks(read_end) for line in chunk]
    finally:
        writer.join()
        os.close(read_end)
    expected = data.decode("utf-8").split("\n")
    if expected[-1] == "":  # a final newline ends the last line; it does not start another
        expected.pop()
    assert got == [line.removesuffix("\r") for line in expected]


def test_translate_stdin_subprocess_streams_line_by_line(run, singles):
    """A real pipe: the first line's translation arrives before the second line is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer", "translate", str(run), "--device", "cpu", "--dtype", "fp32"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        env=subprocess_env(),
    )
    try:
        proc.stdin.write(SENTENCES[0] + "\n")
        proc.stdin.flush()
        first = proc.stdout.readline().rstrip("\n")
        proc.stdin.write("\n".join(SENTENCES[1:]) + "\n")
        proc.stdin.close()
        rest = proc.stdout.read().splitlines()
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert [first] + rest == singles


def test_nbest_format(run, call):
    status, out, _ = call(
        "translate", run, "--beam", "3", "--nbest", "3", "--dtype", "fp32", SENTENCES[0], "", SENTENCES[1]
    )
    assert status == 0
    rows = [line.split("\t") for line in out.split("\n")[:-1]]
    assert len(rows) == 9 and all(len(r) == 2 for r in rows)
    for group in (rows[0:3], rows[6:9]):
        scores = [float(r[0]) for r in group]
        assert scores == sorted(scores, reverse=True)
        assert len({r[1] for r in group}) == 3
    assert [r[1] for r in rows[3:6]] == ["", "", ""]


def test_output_through_a_symlink_writes_the_target_and_keeps_the_link(run, tmp_path, call):
    real, link = tmp_path / "real.txt", tmp_path / "out.txt"
    real.write_text("old\n", encoding="utf-8")
    link.symlink_to(real)
    status, _, err = call("translate", run, "ein hund", "--output", link)
    assert status == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text(encoding="utf-8") == link.read_text(encoding="utf-8") != "old\n"


def test_a_stdin_line_is_kept_only_up_to_its_bound():
    """Of each stdin line only its first line_bytes are kept, whatever the pipe's pieces; the lines around a long one
    are whole. (A 20 MB line used to be held whole, then split into subwords: 1.2 GB at its peak.)"""
    rng = random.Random(0)
    lines = [rng.choice(["", "ein hund\r", "zwei kätzchen", "ä" * rng.randrange(1, 3000)]) for _ in range(60)]
    data = "\n".join(lines).encode("utf-8")
    read_end, write_end = os.pipe()

    def write():
        with os.fdopen(write_end, "wb", buffering=0) as f:
            for at in range(0, len(data), 333):
                f.write(data[at : at + 333])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        got = [line for chunk in translate_io._fd_chunks(read_end, line_bytes=1001) for line in chunk]
    finally:
        writer.join()
        os.close(read_end)
    assert got == [translate_io._decode_line(line.encode("utf-8")[:1001]) for line in lines]
    assert any(len(line.encode("utf-8")) > 1001 for line in lines)  # the bound was exercised
    assert translate_io.LINE_BYTES >= 4 * translate_io.MAX_LINE_CHARS  # a cut line is still over what encode reads


def test_one_long_stdin_line_costs_bounded_memory(untrained_checkpoint, tmp_path):
    """Peak memory of `translate` reading one 8 MB line from stdin, less that of one short line: about 60 times the
    line before (a 20 MB line: 1,197 MB against 247 MB), now what MAX_LINE_CHARS costs (20 MB: 299 MB)."""
    wrapper = (
        "import atexit, resource, sys\n"
        "atexit.register(lambda: print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
        "file=sys.stderr))\n"
        "from transformer import cli\n"
        "cli.main(sys.argv[1:])\n"
    )

    def peak_kib(line: str) -> int:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                wrapper,
                "translate",
                str(untrained_checkpoint),
                "--dtype",
                "fp32",
                "--device",
                "cpu",
            ],
            input=line + "\n",
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return int(done.stderr.rsplit("maxrss", 1)[1])

    long_line = " ".join(["der hund läuft im haus"] * 360_000)  # 8 MB
    extra_mib = (peak_kib(long_line) - peak_kib("ein hund")) / 1024
    assert extra_mib < 150, f"one 8 MB line took {extra_mib:.0f} MiB more than a short one"
