"""Training throughput, peak memory and MFU of one update, ours against Hugging Face MarianMTModel and
torch.nn.Transformer at the same dimensions and batch. Prints a table and writes JSON.

    python scripts/bench_train.py                                  # CUDA: base model, ~25k tokens, bf16
    python scripts/bench_train.py --device cpu --tokens 2048 --steps 3   # CPU: fp32, smaller batch

Each implementation runs in its own subprocess (clean memory statistics, no shared caches). The
batch is synthetic: fixed-length random sentences, so every token counted is a real token. FLOPs
per update = 6 x (encoder matmul parameters x source tokens + decoder matmul parameters incl. the
output projection x target tokens) + the attention matmuls (QK^T and AV, forward and backward).
MFU = FLOPs / step time / peak rate; the peak is --peak-tflops, else the datasheet's dense peak of a known GPU
in this precision (TF32 for fp32), else measured with large matmuls (peak.mfu_peak, as training does).
Ours runs as the trainer runs it: update.TrainingLoss (model and loss in one module, compiled together with
--compile), the decoder's self-attention mask as CAUSAL, fused Adam on CUDA, fp32 products in TF32 on CUDA.
--profile N: one more update of each implementation under torch.profiler, and its N costliest operators (on CUDA
also its N kernels with the most GPU time, and the share of the update the GPU was busy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from common import operator_profile, print_profile, sync, write_json

from transformer.config import load_config
from transformer.data.batch import CAUSAL, padding_mask
from transformer.data.vocab import PAD_ID
from transformer.device import cpu_description, tf32_matmuls
from transformer.model.transformer import build_model, training_flops
from transformer.peak import mfu_peak
from transformer.training.update import TrainingLoss

IMPLS = ("ours", "marian", "torch")


def flops_per_update(m, n_seq: int, src_len: int, tgt_len: int, vocab: int) -> float:
    return training_flops(m, vocab, n_seq * src_len, n_seq * tgt_len, [(n_seq, src_len, tgt_len)])


def build(impl: str, m, vocab: int, device, compile: bool = False):
    """Model and a function (src, tgt_in, tgt_out) -> loss for one implementation; with compile, the
    function runs the model through torch.compile (static shapes: the benchmark batch never changes)."""
    if impl == "ours":
        model = build_model(m, vocab).to(device)
        fwd = TrainingLoss(model, 0.1)  # the trainer's module: model and loss, compiled together
        fwd = torch.compile(fwd) if compile else fwd

        def loss_fn(src, tgt_in, tgt_out):  # the trainer's loss, per target token (as Marian's below)
            return fwd(src, tgt_in, tgt_out, padding_mask(src), CAUSAL) / (tgt_out != PAD_ID).sum()

        return model, loss_fn
    if impl == "marian":
        from transformers import MarianConfig, MarianMTModel

        config = MarianConfig(
            vocab_size=vocab,
            d_model=m.d_model,
            encoder_layers=m.n_encoder_layers,
            decoder_layers=m.n_decoder_layers,
            encoder_attention_heads=m.n_heads,
            decoder_attention_heads=m.n_heads,
            encoder_ffn_dim=m.d_ff,
            decoder_ffn_dim=m.d_ff,
            max_position_embeddings=m.max_positions,
            dropout=m.dropout,
            attention_dropout=m.attention_dropout,
            activation_function="relu",
            pad_token_id=0,
            eos_token_id=3,
            decoder_start_token_id=2,
            scale_embedding=True,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
        )
        model = MarianMTModel(config).to(device)
        fwd = torch.compile(model) if compile else model

        def loss_fn(src, tgt_in, tgt_out):
            out = fwd(
                input_ids=src, attention_mask=src.ne(0), decoder_input_ids=tgt_in, decoder_attention_mask=tgt_in.ne(0)
            )
            return F.cross_entropy(
                out.logits.reshape(-1, vocab), tgt_out.reshape(-1), label_smoothing=0.1, ignore_index=PAD_ID
            )

        return model, loss_fn

    class TorchSeq2Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, m.d_model, padding_idx=0)
            self.core = torch.nn.Transformer(
                m.d_model, m.n_heads, m.n_encoder_layers, m.n_decoder_layers, m.d_ff, m.dropout, batch_first=True
            )
            self.out = torch.nn.Linear(m.d_model, vocab, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, src, tgt_in):
            scale = m.d_model**0.5  # positions omitted: they cost nothing next to the layers
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
            h = self.core(
                self.embed(src) * scale,
                self.embed(tgt_in) * scale,
                tgt_mask=mask,
                src_key_padding_mask=src.eq(0),
                tgt_key_padding_mask=tgt_in.eq(0),
                memory_key_padding_mask=src.eq(0),
            )
            return self.out(h)

    model = TorchSeq2Seq().to(device)
    fwd = torch.compile(model) if compile else model

    def loss_fn(src, tgt_in, tgt_out):
        logits = fwd(src, tgt_in)
        return F.cross_entropy(logits.reshape(-1, vocab), tgt_out.reshape(-1), label_smoothing=0.1, ignore_index=PAD_ID)

    return model, loss_fn


def run_one(args) -> dict:
    """Time one implementation in this process."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    m = load_config(args.config).model
    compiled = args.compile == "all" or (args.compile == "ours" and args.impl == "ours")
    model, loss_fn = build(args.impl, m, args.vocab, device, compiled)
    model.train()
    opt = torch.optim.Adam(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True if device.type == "cuda" else None
    )
    n_seq = max(1, args.tokens // args.length)
    src = torch.randint(4, args.vocab, (n_seq, args.length), device=device)
    tgt = torch.randint(4, args.vocab, (n_seq, args.length + 1), device=device)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else torch.autocast(device.type, enabled=False)

    def step():
        with autocast:
            loss = loss_fn(src, tgt_in, tgt_out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with tf32_matmuls(device) if args.impl == "ours" else contextlib.nullcontext():  # as the trainer runs
        for _ in range(args.warmup):
            step()
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - start)
        profile = operator_profile(step, args.profile, device) if args.profile else None
    median = statistics.median(times)
    tokens = n_seq * args.length
    flops = flops_per_update(m, n_seq, args.length, args.length, args.vocab)
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated() / 2**30
    else:
        import resource

        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB, whole process
    return {
        "impl": args.impl,
        "compiled": compiled,
        "step_s_median": median,
        "step_s_all": times,
        "tgt_tokens_per_s": tokens / median,
        "tokens_per_s": 2 * tokens / median,
        "tflops_per_s": flops / median / 1e12,
        "peak_mem_gib": peak_mem,
        "params": sum(p.numel() for p in model.parameters()),
        "sentences": n_seq,
        **({"profile": profile} if profile else {}),
    }


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/base.yaml", help="model dimensions come from its model section")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--tokens", type=int, default=25000, help="target tokens per update (source the same)")
    parser.add_argument("--length", type=int, default=32, help="tokens per sentence")
    parser.add_argument("--steps", type=int, default=10, help="timed updates; the median is reported")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak; default: measured matmul")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ", ".join(IMPLS))
    parser.add_argument(
        "--compile",
        choices=("none", "ours", "all"),
        default="none",
        help="run the forward pass of ours, or of every implementation, through torch.compile "
        "(compilation happens in the warm-up updates)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile one more update of each implementation and show its N costliest operators",
    )
    parser.add_argument("--json", default="bench_train.json")
    parser.add_argument("--impl", help=argparse.SUPPRESS)  # internal: run one implementation and print JSON
    return parser


