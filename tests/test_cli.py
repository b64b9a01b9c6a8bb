"""The `transformer` command line: every subcommand explains itself with --help."""

from __future__ import annotations

from tests.conftest import cli


def test_every_subcommand_has_help():
    top = cli("--help")
    assert top.returncode == 0
    commands = [c for c in ("train", "translate", "evaluate", "average", "attention", "plot", "plot-positions")
                if c in top.stdout]
    assert "train" in commands
    for command in commands:
        result = cli(command, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout, command
