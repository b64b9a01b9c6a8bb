"""Several models' translation speed and quality on one test set, measured side by side in one run: a student
beside its teacher (docs/more-data.md). Each model is a Translator as `translate` runs it (either engine, one
dtype); the timed passes run in rounds, every model once per round (in reverse order every other round), and each
model's speed relative to the first is the median over rounds of the ratio within a round, so that the machine's
drift falls on all of them alike.

    python scripts/bench_models.py data/multi30k/test.de --ref data/multi30k/test.en \\
        --models runs/multi30k_bt runs/multi30k_student --beam 4 --dtype bf16 --engine ours ctranslate2 \\
        [--shortlist off|on|both] [--limit 500] [--rounds 3] [--json out.json]

--shortlist both times each model without and with its lexical shortlist (`transformer shortlist` writes it).
Prints a table (model, engine, shortlist, sentences/s, ratio to the first row of the same engine, BLEU, and that
ratio in each round) and writes it as JSON, with each round's seconds. Tokenisation and detokenisation are
included, as a user of `translate` pays them.
"""

from __future__ import annotations

import argparse
import statistics

from common import interleaved, write_json

from transformer.data.corpus import read_lines
from transformer.inference.scoring import corpus_scores
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_set", help="sources, one per line")
    parser.add_argument("--ref", help="references, for BLEU")
    parser.add_argument("--models", nargs="+", required=True, metavar="RUN_OR_CHECKPOINT")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "int8"))
    parser.add_argument("--engine", nargs="+", default=["ours"], choices=("ours", "ctranslate2"))
    parser.add_argument("--shortlist", default="off", choices=("off", "on", "both"), help="with --shortlist")
    parser.add_argument("--limit", type=int, default=0, help="the first N sentences (0: all)")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per model, after an untimed one")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    lines = read_lines(args.test_set)[: args.limit or None]
    refs = read_lines(args.ref)[: len(lines)] if args.ref else None
    rows = []
    shortlists = {"off": [False], "on": [True], "both": [False, True]}[args.shortlist]
    runs = [(m, short) for m in args.models for short in shortlists]
    for engine in args.engine:
        translators = [
            Translator(m, "cpu", SearchFlags(beam=args.beam, dtype=args.dtype, engine=engine, shortlist=short))
            for m, short in runs
        ]
        outputs = [t.translate(lines) for t in translators]  # untimed: caches, conversions, packing
        passes = {str(i): (lambda t=t: t.translate(lines)) for i, t in enumerate(translators)}
        seconds = list(interleaved(passes, args.rounds, warm=False).values())
        for i, (model, short) in enumerate(runs):
            ratios = [first / mine for first, mine in zip(seconds[0], seconds[i])]
            rows.append(
                {
                    "model": model,
                    "engine": engine,
                    "shortlist": short,
                    "dtype": translators[i].settings.dtype,
                    "beam": args.beam,
                    "sentences": len(lines),
                    "sentences_per_s": round(len(lines) / statistics.median(seconds[i]), 1),
                    "speed_vs_first": round(statistics.median(ratios), 3),
                    # Per round, so that a reader sees how far one round's ratio is from another's.
                    "seconds_per_round": seconds[i],
                    "ratio_per_round": [round(x, 3) for x in ratios],
                    "bleu": round(corpus_scores(outputs[i], refs, ["bleu"])["bleu"], 2) if refs else None,
                }
            )
    print(
        f"{'model':40} {'engine':12} {'list':5} {'dtype':6} {'sent/s':>8} {'x first':>8} {'BLEU':>6}  x first by round"
    )
    for r in rows:
        bleu = f"{r['bleu']:.2f}" if r["bleu"] is not None else "-"
        print(
            f"{r['model'][-40:]:40} {r['engine']:12} {'yes' if r['shortlist'] else 'no':5} {r['dtype']:6} "
            f"{r['sentences_per_s']:>8} "
            f"{r['speed_vs_first']:>8} {bleu:>6}  {' '.join(f'{x:.2f}' for x in r['ratio_per_round'])}"
        )
    record = {"test_set": args.test_set, "rounds": args.rounds, "rows": rows}
    if args.json:
        write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
