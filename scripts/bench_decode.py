#!/usr/bin/env python
"""Decoding speed: sentences/s and target tokens/s of our greedy and beam search against Hugging Face
MarianMTModel.generate with the same dimensions (random weights, forced to run the same number of steps),
and, with --ctranslate2, against CTranslate2 running our own trained weights.

    .venv/bin/python scripts/bench_decode.py --checkpoint runs/multi30k [data/multi30k/test.de] \
        [--device auto|cpu|cuda|all] [--beam 1 4] [--limit 200] [--repeats 3] [--int8] [--ctranslate2] \
        [--json bench.json]

`transformers` is optional (pip install -e '.[bench]'); without it only our numbers are printed.
Per batch, Marian generates exactly as many decoder steps as our search took on that batch
(min_new_tokens = max_new_tokens), so both do the same number of steps; ours also drops finished
sentences from the batch, Marian keeps every row to the end. Tokens/s counts our outputs' tokens + EOS
for both, so the two ratios agree.

CTranslate2 (pip install ctranslate2) gets our checkpoint through scripts/export_ctranslate2.py and the
same batches, with the same beam, length-penalty alpha and length limit; it stops at EOS like ours, so it
does its own number of steps. Its length penalty is length**alpha where ours is ((5 + length) / 6)**alpha,
so beam outputs may differ slightly: the JSON records how many outputs equal ours ("same_as_ours").
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer.batch import pad_sequences  # noqa: E402
from transformer.checkpoint import load_model  # noqa: E402
from transformer.data import read_lines  # noqa: E402
from transformer.search import beam_search, greedy_search  # noqa: E402
from transformer.translate import length_batches  # noqa: E402
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(src_ids: list[list[int]], max_tokens: int, batch_size: int) -> list[list[int]]:
    """Length-sorted batches by source tokens (--max-tokens) or by sentence count (--batch-size)."""
    if batch_size:
        order = sorted(range(len(src_ids)), key=lambda i: -len(src_ids[i]))
        return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    return length_batches([len(s) for s in src_ids], max_tokens)


class StepCounter:
    """Counts decoder calls (one per step with the cache) so Marian can be made to run as many."""

    def __init__(self, model):
        self.model, self.calls, self._decode = model, 0, model.decode

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._decode(*args, **kwargs)
        self.model.decode = counted
        return self

    def __exit__(self, *exc):
        del self.model.decode  # back to the class method


def run_ours(model, tensors, beam: int, lenpen: float, offset: int):
    """-> (decoder steps per batch, output tokens + EOS per batch, best output ids per sentence)."""
    steps, tokens, outputs = [], [], []
    for src in tensors:
        with StepCounter(model) as counter:
            if beam == 1:
                hyps = greedy_search(model, src, offset)
            else:
                hyps = [h[0] for h in beam_search(model, src, beam, lenpen, offset)]
        steps.append(counter.calls)
        tokens.append(sum(len(h.tokens) + 1 for h in hyps))
        outputs.extend(h.tokens for h in hyps)
    return steps, tokens, outputs


def build_marian(model, vocab_size: int, device: torch.device):
    from transformers import MarianConfig, MarianMTModel

    c = model.cfg
    config = MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, max_position_embeddings=c.max_positions,
        d_model=c.d_model, encoder_layers=c.n_encoder_layers, decoder_layers=c.n_decoder_layers,
        encoder_attention_heads=c.n_heads, decoder_attention_heads=c.n_heads,
        encoder_ffn_dim=c.d_ff, decoder_ffn_dim=c.d_ff, activation_function="relu", scale_embedding=True,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=BOS_ID, forced_eos_token_id=None,
        share_encoder_decoder_embeddings=c.share_embeddings, tie_word_embeddings=c.tie_output,
    )
    torch.manual_seed(0)
    return MarianMTModel(config).to(device).eval()


def run_marian(marian, tensors, steps: list[int], beam: int) -> None:
    with torch.inference_mode():
        for src, n in zip(tensors, steps):
            marian.generate(input_ids=src, attention_mask=(src != PAD_ID).long(), num_beams=beam, do_sample=False,
                            min_new_tokens=n, max_new_tokens=n, length_penalty=1.0, early_stopping=False,
                            num_return_sequences=1)


def load_ctranslate2(model_dir: Path, device: torch.device, compute_type: str):
    import ctranslate2

    threads = torch.get_num_threads() if device.type == "cpu" else 1
    return ctranslate2.Translator(str(model_dir), device=device.type, compute_type=compute_type,
                                  inter_threads=1, intra_threads=threads)


def run_ctranslate2(translator, pieces: list[list[list[str]]], beam: int, lenpen: float,
                    offset: int) -> list[list[str]]:
    """Translate each batch of source pieces in one call, as our search does; -> output pieces per sentence."""
    out = []
    for batch in pieces:
        results = translator.translate_batch(
            batch, beam_size=beam, length_penalty=lenpen if beam > 1 else 0.0, max_batch_size=0,
            max_decoding_length=max(len(p) for p in batch) + 1 + offset)  # + 1: the EOS CTranslate2 appends
        out.extend(r.hypotheses[0] for r in results)
    return out


def timed(fn, device: torch.device, repeats: int):
    """-> (seconds of each timed pass, what the untimed warm-up pass returned)."""
    result = fn()  # warm-up: allocator, kernels, lazy initialisation
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("test_set", nargs="?", default="data/multi30k/test.de", help="source sentences, one per line")
    ap.add_argument("--checkpoint", required=True, help="run directory or .pt file")
    ap.add_argument("--device", default="all", choices=("all", "auto", "cpu", "cuda"),
                    help="all: CPU, and CUDA when present (default); auto: CUDA if present else CPU")
    ap.add_argument("--max-tokens", type=int, default=0, help="source tokens per batch (default: decode.max_tokens)")
    ap.add_argument("--batch-size", type=int, default=0, help="sentences per batch instead of --max-tokens")
    ap.add_argument("--beam", type=int, nargs="+", default=[1, 4], help="beam sizes (1 = greedy); default 1 4")
    ap.add_argument("--limit", type=int, default=0, help="only the first N sentences (0 = all)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per setting; the median is reported")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face Marian comparison")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    ap.add_argument("--int8", action="store_true", help="on CPU, also time our int8 (dynamic quantization) path")
    ap.add_argument("--ctranslate2", action="store_true",
                    help="also time CTranslate2 on our weights (float32, and int8 with --int8 on CPU; "
                         "float16 on CUDA)")
    args = ap.parse_args()

    if args.device == "all":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    elif args.device == "auto":
        devices = ["cuda" if torch.cuda.is_available() else "cpu"]
    else:
        devices = [args.device]
    lines = read_lines(args.test_set)
    if args.limit:
        lines = lines[: args.limit]
    have_hf = False
    if not args.no_hf:
        try:
            import transformers
            have_hf = True
        except ImportError:
            print("transformers is not installed: only our numbers (pip install -e '.[bench]')", file=sys.stderr)

    ct2_dir = None
    if args.ctranslate2:
        try:
            import ctranslate2
            from export_ctranslate2 import export
        except ImportError:
            sys.exit("error: --ctranslate2 needs `pip install ctranslate2`")
        ct2_dir = Path(tempfile.mkdtemp(prefix="bench_ct2_"))
        export(args.checkpoint, ct2_dir)

    results = []
    for device_name in devices:
        device = torch.device(device_name)
        model, vocab, cfg = load_model(args.checkpoint, device)
        limit = cfg.model.max_positions - 2
        src_ids = [ids[:limit] for ids in vocab.encode(lines) if ids]
        batches = make_batches(src_ids, args.max_tokens or cfg.decode.max_tokens, args.batch_size)
        tensors = [pad_sequences([src_ids[i] + [EOS_ID] for i in b]).to(device) for b in batches]  # (B, S) each
        marian = build_marian(model, len(vocab), device) if have_hf else None
        ct2 = {}
        if ct2_dir is not None:
            types = ["float32"] + (["int8"] if args.int8 and device_name == "cpu" else []) + \
                    (["float16"] if device_name == "cuda" else [])
            ct2 = {f"ct2_{t}": load_ctranslate2(ct2_dir, device, t) for t in types}
            pieces = [[vocab.pieces(src_ids[i]) for i in b] for b in batches]
        for beam in args.beam:
            steps, tokens, ours_out = run_ours(model, tensors, beam, cfg.decode.lenpen, cfg.decode.max_len_offset)
            n_tokens = sum(tokens)
            row = {"device": device_name, "beam": beam, "sentences": len(src_ids), "batches": len(batches),
                   "target_tokens": n_tokens, "decoder_steps": sum(steps)}
            impls = {"ours": lambda: run_ours(model, tensors, beam, cfg.decode.lenpen, cfg.decode.max_len_offset)}
            if args.int8 and device_name == "cpu":
                from transformer.quantize import quantize_int8

                qmodel = quantize_int8(model)
                impls["ours_int8"] = lambda: run_ours(qmodel, tensors, beam, cfg.decode.lenpen,
                                                      cfg.decode.max_len_offset)
            if marian is not None:
                impls["hf_marian"] = lambda: run_marian(marian, tensors, steps, beam)
            for name, translator in ct2.items():
                impls[name] = (lambda tr=translator: run_ctranslate2(tr, pieces, beam, cfg.decode.lenpen,
                                                                     cfg.decode.max_len_offset))
            for name, fn in impls.items():
                times, out = timed(fn, device, args.repeats)
                median = statistics.median(times)
                row[name] = {"median_s": median, "times_s": times, "sentences_per_s": len(src_ids) / median,
                             "tokens_per_s": n_tokens / median}
                if name.startswith("ct2_"):  # out: output pieces per sentence, in batch order like ours
                    same = sum(a == vocab.pieces(b) for a, b in zip(out, ours_out))
                    row[name]["same_as_ours"] = same / len(out)
                    row[name]["own_tokens"] = sum(len(o) + 1 for o in out)
            if "hf_marian" in row:
                for name in impls:
                    if name != "hf_marian":
                        row[name]["speedup_over_hf"] = row["hf_marian"]["median_s"] / row[name]["median_s"]
            results.append(row)
            print_row(row)

    report = {"checkpoint": args.checkpoint, "test_set": args.test_set, "torch": torch.__version__,
              "transformers": transformers.__version__ if have_hf else None,
              "ctranslate2": ctranslate2.__version__ if ct2_dir is not None else None,
              "device_names": {d: (torch.cuda.get_device_name(0) if d == "cuda" else "cpu") for d in devices},
              "cpu_threads": torch.get_num_threads(), "results": results}
    if ct2_dir is not None:
        shutil.rmtree(ct2_dir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


_printed_header = False


def print_row(row: dict) -> None:
    global _printed_header
    if not _printed_header:
        print(f"{'device':6} {'beam':>4} {'impl':12} {'sent/s':>9} {'tok/s':>10} {'median s':>9}  {'× hf':>6}  same")
        _printed_header = True
    for name, r in row.items():
        if isinstance(r, dict):
            ratio = f"{r['speedup_over_hf']:.2f}x" if "speedup_over_hf" in r else ""
            same = f"{r['same_as_ours']:.1%}" if "same_as_ours" in r else ""
            print(f"{row['device']:6} {row['beam']:>4} {name:12} {r['sentences_per_s']:9.1f} {r['tokens_per_s']:10.1f} "
                  f"{r['median_s']:9.3f}  {ratio:>6}  {same}", flush=True)


if __name__ == "__main__":
    main()
