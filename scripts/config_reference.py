#!/usr/bin/env python
"""The key tables of docs/configuration.md, generated from transformer/config.py's dataclasses: one table per
section between the markers <!-- config:SECTION:begin --> and <!-- config:SECTION:end -->, a row per key in the
dataclass's order with its default. The meanings are kept from the rows already there; a new key gets a
placeholder meaning, which tests/integration/test_docs.py refuses until someone writes one.

    PYTHONPATH=. python scripts/config_reference.py            # rewrite the tables in docs/configuration.md
    PYTHONPATH=. python scripts/config_reference.py --check    # exit 1 if they are not what it would write
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from transformer.config import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
PLACEHOLDER = "TODO: say what this key does"
ROW = re.compile(r"^\| `([a-z_0-9]+)` \| (.*?) \| (.*) \|$")


def markers(section: str) -> tuple[str, str]:
    return f"<!-- config:{section}:begin -->", f"<!-- config:{section}:end -->"


def default_text(value) -> str:
    """A default as it would be written in a YAML config."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(default_text(v) for v in value) + "]"
    if value == "":
        return '""'
    if isinstance(value, float):
        return re.sub(r"e([-+])0*(\d)", r"e\1\2", repr(value))  # 1e-09 -> 1e-9
    return str(value)


def defaults(cls: type) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def table(section: str, cls: type, meanings: dict[str, str]) -> str:
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, value in defaults(cls).items():
        rows.append(f"| `{key}` | `{default_text(value)}` | {meanings.get(key, PLACEHOLDER)} |")
    return "\n".join(rows)


def render(text: str) -> str:
    for section, cls in SECTIONS.items():
        begin, end = markers(section)
        start, stop = text.find(begin), text.find(end)
        if start < 0 or stop < start:
            raise SystemExit(f"{DOC}: no {begin} ... {end} block for section {section!r}: add the two markers")
        old = text[start + len(begin) : stop]
        meanings = {m.group(1): m.group(3) for m in map(ROW.match, old.splitlines()) if m}
        text = text[: start + len(begin)] + "\n" + table(section, cls, meanings) + "\n" + text[stop:]
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the tables are out of date")
    ap.add_argument("--doc", type=Path, default=DOC, help=f"the file (default {DOC.relative_to(ROOT)})")
    args = ap.parse_args()
    text = args.doc.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.doc}: the config tables are out of date: run scripts/config_reference.py", file=sys.stderr)
            sys.exit(1)
        return
    args.doc.write_text(new, encoding="utf-8")
    print(f"config_reference: wrote the tables of {args.doc}")


if __name__ == "__main__":
    main()
