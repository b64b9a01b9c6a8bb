"""Resident memory (RSS) of training on a CPU in fp32 and bf16, and what oneDNN's primitive caches hold, with
their default capacity and with the bound every entry point sets (device.bounded_onednn_caches). Prints tables
and writes JSON.

    python scripts/bench_memory.py --config configs/multi30k.yaml --updates 1000 --json bench_memory.json
    python scripts/bench_memory.py --updates 300 --every 100 --probe-shapes 1500    # shorter
    python scripts/bench_memory.py --probe-only

Training: each (precision, caches) pair runs in its own subprocess: the config's model and optimizer, the
trainer's loss module (training.update.TrainingLoss), autocast, learning-rate schedule and gradient clipping, for N updates
on synthetic batches whose shape changes every update as the trainer's length-bucketed batches do (B sentences
of S source and T target tokens, B x max(S, T) <= data.max_tokens). RSS is read every --every updates, and the
peak (VmHWM) at the end. No data, vocabulary or run directory is needed.

Probe: oneDNN's linear op (torch.ops.mkldnn._linear_pointwise, the op packed bf16 translation runs; in bf16
where oneDNN computes it, else fp32, which every x86 CPU runs) over --probe-shapes distinct row counts, one
subprocess per capacity: the RSS growth shows what the caches keep per shape. oneDNN builds one primitive per
operation and shape and keeps up to its capacity of them (1,024 by default, in oneDNN's cache and again in
ideep's); torch runs bf16 matmuls through oneDNN only on CPUs with avx512_bf16 or AMX, fp32 ones through MKL.

Timings are not measured: RSS only. Other processes on the machine do not change a process's RSS much, but
say so when the machine was shared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from common import rss_mib, write_json

ROOT = Path(__file__).resolve().parent.parent
CAPACITIES = ("default", "bounded")
PRECISIONS = ("fp32", "bf16")


def child_env(capacity: str) -> dict:
    """The environment of a child: without any capacity setting, so that `default` is oneDNN's own and
    `bounded` is what bounded_onednn_caches sets in the child."""
    from transformer.device import ONEDNN_CACHE_VARIABLES

    drop = {name for names in ONEDNN_CACHE_VARIABLES for name in names}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}


def batch_shapes(updates: int, max_tokens: int, max_len: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """(B, S, T) per update: lengths drawn per batch, as many sentences as max_tokens allows."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(updates):
        s = rng.randint(4, max_len)
        t = max(2, min(max_len, s + rng.randint(-3, 3)))
        shapes.append((max(1, max_tokens // max(s, t)), s, t))
    return shapes


def train_child(args) -> dict:
    """N updates in this process; RSS every `every` updates."""
    from transformer.device import bounded_onednn_caches

    if args.capacity == "bounded":
        bounded_onednn_caches()  # before any oneDNN work, as the entry points do
    import torch

    from transformer.config import load_config
    from transformer.data.batch import CAUSAL, padding_mask
    from transformer.data.vocab import PAD_ID
    from transformer.device import autocast_context
    from transformer.model.transformer import build_model
    from transformer.training.optim import build_optimizer, set_hyperparameters
    from transformer.training.update import TrainingLoss

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.set)
    vocab = args.vocab or cfg.data.vocab_size
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab)
    model.train()
    loss_module = TrainingLoss(model, cfg.train.label_smoothing)
    optimizer = build_optimizer(model, cfg)
    device = torch.device("cpu")
    start = rss_mib()
    samples = []
    shapes = batch_shapes(args.updates, cfg.data.max_tokens, min(cfg.data.max_len, cfg.model.max_positions - 2))
    for step, (b, s, t) in enumerate(shapes, start=1):
        src = torch.randint(4, vocab, (b, s))
        tgt = torch.randint(4, vocab, (b, t + 1))
        set_hyperparameters(optimizer, cfg, step)
        with autocast_context(device, args.precision):
            loss = loss_module(src, tgt[:, :-1], tgt[:, 1:], padding_mask(src), CAUSAL)
        (loss / (tgt[:, 1:] != PAD_ID).sum()).backward()
        if cfg.train.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.every == 0 or step == args.updates:
            samples.append([step, round(rss_mib(), 1)])
    return {
        "precision": args.precision,
        "caches": args.capacity,
        "settings": capacity_settings(),
        "start_mib": round(start, 1),
        "rss_mib": samples,
        "peak_mib": round(rss_mib("self", "VmHWM"), 1),
        "distinct_shapes": len(set(shapes)),
        "updates": args.updates,
    }


def probe_child(args) -> dict:
    """oneDNN linear over many distinct row counts; RSS growth every tenth of the way."""
    from transformer.device import bounded_onednn_caches

    if args.capacity == "bounded":
        bounded_onednn_caches()
    import torch

    torch.set_num_threads(args.threads)
    mkldnn = torch.ops.mkldnn
    dtype = torch.bfloat16 if mkldnn._is_mkldnn_bf16_supported() else torch.float32
    torch.manual_seed(0)
    weight = mkldnn._reorder_linear_weight(torch.randn(args.probe_width, args.probe_width, dtype=dtype))
    start, growth = rss_mib(), []
    every = max(1, args.probe_shapes // 10)
    for rows in range(1, args.probe_shapes + 1):
        x = torch.randn(rows, args.probe_width, dtype=dtype)
        mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        if rows % every == 0:
            growth.append([rows, round(rss_mib() - start, 1)])
    return {
        "caches": args.capacity,
        "settings": capacity_settings(),
        "dtype": str(dtype).replace("torch.", ""),
        "width": args.probe_width,
        "growth_mib": growth,
        "start_mib": round(start, 1),
    }


def capacity_settings() -> dict:
    """The capacity variables as this process has them (None: unset, oneDNN's default)."""
    from transformer.device import ONEDNN_CACHE_VARIABLES

    return {name: os.environ.get(name) for names in ONEDNN_CACHE_VARIABLES for name in names}


def run_child(mode: str, capacity: str, args, extra: list[str]) -> dict:
    command = [
        sys.executable,
        __file__,
        f"--child={mode}",
        f"--capacity={capacity}",
        f"--threads={args.threads}",
        *extra,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=child_env(capacity), cwd=ROOT)
    if proc.returncode != 0:
        reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
        raise SystemExit(f"{mode} ({capacity}) failed: {reason}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/multi30k.yaml", help="model, optimizer and batch size")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), as for `transformer train`",
    )
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the config's)")
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100, help="updates between RSS readings")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument(
        "--capacities",
        nargs="+",
        choices=CAPACITIES,
        default=["bounded"],
        help="cache settings for the training runs (the probe always runs both)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    parser.add_argument("--probe-shapes", type=int, default=2000, help="distinct row counts in the probe")
    parser.add_argument("--probe-width", type=int, default=256, help="the probe's square weight, one side")
    parser.add_argument("--probe-only", action="store_true", help="skip the training runs")
    parser.add_argument("--json", default="bench_memory.json")
    parser.add_argument("--child", choices=("train", "probe"), help=argparse.SUPPRESS)
    parser.add_argument("--capacity", choices=CAPACITIES, help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = argument_parser()
    args = parser.parse_args()
    if args.child:
        print(json.dumps(train_child(args) if args.child == "train" else probe_child(args)))
        return

    import torch

    from transformer.device import ONEDNN_CACHE_CAPACITY, cpu_description, native_bf16

    training = []
    if not args.probe_only:
        common = [
            f"--config={args.config}",
            f"--updates={args.updates}",
            f"--every={args.every}",
            f"--vocab={args.vocab}",
            *(f"--set={s}" for s in args.set),
        ]
        for precision in args.precisions:
            for capacity in args.capacities:
                training.append(run_child("train", capacity, args, [*common, f"--precision={precision}"]))
        steps = [step for step, _ in training[0]["rss_mib"]]
        print(
            f"training {args.config}, {args.updates} updates, {training[0]['distinct_shapes']} distinct batch "
            f"shapes; RSS in MiB after each {args.every} updates"
        )
        print(
            f"{'precision':9} {'caches':8} {'start':>7} "
            + " ".join(f"{'@' + str(s):>7}" for s in steps)
            + f" {'peak':>7}"
        )
        for r in training:
            print(
                f"{r['precision']:9} {r['caches']:8} {r['start_mib']:7.0f} "
                + " ".join(f"{rss:7.0f}" for _, rss in r["rss_mib"])
                + f" {r['peak_mib']:7.0f}"
            )
    probe_args = [f"--probe-shapes={args.probe_shapes}", f"--probe-width={args.probe_width}"]
    probe = [run_child("probe", capacity, args, probe_args) for capacity in CAPACITIES]
    points = [rows for rows, _ in probe[0]["growth_mib"]]
    print(
        f"oneDNN linear ({probe[0]['dtype']}, {args.probe_width}x{args.probe_width} weight) over distinct row "
        f"counts: RSS growth in MiB; bounded = {ONEDNN_CACHE_CAPACITY} entries a cache"
    )
    print(f"{'caches':8} " + " ".join(f"{rows:>6}" for rows in points))
    for r in probe:
        print(f"{r['caches']:8} " + " ".join(f"{growth:6.0f}" for _, growth in r["growth_mib"]))
    native, why = native_bf16(torch.device("cpu"))
    write_json(
        args.json,
        {
            "command": " ".join(["python", "scripts/bench_memory.py", *sys.argv[1:]]),
            "cpu": cpu_description(),
            "native_bf16": native,
            "native_bf16_why": why,
            "torch": torch.__version__,
            "bounded_capacity": ONEDNN_CACHE_CAPACITY,
            "config": args.config,
            "set": args.set,
            "threads": args.threads,
            "training": training,
            "probe": probe,
        },
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
