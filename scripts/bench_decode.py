#!/usr/bin/env python
"""Decoding speed: sentences/s and target tokens/s of our greedy and beam search against Hugging Face
MarianMTModel.generate with the same dimensions (random weights, forced to run the same number of steps).

    .venv/bin/python scripts/bench_decode.py --checkpoint runs/multi30k [data/multi30k/test.de] \
        [--device auto|cpu|cuda|all] [--beam 1 4] [--limit 200] [--repeats 3] [--json bench.json]

`transformers` is optional (pip install -e '.[bench]'); without it only our numbers are printed.
Per batch, Marian generates exactly as many decoder steps as our search took on that batch
(min_new_tokens = max_new_tokens), so both do the same number of steps; ours also drops finished
sentences from the batch, Marian keeps every row to the end. Tokens/s counts our outputs' tokens + EOS
for both, so the two ratios agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def run_ours(model, tensors, beam: int, lenpen: float, offset: int) -> tuple[list[int], list[int]]:
    """-> (decoder steps per batch, output tokens + EOS per batch)."""
    steps, tokens = [], []
    for src in tensors:
        with StepCounter(model) as counter:
            if beam == 1:
                hyps = greedy_search(model, src, offset)
            else:
                hyps = [h[0] for h in beam_search(model, src, beam, lenpen, offset)]
        steps.append(counter.calls)
        tokens.append(sum(len(h.tokens) + 1 for h in hyps))
    return steps, tokens


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


def timed(fn, device: torch.device, repeats: int) -> list[float]:
    fn()  # warm-up: allocator, kernels, lazy initialisation
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


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

    results = []
    for device_name in devices:
        device = torch.device(device_name)
        model, vocab, cfg = load_model(args.checkpoint, device)
        limit = cfg.model.max_positions - 2
        src_ids = [ids[:limit] for ids in vocab.encode(lines) if ids]
        batches = make_batches(src_ids, args.max_tokens or cfg.decode.max_tokens, args.batch_size)
        tensors = [pad_sequences([src_ids[i] + [EOS_ID] for i in b]).to(device) for b in batches]  # (B, S) each
        marian = build_marian(model, len(vocab), device) if have_hf else None
        for beam in args.beam:
            steps, tokens = run_ours(model, tensors, beam, cfg.decode.lenpen, cfg.decode.max_len_offset)
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
            for name, fn in impls.items():
                times = timed(fn, device, args.repeats)
                median = statistics.median(times)
                row[name] = {"median_s": median, "times_s": times, "sentences_per_s": len(src_ids) / median,
                             "tokens_per_s": n_tokens / median}
            if "hf_marian" in row:
                row["speedup_ours_over_hf"] = row["hf_marian"]["median_s"] / row["ours"]["median_s"]
                if "ours_int8" in row:
                    row["speedup_int8_over_hf"] = row["hf_marian"]["median_s"] / row["ours_int8"]["median_s"]
            results.append(row)
            print_row(row)

    report = {"checkpoint": args.checkpoint, "test_set": args.test_set, "torch": torch.__version__,
              "transformers": transformers.__version__ if have_hf else None,
              "device_names": {d: (torch.cuda.get_device_name(0) if d == "cuda" else "cpu") for d in devices},
              "cpu_threads": torch.get_num_threads(), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


_printed_header = False


def print_row(row: dict) -> None:
    global _printed_header
    if not _printed_header:
        print(f"{'device':6} {'beam':>4} {'impl':10} {'sent/s':>9} {'tok/s':>10} {'median s':>9}  ours/hf")
        _printed_header = True
    ratios = {"ours": "speedup_ours_over_hf", "ours_int8": "speedup_int8_over_hf"}
    for name in ("ours", "ours_int8", "hf_marian"):
        if name in row:
            r = row[name]
            ratio = f"{row[ratios[name]]:.2f}x" if ratios.get(name) in row else ""
            print(f"{row['device']:6} {row['beam']:>4} {name:10} {r['sentences_per_s']:9.1f} {r['tokens_per_s']:10.1f} "
                  f"{r['median_s']:9.3f}  {ratio}", flush=True)


if __name__ == "__main__":
    main()
