"""The README and the guides against the code: every `transformer ...` line of their shell blocks parses with that
verb's own parser, its `--set` keys exist, `make` targets are the Makefile's, a script's flags are the script's,
relative links and their anchors resolve, and the configuration reference lists every config key with its default."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from transformer.cli.parser import build_parser
from transformer.config import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *GUIDES]
LOG = ROOT / "docs" / "benchmarks" / "log.md"  # a dated record: its commands are history, its links still resolve
MAX_LINES = {README: 200, ROOT / "docs" / "performance.md": 180, ROOT / "docs" / "translation.md": 180}

FENCE = re.compile(r"^[ \t]*```([\w-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
SHELL = {"sh", "bash", "console", "shell"}
OPERATORS = set("|&;<>()")
ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.M))


# --------------------------------------------------------------------------- reading the docs


def shell_lines(text: str) -> list[str]:
    """The command lines of a document's shell blocks, continuation lines joined; in a console block only the
    lines after a `$ ` prompt."""
    lines = []
    for lang, body in FENCE.findall(text):
        if lang not in SHELL:
            continue
        raw = body.splitlines()
        if lang == "console":
            raw = [line.lstrip()[2:] for line in raw if line.lstrip().startswith("$ ")]
        joined, pending = [], ""
        for line in raw:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            joined.append(pending + line)
            pending = ""
        lines += [line for line in joined if line.strip() and not line.lstrip().startswith("#")]
    return lines


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at pipes, lists and redirections), words unquoted, comments gone,
    leading VAR=value assignments and `time`/`nice` wrappers dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, current = [], []
    for token in lexer:
        if token and set(token) <= OPERATORS:
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    cleaned = []
    for words in out:
        while words and ENV.match(words[0]):
            words = words[1:]
        while words and Path(words[0]).name in ("time", "nice"):
            words = words[1:]
            while words and (words[0].startswith("-") or words[0].isdigit()):
                words = words[1:]
        if words:
            cleaned.append(words)
    return cleaned


def transformer_args(words: list[str]) -> list[str] | None:
    """The arguments after `transformer`, `python -m transformer` or `torchrun ... -m transformer`, or None."""
    if words[0] == "transformer":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "transformer":
            return words[i + 2 :]
    return None


def set_key_problems(args: list[str]) -> list[str]:
    problems = []
    for i, word in enumerate(args):
        item = args[i + 1] if word == "--set" and i + 1 < len(args) else word[6:] if word.startswith("--set=") else None
        if item is None:
            continue
        path = item.split("=", 1)[0]
        section, _, key = path.partition(".")
        if section not in SECTIONS:
            problems.append(f"--set {item}: no config section {section!r}")
        elif key not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
            problems.append(f"--set {item}: no key {key!r} in section {section!r}")
    return problems


def parse_problem(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """What argparse says of these arguments, or None when the verb's parser accepts them."""
    table = verbs(parser)
    if not args or args[0] not in table:
        return f"no verb {args[0] if args else ''!r} (verbs: {', '.join(table)})"
    if "-h" in args or "--help" in args:
        return None
    known = table[args[0]]._option_string_actions
    unknown = [w.split("=", 1)[0] for w in args if w.startswith("--") and w.split("=", 1)[0] not in known]
    if unknown:  # argparse would take an abbreviation (--bea for --beam): the docs spell flags out
        return f"transformer {args[0]} has no option {unknown[0]}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(args)
    except SystemExit as e:
        if e.code:
            return stderr.getvalue().strip().splitlines()[-1]
    return None


def script_problems(words: list[str]) -> list[str]:
    """`python scripts/X.py --flag ...`: the script exists and each --flag is written in its source."""
    script = next((w for w in words[1:3] if w.startswith("scripts/") and w.endswith(".py")), None)
    if script is None or not Path(words[0]).name.startswith("python"):
        return []
    path = ROOT / script
    if not path.is_file():
        return [f"no such script: {script}"]
    source = path.read_text(encoding="utf-8")
    flags = [w.split("=", 1)[0] for w in words[words.index(script) + 1 :] if w.startswith("--")]
    return [
        f"{script} has no option {flag}" for flag in flags if f'"{flag}"' not in source and f"'{flag}'" not in source
    ]


