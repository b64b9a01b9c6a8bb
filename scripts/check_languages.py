"""Which language each line of a file of translations is in, by py3langid (its model ships inside its wheel): the
share of lines identified as the language asked for, per file. A multilingual model asked for French must answer
in French (docs/multilingual.md).

    python scripts/check_languages.py runs/ml/en-many/eval/test.en-fr.final.hyp:fr ... [--json out.json]

Prints a table (file, language asked, lines, identified as asked, share, the other languages found) and writes it
as JSON. Blank lines are not counted.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from common import write_json


def classify(lines: list[str], languages: list[str] | None = None) -> list[str]:
    """Each line's language code (py3langid), chosen among `languages` when given (None: any it knows)."""
    try:
        import py3langid
    except ImportError:
        sys.exit("check_languages: needs py3langid: pip install 'transformer[langid]' (or pip install py3langid)")
    py3langid.set_languages(languages)  # None: every language it knows
    return [py3langid.classify(line)[0] for line in lines]


def check(path: Path, language: str, among: list[str] | None) -> dict:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    found = Counter(classify(lines, among))
    return {
        "file": str(path),
        "asked": language,
        "lines": len(lines),
        "as_asked": found[language],
        "share": found[language] / len(lines) if lines else 0.0,
        "others": {lang: n for lang, n in found.most_common() if lang != language},
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="FILE:LANG", help="a file of translations and its language")
    parser.add_argument("--among", nargs="+", metavar="LANG", help="languages to choose among (default: any)")
    parser.add_argument("--json", metavar="FILE", help="write the table here as JSON")
    args = parser.parse_args(argv)
    rows = []
    for item in args.files:
        path, _, language = item.rpartition(":")
        if not path or not Path(path).is_file():
            parser.error(f"{item}: give an existing FILE:LANG")
        rows.append(check(Path(path), language, args.among))
    print(f"{'file':60} {'asked':>5} {'lines':>6} {'as asked':>9} {'share':>7}  others")
    for r in rows:
        others = ", ".join(f"{k} {v}" for k, v in r["others"].items()) or "-"
        print(f"{r['file'][-60:]:60} {r['asked']:>5} {r['lines']:>6} {r['as_asked']:>9} {r['share']:>7.1%}  {others}")
    if args.json:
        write_json(args.json, {"rows": rows, "among": args.among})
    return rows


if __name__ == "__main__":
    main()
