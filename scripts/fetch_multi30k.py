"""Download Multi30k (bentrevett/multi30k) through Hugging Face datasets into plain-text files.

    python scripts/fetch_multi30k.py data/multi30k

writes {train,valid,test}.{de,en}, one sentence per line, which configs/multi30k.yaml reads.
`make data` runs this only when no local mirror (DATA_MIRROR) holds the files already.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformer.config import DataConfig
from transformer.data.corpus import load_split
from transformer.errors import UserError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--name", default="bentrevett/multi30k", help="dataset on the hub")
    args = parser.parse_args()
    cfg = DataConfig(source="hub", hub_name=args.name, src_lang="de", tgt_lang="en")
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for ours in ("train", "valid", "test"):  # the hub calls "valid" "validation": load_split finds it
            src, tgt = load_split(cfg, ours)
            for lang, lines in (("de", src), ("en", tgt)):
                # A newline inside a sentence would shift every later line against its translation.
                text = "".join(" ".join(line.split("\n")).strip() + "\n" for line in lines)
                (args.out_dir / f"{ours}.{lang}").write_text(text, encoding="utf-8")
            print(f"{ours}: {len(src)} pairs -> {args.out_dir}/{ours}.{{de,en}}")
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
