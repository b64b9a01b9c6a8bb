#!/usr/bin/env python
"""Decoding speed and quality over a grid of settings: our search (beam x stop rule x dtype) beside CTranslate2
itself and our `--engine ctranslate2` (fp32, int8) on our own weights, and Hugging Face MarianMTModel.generate at
the same dimensions.

    python scripts/bench_decode.py data/multi30k/test.de --checkpoint runs/multi30k --ref data/multi30k/test.en \
        [--device cpu|cuda|auto|all] [--beam 1 4 5] [--stop exact early] [--dtype fp32 bf16 int8] \
        [--ctranslate2] [--no-hf] [--threads 2] [--workers 1 2] [--limit 500] [--repeats 3] \
        [--json bench.json]

Per setting it reports decoder steps per sentence (how long each sentence stayed in the search), sentences/s
and target tokens/s (median of --repeats timed passes after an untimed one), test BLEU and chrF with --ref,
the share of outputs identical to the first setting of the same beam (ours, first --stop, first --dtype),
and the speed ratio to CTranslate2 itself in float32 / int8 at the same beam and the same --workers (searches
side by side, each on threads / workers threads: decode.workers for ours, inter_threads for CTranslate2). The
timed passes of a beam's settings run in rounds, interleaved (every setting once per round), and a ratio is the
median over rounds of the ratio within a round: the figures are paired against the machine's drift
(timed_rounds).

With --ctranslate2, per compute type and --workers value, two rows on one ctranslate2.Translator (the conversion
`--engine ctranslate2` caches beside the checkpoint; inter_threads = workers, intra_threads = threads / workers):
- ctranslate2_itself: CTranslate2 as its users call it: the sources as SentencePiece pieces, one `translate_batch`
  over all of them in batches of max_tokens / workers tokens (max_batch_size, batch_type="tokens"), the same beam
  and length penalty, max_decoding_length = model.max_positions - 1, nothing else set;
- ctranslate2: our engine (`ctranslate2_engine.ctranslate2_search` on subword ids, as translate, evaluate and serve
  run it; its search scores are ours, so no scoring pass).
Tokenisation is excluded everywhere (ours gets subword ids, CTranslate2 itself pieces made beforehand). Our
engine's beam outputs can differ from ours (its own stop rule and penalty: ctranslate2_search). Marian (random
weights; `pip install -e '.[bench]'`) is forced to run exactly as many decoder steps per batch as our first
setting of that beam (min_new_tokens = max_new_tokens); ours also drops finished sentences from the batch, Marian
keeps every row.

An imported OPUS-MT model (`transformer import hf HF_DIR RUN_DIR`; scripts/make_marian_dir.py builds one at the
real size): --checkpoint RUN_DIR --hf-dir HF_DIR runs MarianMTModel.generate on HF_DIR itself (its weights, its
generation_config, our beam and length penalty, each stop rule's early_stopping; outputs scored like ours, one limit
per batch: the longest of our per-sentence limits), and --ct2-hf adds CTranslate2 converted from HF_DIR by its own
TransformersConverter (offline; once, into --ct2-hf-out), in --ct2-dtype's compute types, on the same source pieces:

    python scripts/bench_decode.py test.de --checkpoint RUN_DIR --hf-dir HF_DIR --ct2-hf --beam 4 --stop hf \
        --dtype fp32 bf16 int8 --json bench.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from common import ctranslate2_itself, ctranslate2_pieces, sync, write_json

from transformer.data.batch import prepare_sources
from transformer.data.corpus import read_lines
from transformer.data.loader import source_batches
from transformer.device import cpu_description
from transformer.inference.batched import search_batches, search_ids, search_workers
from transformer.inference.ctranslate2_engine import CT2_COMPUTE_TYPES, ctranslate2_search
from transformer.inference.scoring import corpus_scores
from transformer.inference.settings import STOP_RULES, SearchFlags, SearchSettings, search_settings
from transformer.inference.translator import Translator, pick_dtype


def timed_rounds(settings: list, device: torch.device, repeats: int, clock_zero: float) -> None:
    """Each setting's untimed warm-up pass (allocator, kernels, lazy initialisation; and the outputs and step
    counts), then `repeats` rounds that time every setting once, in turn. Interleaved because this project's
    2-core CPUs drift by 30 % over minutes: one engine timed after the other gave the same code 0.66x and
    0.91x CTranslate2 in two runs an hour apart; within a round every setting meets the same drift.

    settings: dicts with "warm_up" and "timed_pass" (callables); this adds "result" (what the warm-up returned),
    "times" (seconds of each timed pass) and "started" (each pass's start, seconds since clock_zero)."""
    for setting in settings:
        setting["result"] = setting["warm_up"]()
        setting["times"], setting["started"] = [], []
    for _ in range(repeats):
        for setting in settings:
            sync(device)
            start = time.perf_counter()
            setting["timed_pass"]()
            sync(device)
            setting["times"].append(time.perf_counter() - start)
            setting["started"].append(start - clock_zero)


def count_steps(model, src_ids, settings: SearchSettings, device):
    """search_ids' search, keeping what it reports: -> (outputs by sentence, decoder steps per batch, decoder
    steps per sentence)."""
    outputs, batch_steps, sentence_steps = [None] * len(src_ids), [], [0] * len(src_ids)
    for batch, result in search_batches(model, src_ids, settings, device):
        batch_steps.append(result.steps)
        for i, hyp, steps in zip(batch, result.best(), result.sentence_steps):
            outputs[i], sentence_steps[i] = hyp.tokens, steps
    return outputs, batch_steps, sentence_steps


def build_marian(model, vocab_size: int, device: torch.device):
    from transformers import MarianConfig, MarianMTModel

    c, specials = model.cfg, model.specials
    config = MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        max_position_embeddings=c.max_positions,
        d_model=c.d_model,
        encoder_layers=c.n_encoder_layers,
        decoder_layers=c.n_decoder_layers,
        encoder_attention_heads=c.n_heads,
        decoder_attention_heads=c.n_heads,
        encoder_ffn_dim=c.d_ff,
        decoder_ffn_dim=c.d_ff,
        activation_function="relu",
        scale_embedding=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=specials.pad,
        eos_token_id=specials.eos,
        decoder_start_token_id=specials.bos,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=c.share_embeddings,
        tie_word_embeddings=c.tie_output,
    )
    torch.manual_seed(0)
    return MarianMTModel(config).to(device).eval()