def command_problems(text: str, parser: argparse.ArgumentParser, targets: set[str]) -> tuple[list[str], int]:
    """Every problem of a document's shell commands, and how many `transformer` commands it holds."""
    problems, seen = [], 0
    for line in shell_lines(text):
        for words in commands(line):
            args = transformer_args(words)
            if args is not None:
                seen += 1
                found = [parse_problem(parser, args), *set_key_problems(args)]
                problems += [f"{line.strip()}\n    {p}" for p in found if p]
            elif words[0] == "make":
                problems += [
                    f"{line.strip()}\n    no make target {t!r}"
                    for t in words[1:]
                    if not t.startswith("-") and "=" not in t and t not in targets
                ]
            else:
                problems += [f"{line.strip()}\n    {p}" for p in script_problems(words)]
    return problems, seen


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose = FENCE.sub("", text)
    found, counts = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
        base = slug(heading)
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_problems(doc: Path, text: str) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if path and not file.exists():
            problems.append(f"{target}: no such file {file.relative_to(ROOT) if ROOT in file.parents else file}")
            continue
        if (
            anchor
            and file.suffix == ".md"
            and anchor not in anchors(text if file == doc else file.read_text(encoding="utf-8"))
        ):
            problems.append(f"{target}: no heading with the anchor #{anchor} in {file.name}")
    return problems


# --------------------------------------------------------------------------- the checks


def name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.mark.parametrize("doc", DOCS, ids=name)
def test_every_command_in_the_shell_blocks_works_today(doc, parser):
    problems, _ = command_problems(doc.read_text(encoding="utf-8"), parser, make_targets())
    assert not problems, f"{name(doc)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", [*DOCS, LOG], ids=name)
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    problems = link_problems(doc, doc.read_text(encoding="utf-8"))
    assert not problems, f"{name(doc)}:\n" + "\n".join(problems)


def test_the_docs_show_every_verb(parser):
    used, total = set(), 0
    for doc in DOCS:
        for line in shell_lines(doc.read_text(encoding="utf-8")):
            for words in commands(line):
                args = transformer_args(words)
                if args:
                    used.add(args[0])
                    total += 1
    assert total >= 40, f"only {total} transformer commands found in the docs' shell blocks: is the reader broken?"
    assert set(verbs(parser)) <= used, f"verbs no shell block shows: {sorted(set(verbs(parser)) - used)}"


def test_the_checker_finds_a_wrong_flag_key_target_script_option_and_link(parser, tmp_path):
    doc = tmp_path / "guide.md"
    text = (
        "# Guide\n\n```sh\n"
        "transformer translate runs/x --beam 4 --no-such-flag\n"
        "transformer evaluate runs/x --stop sometimes\n"
        "transformer train configs/tiny.yaml \\\n    --set train.no_such_key=1\n"
        "echo hi | transformer frobnicate\n"
        "nice -n 10 make no-such-target\n"
        "python scripts/bench_decode.py x --no-such-option 1\n"
        'transformer translate runs/x --beam 4 "fine"   # --not-a-flag in a comment\n'
        "transformer average runs/x --las 5\n"
        "```\n\n[gone](missing.md) [here](#guide) [there](#nowhere)\n"
    )
    problems, seen = command_problems(text, parser, make_targets())
    assert seen == 6
    assert len(problems) == 7, "\n".join(problems)
    for expected in (
        "--no-such-flag",
        "sometimes",
        "no key 'no_such_key'",
        "frobnicate",
        "no-such-target",
        "--no-such-option",
        "has no option --las",
    ):
        assert any(expected in p for p in problems), (expected, problems)
    links = link_problems(doc, text)
    assert len(links) == 2 and "missing.md" in links[0] and "#nowhere" in links[1], links


def test_the_readme_holds_the_test_command_ci_runs():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    ci = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    readme = [" ".join(words) for line in shell_lines(README.read_text(encoding="utf-8")) for words in commands(line)]
    assert ci and ci[-1] in readme, (ci, readme)


@pytest.mark.parametrize("doc", list(MAX_LINES), ids=name)
def test_the_short_pages_stay_short(doc):
    lines = doc.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES[doc], f"{name(doc)} has {lines} lines; at most {MAX_LINES[doc]}"


def test_the_configuration_reference_lists_every_key_with_its_default():
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for section, cls in SECTIONS.items():
        block = re.search(f"<!-- config:{section}:begin -->(.*?)<!-- config:{section}:end -->", text, re.S)
        assert block, f"docs/configuration.md has no table for section {section!r}"
        rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \| (.*) \|$", block.group(1), re.M)
        fields = dataclasses.fields(cls)
        assert [key for key, _, _ in rows] == [f.name for f in fields], (
            f"{section}: run scripts/config_reference.py to list the keys of {cls.__name__}"
        )
        for (key, default, meaning), f in zip(rows, fields):
            expected = f.default_factory() if f.default is dataclasses.MISSING else f.default
            written = yaml.safe_load(default)
            if isinstance(expected, float):
                written = float(written)
            if isinstance(expected, tuple):
                written = tuple(written)
            assert written == expected, f"{section}.{key}: the table says {default}, the dataclass {expected!r}"
            assert meaning.strip() and not meaning.startswith("TODO"), f"{section}.{key}: say what it does"


def test_the_generator_of_the_configuration_tables_agrees_with_them():
    result = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