def main() -> None:
    parser = argument_parser()
    args = parser.parse_args()
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.impl:
        print(json.dumps(run_one(args)))
        return

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = mfu_peak(device, args.precision, args.peak_tflops or 0.0)
    peak = found.tflops * 1e12
    results, failed = [], []
    for impl in args.impls.split(","):
        command = [sys.executable, __file__, "--impl", impl] + [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("impl", "impls", "json", "peak_tflops") and v is not None
        ]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
            print(f"{impl}: failed: {reason}")
            failed.append({"impl": impl, "error": reason})  # in the JSON too, so a missing row has its reason
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["mfu"] = result["tflops_per_s"] * 1e12 / peak
        results.append(result)
    ours = next((r for r in results if r["impl"] == "ours"), None)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"device {device} ({device_name}), "
        f"torch {torch.__version__}, {args.precision}, {args.tokens} target tokens/update, "
        f"MFU against {found.describe()}"
    )
    print(
        f"{'impl':14} {'step s':>8} {'tgt tok/s':>10} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'ours x':>7}"
    )
    for r in results:
        ratio = ours["tgt_tokens_per_s"] / r["tgt_tokens_per_s"] if ours else float("nan")
        r["ours_speedup"] = ratio
        name = r["impl"] + ("+compile" if r["compiled"] else "")
        print(
            f"{name:14} {r['step_s_median']:8.3f} {r['tgt_tokens_per_s']:10.0f} {r['tokens_per_s']:10.0f} "
            f"{r['tflops_per_s']:8.2f} {r['mfu']:6.1%} {r['peak_mem_gib']:8.2f} {ratio:7.2f}"
        )
    for r in results:
        if "profile" in r:
            print_profile(r["profile"], r["impl"] + ("+compile" if r["compiled"] else "") + ", one update")
    write_json(
        args.json,
        {
            "device": str(device),
            "device_name": device_name,
            "cpu": cpu_description(),
            "torch": torch.__version__,
            "precision": args.precision,
            "peak_flops": peak,
            "peak_source": found.source,
            "peak_measured": found.measure is not None,
            "config": args.config,
            "compile": args.compile,
            "vocab": args.vocab,
            "tokens": args.tokens,
            "length": args.length,
            "results": results,
            "failed": failed,
        },
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