def run_marian(marian, tensors, steps: list[int], beam: int) -> None:
    with torch.inference_mode():
        for src, n in zip(tensors, steps):
            marian.generate(
                input_ids=src,
                attention_mask=(src != marian.config.pad_token_id).long(),
                num_beams=beam,
                do_sample=False,
                min_new_tokens=n,
                max_new_tokens=n,
                length_penalty=1.0,
                early_stopping=False,
                num_return_sequences=1,
            )


def batch_limits(src_ids, batches, settings: SearchSettings, max_positions: int) -> list[int]:
    """Per batch, the longest of its sentences' output limits (search.max_output_lengths): one call's limit."""
    from transformer.inference.search import max_output_lengths

    return [
        int(
            max_output_lengths(
                torch.tensor([len(src_ids[i]) + 1 for i in b]), settings.max_len_offset, max_positions
            ).max()
        )
        for b in batches
    ]


def run_generate(marian, tensors, batches, limits, settings: SearchSettings, n: int) -> list[list[int]]:
    """generate() on each batch with our beam, length penalty and the stop rule's early_stopping (the rest from the
    directory's generation_config): outputs by sentence, without start, EOS and padding."""
    from transformer.inference.settings import generate_keywords

    c = marian.config
    outputs: list[list[int]] = [[] for _ in range(n)]
    with torch.inference_mode():
        for src, batch, limit in zip(tensors, batches, limits):
            found = marian.generate(
                input_ids=src,
                attention_mask=(src != c.pad_token_id).long(),
                **generate_keywords(settings, config_only=True),  # our beam, length penalty and stop rule
                max_length=limit + 2,  # the start token, `limit` tokens and EOS
                do_sample=False,
            )
            for i, row in zip(batch, found.tolist()):
                outputs[i] = [t for t in row[1:] if t not in (c.pad_token_id, c.eos_token_id)]
    return outputs


def convert_hf_ct2(hf_dir: str, out_dir: str) -> str:
    """CTranslate2's own conversion of a MarianMTModel directory (its TransformersConverter), once: a directory that
    holds model.bin already is taken as it is."""
    if not (Path(out_dir) / "model.bin").is_file():
        from ctranslate2.converters import TransformersConverter

        TransformersConverter(hf_dir).convert(out_dir, force=True)
    return out_dir


