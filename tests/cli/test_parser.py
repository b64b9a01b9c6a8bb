"""The `transformer` command line's parser (cli/parser.py): every subcommand is listed and explains itself with --help.
Its errors and exit statuses: tests/cli/test_entry.py."""

from __future__ import annotations

import re

from tests.helpers import cli

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
