#!/usr/bin/env python
"""What each decoding feature of issue 43 costs: sentences/s of sampling, a forced prefix, constraints, alignments
and an ensemble beside plain beam 4 (and greedy), on the same sentences, timed in interleaved rounds.

    python scripts/bench_features.py data/multi30k/test.de --checkpoint runs/multi30k --ref data/multi30k/test.en \
        [--ensemble OTHER_CHECKPOINT] [--beam 4] [--dtype fp32] [--threads 2] [--workers 1] [--limit 500] \
        [--rounds 3] [--json features.json]

Rows (each through translator.search_ids, as `translate` runs it; tokenisation excluded):
- beam B: the baseline every ratio is to; greedy: beam 1;
- sample topk:10, sample topp:0.9: one sample per sentence (seed 1);
- prefix: beam B with each sentence's first reference word forced (the plain output's first word without --ref),
  what a translator typing the start of a translation asks for;
- constraints: beam B with one phrase per sentence, the reference's longest word (the plain output's without
  --ref), as a term base would give it; the share of sentences that met it is reported;
- alignments: beam B and the alignment pass;
- ensemble: beam B over the checkpoint and --ensemble (the checkpoint with itself when not given: the cost of two
  members; their outputs are the plain ones).
Timing: an untimed pass per row (its outputs, BLEU with --ref), then --rounds rounds that time every row once, in
turn; sentences/s is the median, and "x beam" the median over rounds of the row's rate over the baseline's in the
same round (paired: this project's shared CPUs drift between minutes). Writes a JSON with every pass with --json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from common import sync, write_json

from transformer.data.corpus import read_lines
from transformer.device import cpu_description
from transformer.inference.batched import SentenceOptions, search_ids
from transformer.inference.scoring import corpus_scores
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator


def first_words(texts: list[str]) -> list[str]:
    return [t.split()[0] if t.split() else "" for t in texts]


def longest_words(texts: list[str]) -> list[str]:
    return [max(t.split(), key=len).strip(".,;:!?\"'") if t.split() else "" for t in texts]


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_set", help="source sentences, one per line")
    ap.add_argument("--checkpoint", required=True, help="run directory or .pt file")
    ap.add_argument("--ref", help="reference translations: BLEU per row, and the prefixes and constraints from them")
    ap.add_argument("--ensemble", help="the second member of the ensemble row (default: the checkpoint again)")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="searches side by side (decode.workers)")
    ap.add_argument("--limit", type=int, default=500, help="first N sentences (0 = all)")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes per row, interleaved")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    return ap


def print_table(results: dict, sentences: int, baseline: list[float]) -> None:
    """Each feature's rate, its time against beam search's round by round, BLEU, and how its outputs differ."""
    print(f"{'feature':>22} {'sent/s':>8} {'x beam':>7} {'BLEU':>6}  notes")
    for name, r in results.items():
        r["sentences_per_s"] = sentences / statistics.median(r["times_s"])
        r["vs_beam"] = statistics.median(b / t for b, t in zip(baseline, r["times_s"]))
        notes = f"{r['outputs_like_beam']:.0%} outputs as beam"
        if "constraints_met" in r:
            notes += f", {r['constraints_met']:.0%} met"
        bleu = f"{r['bleu']:6.2f}" if "bleu" in r else "     -"
        print(f"{name:>22} {r['sentences_per_s']:8.2f} {r['vs_beam']:6.2f}x {bleu}  {notes}")


def main() -> None:
    ap = argument_parser()
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = read_lines(args.test_set)
    lines = lines[: args.limit] if args.limit else lines
    refs = read_lines(args.ref)[: len(lines)] if args.ref else None

    flags = SearchFlags(beam=args.beam, dtype=args.dtype, workers=args.workers)
    translator = Translator(args.checkpoint, args.device, flags)
    ensemble = Translator([args.checkpoint, args.ensemble or args.checkpoint], args.device, flags)
    device, base = translator.device, translator.settings
    src = translator.vocab.encode(lines)
    plain = translator.translations(src, search_ids(translator.model, src, base, device))
    plain_texts = [t[0].text for t in plain]
    hints = refs if refs is not None else plain_texts
    prefixes = translator.sentence_options(len(lines), prefixes=first_words(hints))
    constraints = translator.sentence_options(len(lines), constraints=[[w] if w else [] for w in longest_words(hints)])

    def run(model, settings, options: list[SentenceOptions] | None = None, unmet: list | None = None):
        if settings.alignments:  # the Translator adds the alignment pass to the search
            return lambda: translator.search(src, settings, options, unmet)
        return lambda: search_ids(model, src, settings, device, options, unmet)

    rows = {
        f"beam {base.beam}": run(translator.model, base),
        "greedy": run(translator.model, replace(base, beam=1)),
        "sample topk:10": run(translator.model, replace(base, beam=1, sample="topk:10", seed=1)),
        "sample topp:0.9": run(translator.model, replace(base, beam=1, sample="topp:0.9", seed=1)),
        "prefix (first word)": run(translator.model, base, prefixes),
        "constraints (1 word)": run(translator.model, base, constraints),
        "alignments": run(translator.model, replace(base, alignments=True)),
        "ensemble of 2": run(ensemble.model, base),
    }
    results = {}
    for name, timed in rows.items():  # untimed: warms up, and the outputs
        unmet: list[int] = []
        if name.startswith("constraints"):
            timed = run(translator.model, base, constraints, unmet)
        found = translator.translations(src, timed())
        texts = [t[0].text for t in found]
        results[name] = {"outputs_like_beam": sum(a == b for a, b in zip(texts, plain_texts)) / max(1, len(lines))}
        if refs is not None:
            results[name]["bleu"] = corpus_scores(texts, refs, ("bleu",))["bleu"]
        if name.startswith("constraints"):
            asked = sum(bool(o.constraints) for o in constraints)
            results[name]["constraints_met"] = (asked - len(unmet)) / max(1, asked)
        results[name]["times_s"] = []
    for _ in range(args.rounds):
        for name, timed in rows.items():
            sync(device)
            start = time.perf_counter()
            timed()
            sync(device)
            results[name]["times_s"].append(time.perf_counter() - start)
    print(f"{len(lines)} sentences, {args.dtype} on {device}, {args.threads} threads, {args.rounds} rounds")
    print_table(results, len(lines), results[f"beam {base.beam}"]["times_s"])
    if args.json:
        record = {
            "test_set": args.test_set,
            "checkpoint": args.checkpoint,
            "ensemble": args.ensemble or args.checkpoint,
            "sentences": len(lines),
            "beam": base.beam,
            "dtype": args.dtype,
            "device": str(device),
            "threads": args.threads,
            "workers": args.workers,
            "torch": torch.__version__,
            "cpu": cpu_description(),
            "rows": results,
        }
        write_json(args.json, record)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