def run_ct2_hf(translator, vocab, src_ids, batches, limits, settings: SearchSettings) -> list[list[int]]:
    """CTranslate2 (converted from the HF directory) on our source pieces, batch by batch: outputs by sentence."""
    outputs: list[list[int]] = [[] for _ in range(len(src_ids))]
    for batch, limit in zip(batches, limits):
        found = translator.translate_batch(
            [vocab.pieces(src_ids[i]) for i in batch],
            beam_size=settings.beam,
            length_penalty=settings.lenpen,
            max_decoding_length=limit,
            min_decoding_length=0,
            max_input_length=0,
        )
        for i, result in zip(batch, found):
            outputs[i] = vocab.piece_ids(result.hypotheses[0])
    return outputs


def score(row: dict, outputs, reference_outputs, vocab, refs) -> None:
    row["same_as_first"] = sum(a == b for a, b in zip(outputs, reference_outputs)) / len(outputs)
    row["target_tokens"] = sum(len(o) + 1 for o in outputs)
    row["tokens_per_s"] = row["target_tokens"] / row["median_s"]
    if refs is not None:
        scores = corpus_scores(vocab.decode(outputs), refs, ("bleu", "chrf"))
        row.update(bleu=scores["bleu"], chrf=scores["chrf"], bleu_signature=scores["bleu_signature"])


@dataclass
class Bench:
    """What one device's settings share: the model, the sources, the batches each layout searches, and every engine
    set up (ours per dtype, CTranslate2's per dtype and workers, Marian or the HF directory's)."""

    args: argparse.Namespace
    device_name: str
    device: torch.device
    vocab: object
    cfg: object
    src_ids: list
    refs: list | None
    max_tokens: int
    workers: list
    batches_for: dict  # workers -> the batches that layout searches (source_batches)
    batches: list  # the first setting's, which Marian runs
    models: dict = field(default_factory=dict)
    ct2: dict = field(default_factory=dict)
    marian: object = None
    ct2_hf: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)
    pieces: list = field(default_factory=list)

    def row(self, beam: int, impl: str, stop: str, dtype: str, workers: int) -> dict:
        return {
            "device": self.device_name,
            "beam": beam,
            "impl": impl,
            "stop": stop,
            "dtype": dtype,
            "workers": workers,
        }


def set_up(args, device_name: str, lines: list[str], refs) -> Bench:
    """The sources (empty lines are not searched) and every engine on this device."""
    device = torch.device(device_name)
    base = Translator(args.checkpoint, device_name, SearchFlags(dtype="fp32"))
    vocab, cfg = base.vocab, base.cfg
    encoded = vocab.encode(lines)
    keep = [i for i, ids in enumerate(encoded) if ids]
    src_ids = [encoded[i] for i in keep]
    max_tokens = args.max_tokens or cfg.decode.max_tokens
    workers = args.workers or [cfg.decode.workers]
    batches_for = {
        w: source_batches(src_ids, cfg.model.max_positions, max_tokens, search_workers(w, device)) for w in workers
    }
    bench = Bench(
        args,
        device_name,
        device,
        vocab,
        cfg,
        src_ids,
        [refs[i] for i in keep] if refs is not None else None,
        max_tokens,
        workers,
        batches_for,
        batches_for[workers[0]],
    )
    print(
        f"{device_name}: {len(src_ids)} sentences in {len(bench.batches)} batches; --dtype auto would pick "
        "{} ({})".format(*pick_dtype("auto", device)),
        file=sys.stderr,
    )
    dtypes = [d for d in args.dtype if not (d == "int8" and device.type == "cuda")]  # int8 is a CPU path here
    bench.models = {
        d: (base.model if d == "fp32" else Translator(args.checkpoint, device_name, SearchFlags(dtype=d)).model)
        for d in dtypes
    }
    if args.ctranslate2:
        bench.ct2 = {
            (d, w): Translator(args.checkpoint, device_name, SearchFlags(dtype=d, engine="ctranslate2", workers=w)).ct2
            for w in workers
            for d in args.ct2_dtype
        }
    set_up_hf(bench, base.model)
    bench.tensors = [
        prepare_sources([src_ids[i] for i in b], cfg.model.max_positions, base.model.specials)[0].to(device)
        for b in bench.batches
    ]
    bench.pieces = ctranslate2_pieces(vocab, src_ids, cfg.model.max_positions)
    return bench


