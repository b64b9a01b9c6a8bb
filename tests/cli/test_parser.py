"""The `transformer` command line (cli/parser.py, `main`): every subcommand is listed and explains itself with --help;
an error is one line, also in the file torchrun reads for its failure summary; a reader that goes away ends it
quietly."""

from __future__ import annotations

import io
import os
import re
import sys

import pytest

from tests.helpers import ROOT, cli, tiny_config, write_config

COMMANDS = (
    "train",
    "prepare",
    "translate",
    "evaluate",
    "average",
    "export",
    "attention",
    "plot",
    "plot-positions",
    "synthesize",
)


def test_every_subcommand_has_help(call):
    top = cli("--help")  # once through `python -m transformer`, as a user runs it
    assert top.returncode == 0 and top.stdout.startswith("usage: transformer")
    # argparse lists a subcommand, indented by 4, only when it has a line of help.
    listed = set(re.findall(r"^ {4}(\S+)", top.stdout.split("positional arguments:")[1].split("options:")[0], re.M))
    assert set(COMMANDS) <= listed, f"missing from `transformer --help`: {set(COMMANDS) - listed}"
    for command in sorted(listed):  # COMMANDS and any added later
        status, out, err = call(command, "--help")
        assert status == 0 and out.startswith(f"usage: transformer {command}") and err == "", command
        assert len(out.splitlines()) > 3, f"`transformer {command} --help` explains nothing"


def test_a_reader_that_goes_away_ends_quietly(run, monkeypatch, call):
    """`translate ... | head -1`: the pipe's reader is gone; exit 141 (128 + SIGPIPE) without a word."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", encoding="utf-8") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        status, _, err = call("translate", run, "ein hund", "zwei katzen", "--dtype", "fp32")
        assert (status, err) == (141, "")
        monkeypatch.undo()


def test_torchrun_failure_summary_shows_our_line(monkeypatch, tmp_path, call):
    """torchrun reads a worker's error file for its failure summary: ours holds the one-line error."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    (tmp_path / "afile").write_text("a file\n")
    config = write_config(tmp_path / "tiny.yaml", tiny_config(tmp_path))
    status, _, err = call("train", config, "--set", f"train.run_dir={tmp_path}/afile")
    assert status == 2
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == err.strip() == f"error: train.run_dir {tmp_path}/afile is a file, not a directory"


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "no/such.yaml"], "error: config: no such file: no/such.yaml"),
        (
            ["train", "configs/tiny.yaml", "--set", "model.d_modle=3"],
            "unknown key 'd_modle' in section 'model' (did you mean 'd_model'?",
        ),
        (["train", "configs/tiny.yaml", "--set", "model.d_model=big"], "model.d_model must be an integer"),
    ],
)
def test_cli_errors_are_one_line(args, message, call, monkeypatch):
    """In this process (a real one's exit status and stderr: test_data_parallel.py's worker test)."""
    monkeypatch.chdir(ROOT)
    status, _, err = call(*args)
    assert status == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_error_reaches_stderr_in_one_write(monkeypatch, call):
    """torchrun's ranks share one stderr: a line written in two parts (print's text, then its newline) let two
    ranks' errors run together on one line (test_torchrun's init_from=/dev/zero, now and then)."""
    writes: list[str] = []

    class Recording(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stderr", Recording())
    monkeypatch.chdir(ROOT)
    status, _, _ = call("train", "no/such.yaml")
    assert status == 2
    assert writes == ["error: config: no such file: no/such.yaml\n"]


def test_unwritable_output_is_a_one_line_error(tmp_path, call):
    (tmp_path / "a_file").write_text("not a directory")
    status, _, err = call("plot-positions", "--d-model", "16", "--length", "8", "--out", tmp_path / "a_file" / "x.png")
    assert status == 2 and err.startswith("error: ")
    assert len(err.strip().splitlines()) == 1
