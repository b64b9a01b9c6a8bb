#!/usr/bin/env python
"""Where decoding time goes, encoder against decoder, for our search and for CTranslate2 on the same weights.

    python scripts/bench_phases.py data/multi30k/test.de --checkpoint runs/multi30k [--beam 1] [--threads 1]
        [--dtype fp32] [--stop early] [--limit 500] [--rounds 6] [--no-ctranslate2] [--profile 12]
        [--device cpu|cuda] [--json phases.json]

Per engine, two passes over the same batches of subword ids (tokenisation excluded), timed in interleaved rounds
(every pass once per round, the order reversed every other round, against this machine's drift):
- ours: the encoder alone (`Transformer.encode` and `new_cache`, which projects the cross-attention K/V once), and
  the whole search (`Translator.search`);
- CTranslate2: `translate_batch` with max_decoding_length=1 (the encoder and one decoder step: it has no
  encoder-only call for a translator), and the whole search (`ctranslate2_search`, as `translate --engine
  ctranslate2` runs it).
The decoder's share is the whole pass less the first one. One search at a time (1 worker) on --threads threads.
--profile N: one more pass of our whole search under torch.profiler, and its N operators with the most time (on
CUDA also its N kernels with the most GPU time, and the share of the pass the GPU was busy).
--device cuda times our search on the GPU (with --no-ctranslate2: CTranslate2 runs on the CPU here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from common import interleaved, operator_profile, print_profile, sync, write_json

from transformer.data.batch import padding_mask, prepare_sources
from transformer.data.corpus import read_lines
from transformer.data.loader import source_batches
from transformer.device import cpu_description
from transformer.inference.settings import STOP_RULES, SearchFlags
from transformer.inference.translator import Translator
from transformer.model.transformer import evaluating


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="source sentences, one per line")
    ap.add_argument("--checkpoint", required=True, help="run directory or checkpoint file")
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="ours; CTranslate2 runs int8 for int8, else fp32 (it has no bf16 on a CPU)",
    )
    ap.add_argument("--stop", choices=STOP_RULES, default="early", help="our stop rule (default early)")
    ap.add_argument("--threads", type=int, default=1, help="torch / CTranslate2 threads (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where our search runs (default cpu)")
    ap.add_argument("--limit", type=int, default=500, help="first N sentences (default 500)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--no-ctranslate2", action="store_true", help="time our engine only")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile one pass of our search and show its N costliest operators",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    return ap


def main(argv=None) -> int:
    ap = argument_parser()
    args = ap.parse_args(argv)
    if args.device == "cuda" and not args.no_ctranslate2:
        ap.error("--device cuda times our search alone: add --no-ctranslate2 (CTranslate2 is timed on a CPU)")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    ours = Translator(
        args.checkpoint, args.device, SearchFlags(dtype=args.dtype, beam=args.beam, workers=1, stop=args.stop)
    )
    lines = read_lines(args.source)[: args.limit]
    ids = ours.encode(lines)
    model, positions = ours.model, ours.cfg.model.max_positions
    batches = source_batches(ids, positions, ours.settings.max_tokens, 1)
    sources = [prepare_sources([ids[i] for i in batch], positions)[0].to(device) for batch in batches]

    def ours_encoder():
        with evaluating(model):
            for src in sources:
                mask = padding_mask(src)
                model.new_cache(model.encode(src, mask), mask)
        sync(device)  # the search reads its results on the host; the encoder alone must wait for its own

    passes = {"ours: encoder": ours_encoder, "ours: whole search": lambda: ours.search(ids)}
    if not args.no_ctranslate2:
        passes.update(ctranslate2_passes(args, ids, batches))
    times = interleaved(passes, args.rounds)
    median = {name: statistics.median(t) for name, t in times.items()}

    print(
        f"{args.device}, {len(ids)} sentences in {len(batches)} batches, beam {args.beam}, ours {args.dtype} "
        f"{args.stop}, {args.threads} thread(s), {args.rounds} rounds"
    )
    print(f"{'pass':32} {'median s':>9}  rounds")
    for name, t in times.items():
        print(f"{name:32} {median[name]:9.3f}  {' '.join(f'{x:.2f}' for x in t)}")
    split = print_split(median, args.no_ctranslate2)
    profile = operator_profile(lambda: ours.search(ids), args.profile, device) if args.profile else {}
    if profile:
        print_profile(profile, "ours, the whole search")
    if args.json:
        write_json(
            args.json,
            {
                "source": args.source,
                "checkpoint": str(args.checkpoint),
                "sentences": len(ids),
                "batches": len(batches),
                "beam": args.beam,
                "dtype": args.dtype,
                "stop": args.stop,
                "threads": args.threads,
                "device": args.device,
                "rounds": args.rounds,
                "torch": torch.__version__,
                "cpu": cpu_description(),
                "times_s": times,
                "split": split,
                "profile": profile,
            },
        )
        print(f"wrote {args.json}")
    return 0


def ctranslate2_passes(args, ids, batches) -> dict:
    """CTranslate2's encoder and first step (translate_batch with max_decoding_length 1), and its whole search as
    translate runs it, on the same batches."""
    ct2 = Translator(
        args.checkpoint,
        "cpu",
        SearchFlags(dtype="int8" if args.dtype == "int8" else "fp32", beam=args.beam, workers=1, engine="ctranslate2"),
    )
    torch.set_num_threads(args.threads)
    pieces = [[ct2.vocab.pieces(ids[i]) for i in batch] for batch in batches]

    def ct2_first_step():
        for batch in pieces:
            ct2.ct2.translate_batch(
                batch,
                beam_size=args.beam,
                max_decoding_length=1,
                min_decoding_length=0,
                max_input_length=0,
                max_batch_size=0,
                return_scores=True,
            )

    return {
        "CTranslate2: encoder + 1 step": ct2_first_step,
        "CTranslate2: whole search": lambda: ct2.search(ids),  # as translate runs it
    }


def print_split(median: dict, no_ctranslate2: bool) -> dict:
    """Each engine's first pass and the rest (the decoder), from the passes' medians; CTranslate2's over ours."""
    engines = [("ours", "ours: encoder", "ours: whole search")]
    if not no_ctranslate2:
        engines.append(("CTranslate2", "CTranslate2: encoder + 1 step", "CTranslate2: whole search"))
    split = {}
    for engine, first, whole in engines:
        split[engine] = {"first_s": median[first], "rest_s": median[whole] - median[first], "whole_s": median[whole]}
        print(
            f"{engine:12} first pass {median[first]:.3f}s, decoder (the rest) {median[whole] - median[first]:.3f}s, "
            f"whole {median[whole]:.3f}s"
        )
    if len(split) == 2:
        print(
            f"CTranslate2's time / ours: whole {split['CTranslate2']['whole_s'] / split['ours']['whole_s']:.2f}, "
            f"decoder {split['CTranslate2']['rest_s'] / split['ours']['rest_s']:.2f}"
        )
    return split


if __name__ == "__main__":
    sys.exit(main())