def set_up_hf(bench: Bench, model) -> None:
    """Marian at our dimensions, or the HF directory's own model; CTranslate2's conversion of that directory."""
    args, device = bench.args, bench.device
    if not args.no_hf:
        try:
            if args.hf_dir:  # the directory an imported model came from: its own weights and generation settings
                from transformers import MarianMTModel

                bench.marian = MarianMTModel.from_pretrained(args.hf_dir).to(device).eval()
            else:
                bench.marian = build_marian(model, len(bench.vocab), device)
        except ImportError:
            print("transformers is not installed: no Marian comparison (pip install -e '.[bench]')", file=sys.stderr)
    if args.ct2_hf:
        import ctranslate2

        converted = convert_hf_ct2(args.hf_dir, args.ct2_hf_out)
        bench.ct2_hf = {
            d: ctranslate2.Translator(converted, device=device.type, compute_type=CT2_COMPUTE_TYPES[d])
            for d in args.ct2_dtype
        }


def our_settings(bench: Bench, beam: int, stops: list[str], first: dict) -> list[dict]:
    """Our search per stop rule, workers and dtype; `first` receives the first one's outputs and batch steps."""
    settings = []
    for stop in stops:
        for w in bench.workers:
            ours = replace(
                search_settings(bench.cfg.decode), beam=beam, stop=stop, max_tokens=bench.max_tokens, workers=w
            )
            for dtype, model in bench.models.items():

                def warm_up(model=model, ours=ours):
                    found = count_steps(model, bench.src_ids, ours, bench.device)
                    first.setdefault("outputs", found[0])
                    first.setdefault("steps", found[1])
                    return found

                def ours_pass(model=model, ours=ours):
                    search_ids(model, bench.src_ids, ours, bench.device)

                row = bench.row(beam, "ours", stop, dtype, w)
                settings.append({"row": row, "warm_up": warm_up, "timed_pass": ours_pass})
    return settings


def ct2_settings(bench: Bench, beam: int) -> list[dict]:
    """CTranslate2 itself and our engine through it, per compute type and workers."""
    settings, max_positions = [], bench.cfg.model.max_positions
    for (dtype, w), translator in bench.ct2.items():
        theirs = replace(search_settings(bench.cfg.decode), beam=beam, max_tokens=bench.max_tokens)
        batch_tokens = max(1, bench.max_tokens // translator.num_translators)  # as source_batches sizes ours

        def itself_pass(translator=translator, theirs=theirs, batch_tokens=batch_tokens):
            return ctranslate2_itself(
                translator, bench.vocab, bench.pieces, theirs, max_positions, batch_tokens, "tokens"
            )

        def engine_pass(translator=translator, theirs=theirs):
            found = ctranslate2_search(translator, bench.vocab, bench.src_ids, theirs, max_positions)
            return [hyps[0].tokens for hyps in found]

        passes = [("ctranslate2_itself", "ct2", itself_pass), ("ctranslate2", "ctranslate2", engine_pass)]
        for impl, stop, run in passes:
            row = bench.row(beam, impl, stop, dtype, w)
            if impl == "ctranslate2_itself":  # how it was called
                row.update(max_batch_tokens=batch_tokens, max_decoding_length=max_positions - 1)
            settings.append({"row": row, "warm_up": run, "timed_pass": run})
    return settings


def hf_settings(bench: Bench, beam: int, stops: list[str], first: dict) -> list[dict]:
    """CTranslate2 converted from the HF directory, and generate() on its model under the first stop rule's
    early_stopping; or Marian at our dimensions, as many steps per batch as our first setting took."""
    settings, batches = [], bench.batches
    hf = replace(search_settings(bench.cfg.decode), beam=beam, stop=stops[0], max_tokens=bench.max_tokens)
    limits = batch_limits(bench.src_ids, batches, hf, bench.cfg.model.max_positions)
    for dtype, translator in bench.ct2_hf.items():

        def ct2_hf_pass(translator=translator):
            return run_ct2_hf(translator, bench.vocab, bench.src_ids, batches, limits, hf)

        row = bench.row(beam, "ct2_from_hf", "ctranslate2", dtype, 1)
        settings.append({"row": row, "warm_up": ct2_hf_pass, "timed_pass": ct2_hf_pass})
    if bench.marian is not None and bench.args.hf_dir:

        def generate_pass():
            return run_generate(bench.marian, bench.tensors, batches, limits, hf, len(bench.src_ids))

        row = bench.row(beam, "hf_generate", stops[0], "fp32", 1)
        settings.append({"row": row, "warm_up": generate_pass, "timed_pass": generate_pass})
    elif bench.marian is not None:  # warmed up after our first setting, whose steps it takes

        def marian_pass():
            run_marian(bench.marian, bench.tensors, first["steps"], beam)

        row = bench.row(beam, "hf_marian", "forced", "fp32", 1)
        settings.append({"row": row, "warm_up": marian_pass, "timed_pass": marian_pass})
    return settings


def finished_rows(bench: Bench, settings: list[dict], first: dict) -> list[dict]:
    """Each timed setting's row: its times, rates and steps, its outputs scored, and its speed against CTranslate2
    itself's of the same compute type and workers, round by round."""
    rows = []
    for setting in settings:
        row, times, result = setting["row"], setting["times"], setting["result"]
        # Marian and the HF directory's engines search the first setting's batches in one process (workers 1).
        one_process = row["impl"] in ("hf_marian", "hf_generate", "ct2_from_hf")
        searched = bench.batches if one_process else bench.batches_for[row["workers"]]
        row.update(
            sentences=len(bench.src_ids),
            batches=len(searched),
            times_s=times,
            started_s=setting["started"],
            median_s=statistics.median(times),
        )
        row["sentences_per_s"] = len(bench.src_ids) / row["median_s"]
        if row["impl"] == "ours":
            outputs, batch_steps, sentence_steps = result
            row.update(decoder_steps=sum(batch_steps), steps_per_sentence=statistics.mean(sentence_steps))
        elif row["impl"].startswith("ctranslate2") or row["impl"] in ("hf_generate", "ct2_from_hf"):
            outputs = result
        else:  # Marian has random weights: no outputs worth scoring
            row["decoder_steps"] = sum(first["steps"])
            outputs = None
        if outputs is not None:
            score(row, outputs, first["outputs"], bench.vocab, bench.refs)
    for setting in settings:
        row = setting["row"]
        for dtype in ("fp32", "int8"):
            base = next(
                (
                    b
                    for b in settings
                    if b["row"]["impl"] == "ctranslate2_itself"
                    and b["row"]["dtype"] == dtype
                    and b["row"]["workers"] == row["workers"]
                ),
                None,
            )
            if base is not None:  # paired: this setting's pass against CTranslate2 itself's of the same round
                row[f"vs_ct2_{dtype}"] = statistics.median(b / t for t, b in zip(setting["times"], base["times"]))
        rows.append(row)
        print_row(row)
    return rows


def bench_device(args, device_name: str, lines: list[str], refs) -> list[dict]:
    """Every beam's settings on one device, timed in interleaved rounds (timed_rounds), as rows."""
    bench = set_up(args, device_name, lines, refs)
    rows, clock_zero = [], time.perf_counter()
    for beam in args.beam:
        first: dict = {}  # outputs and batch steps of this beam's first setting (ours)
        stops = args.stop if beam > 1 else args.stop[:1]  # greedy ignores the stop rule
        settings = (
            our_settings(bench, beam, stops, first) + ct2_settings(bench, beam) + hf_settings(bench, beam, stops, first)
        )
        timed_rounds(settings, bench.device, args.repeats, clock_zero)
        rows += finished_rows(bench, settings, first)
    return rows


_printed_header = False


def print_row(row: dict) -> None:
    global _printed_header
    if not _printed_header:
        print(
            f"{'device':6} {'beam':>4} {'impl':18} {'stop':11} {'dtype':5} {'wk':>2} {'steps/sent':>10} {'sent/s':>8} "
            f"{'tok/s':>9} {'BLEU':>6} {'same':>6} {'/ct2 fp32':>9} {'/ct2 int8':>9}"
        )
        _printed_header = True
    steps = f"{row['steps_per_sentence']:.1f}" if "steps_per_sentence" in row else ""
    bleu = f"{row['bleu']:.2f}" if "bleu" in row else ""
    same = f"{row['same_as_first']:.1%}" if "same_as_first" in row else ""
    tok = f"{row['tokens_per_s']:.0f}" if "tokens_per_s" in row else ""
    ratios = [f"{row[k]:.2f}x" if k in row else "" for k in ("vs_ct2_fp32", "vs_ct2_int8")]
    print(
        f"{row['device']:6} {row['beam']:>4} {row['impl']:18} {row['stop']:11} {row['dtype']:5} {row['workers']:>2} {steps:>10} "
        f"{row['sentences_per_s']:8.1f} {tok:>9} {bleu:>6} {same:>6} {ratios[0]:>9} {ratios[1]:>9}",
        flush=True,
    )


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("test_set", nargs="?", default="data/multi30k/test.de", help="source sentences, one per line")
    ap.add_argument("--checkpoint", required=True, help="run directory or .pt file")
    ap.add_argument("--ref", metavar="FILE", help="reference translations of test_set: adds BLEU and chrF per setting")
    ap.add_argument(
        "--device",
        default="all",
        choices=("all", "auto", "cpu", "cuda"),
        help="all: CPU, and CUDA when present (default); auto: CUDA if present else CPU",
    )
    ap.add_argument("--max-tokens", type=int, default=0, help="source tokens per batch (default: decode.max_tokens)")
    ap.add_argument("--beam", type=int, nargs="+", default=[1, 4], help="beam sizes (1 = greedy); default 1 4")
    ap.add_argument(
        "--stop",
        nargs="+",
        choices=STOP_RULES,
        default=["exact", "early"],
        help="beam-search stop rules to time (default: exact early; hf: generate's, an imported model's default)",
    )
    ap.add_argument(
        "--dtype",
        nargs="+",
        choices=("fp32", "bf16", "int8"),
        default=["fp32"],
        help="our number formats to time (default fp32; int8 runs on CPU only; bf16 on a CPU without "
        "avx512_bf16/amx_bf16 is emulated and very slow)",
    )
    ap.add_argument(
        "--ctranslate2",
        action="store_true",
        help="also time CTranslate2 itself and our --engine ctranslate2 on our weights (the ratio columns need it)",
    )
    ap.add_argument(
        "--ct2-dtype",
        nargs="+",
        choices=tuple(CT2_COMPUTE_TYPES),
        default=["fp32", "int8"],
        help="CTranslate2 compute types with --ctranslate2 (default: fp32 int8)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face Marian comparison")
    ap.add_argument(
        "--hf-dir",
        metavar="DIR",
        help="the MarianMTModel directory --checkpoint was imported from: generate() runs on it (its weights)",
    )
    ap.add_argument(
        "--ct2-hf",
        action="store_true",
        help="with --hf-dir: also time CTranslate2 converted from it by ctranslate2's TransformersConverter",
    )
    ap.add_argument(
        "--ct2-hf-out",
        metavar="DIR",
        default="ct2_from_hf",
        help="where --ct2-hf's conversion is written (reused when it holds model.bin; default ./ct2_from_hf)",
    )
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for every engine (default: torch's)")
    ap.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help="searches side by side, sharing the threads, for both engines (default: decode.workers)",
    )
    ap.add_argument("--limit", type=int, default=0, help="only the first N sentences (0 = all)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per setting; the median is reported")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    return ap


def main() -> None:
    ap = argument_parser()
    args = ap.parse_args()

    if args.ct2_hf and not args.hf_dir:
        ap.error("--ct2-hf needs --hf-dir")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "all":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    elif args.device == "auto":
        devices = ["cuda" if torch.cuda.is_available() else "cpu"]
    else:
        devices = [args.device]
    lines = read_lines(args.test_set)
    refs = read_lines(args.ref) if args.ref else None
    if refs is not None and len(refs) != len(lines):
        sys.exit(f"error: {args.test_set} has {len(lines)} lines but {args.ref} has {len(refs)}")
    if args.limit:
        lines, refs = lines[: args.limit], (refs[: args.limit] if refs is not None else None)
    results = [row for device in devices for row in bench_device(args, device, lines, refs)]

    versions = {}
    for name in ("ctranslate2", "transformers", "sacrebleu"):
        module = sys.modules.get(name)
        versions[name] = getattr(module, "__version__", None)
    report = {
        "checkpoint": args.checkpoint,
        "test_set": args.test_set,
        "ref": args.ref,
        "torch": torch.__version__,
        **versions,
        "device_names": {d: (torch.cuda.get_device_name(0) if d == "cuda" else "cpu") for d in devices},
        "cpu_threads": torch.get_num_threads(),
        "cpu": cpu_description(),
        "results": results,
    }
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
