"""Which scaled_dot_product_attention kernel serves each of the model's attention calls, how fast it is, and how
close it comes to the math kernel. Prints a table and writes JSON.

    python scripts/check_sdpa.py [--device cuda] [--json sdpa.json]

The calls (q/k/v shaped as the model shapes them, (B, H, T, Dh)): encoder self-attention and cross-attention
(key padding over sources of length S), decoder self-attention in a teacher-forced pass (right-padded targets of
length T), and a decoding step's cross-attention (one query per row). Each with its mask in the forms the model
has passed: boolean (until issue 32), additive (batch.attention_bias: built once per forward, in the queries'
dtype, rows aligned to 8) and, for decoder self-attention, is_causal with no mask tensor (batch.CAUSAL).

Per call and mask: the kernel torch picks (torch._fused_sdp_choice) with dropout 0.1, as in training, and 0, as
in validation and search; forward + backward ms with dropout 0.1; the largest difference of the output and of the
q/k/v gradients from the math kernel with the boolean mask at dropout 0, over real (not padded) query positions,
the only ones the model scores. Then each backend forced alone (sdpa_kernel) at dropout 0, timed: a backend that
cannot serve the call raises and shows as unsupported.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import sync, write_json
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.data.batch import CAUSAL, attention_bias, padding_mask, target_mask
from transformer.data.vocab import PAD_ID

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
KERNEL_NAMES = {int(value): name.lower() for name, value in SDPBackend.__members__.items()}
TRAIN_DROPOUT = 0.1


def timed(fn, device, reps: int) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def sdpa(q, k, v, mask, dropout: float):
    """The call as the model makes it: CAUSAL -> is_causal with no mask tensor."""
    causal = mask is CAUSAL
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if causal else mask, dropout_p=dropout, is_causal=causal
    )


def kernel(q, k, v, mask, dropout: float) -> str:
    """The backend torch picks for this call (what the default SDPA runs)."""
    causal = mask is CAUSAL
    return KERNEL_NAMES.get(int(torch._fused_sdp_choice(q, k, v, None if causal else mask, dropout, causal)), "?")


def forward_backward(q, k, v, mask, dropout: float, grad_out: torch.Tensor):
    """(output, q/k/v gradients) of one call."""
    for t in (q, k, v):
        t.grad = None
    out = sdpa(q, k, v, mask, dropout)
    out.backward(grad_out)
    return out.detach(), [t.grad.detach().clone() for t in (q, k, v)]


def calls(b: int, h: int, t: int, s: int, d: int, device, dtype) -> list[dict]:
    """The model's attention calls with their masks in every form: q/k/v, the masks, and the query positions
    that are real (the rest are padding, never scored)."""

    def qkv(tq: int, tk: int):
        return [torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True) for n in (tq, tk, tk)]

    src_len = torch.randint(s // 2, s + 1, (b,), device=device)
    tgt_len = torch.randint(t // 2, t + 1, (b,), device=device)
    src = torch.where(torch.arange(s, device=device)[None, :] < src_len[:, None], 4, PAD_ID)  # (B, S) right-padded
    tgt = torch.where(torch.arange(t, device=device)[None, :] < tgt_len[:, None], 4, PAD_ID)  # (B, T)
    src_mask, tgt_mask = padding_mask(src), target_mask(tgt)
    src_forms = {"boolean": src_mask, "additive": attention_bias(src_mask, dtype)}
    real_src, real_tgt = (src != PAD_ID)[:, None, :, None], (tgt != PAD_ID)[:, None, :, None]  # (B, 1, T, 1)
    return [
        {"call": "encoder self-attention", "qkv": qkv(s, s), "masks": src_forms, "real": real_src},
        {
            "call": "decoder self-attention",
            "qkv": qkv(t, t),
            "real": real_tgt,
            "masks": {"boolean": tgt_mask, "additive": attention_bias(tgt_mask, dtype), "is_causal": CAUSAL},
        },
        {"call": "cross-attention", "qkv": qkv(t, s), "masks": src_forms, "real": real_tgt},
        {
            "call": "decoding step, cross-attention",
            "qkv": qkv(1, s),
            "masks": src_forms,
            "real": torch.ones(b, 1, 1, 1, dtype=torch.bool, device=device),
        },
    ]


def measure(call: dict, device, reps: int) -> list[dict]:
    q, k, v = call["qkv"]
    grad_out = torch.randn_like(q) * call["real"]  # no gradient flows from padded query positions
    reference_mask = call["masks"]["boolean"]
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out, ref_grads = forward_backward(q, k, v, reference_mask, 0.0, grad_out)
    rows = []
    for form, mask in call["masks"].items():
        out, grads = forward_backward(q, k, v, mask, 0.0, grad_out)
        real = call["real"].expand_as(out)
        row = {
            "call": call["call"],
            "mask": form,
            "kernel_train": kernel(q, k, v, mask, TRAIN_DROPOUT),
            "kernel_eval": kernel(q, k, v, mask, 0.0),
            "ms": timed(lambda: forward_backward(q, k, v, mask, TRAIN_DROPOUT, grad_out), device, reps) * 1e3,
            "max_diff_out": float((out - ref_out)[real].abs().max()),
            "max_diff_grad": max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)),
            "backends": {},
        }
        for name, backend in BACKENDS.items():
            try:
                with sdpa_kernel([backend]):
                    row["backends"][name] = (
                        timed(lambda: forward_backward(q, k, v, mask, 0.0, grad_out), device, reps) * 1e3
                    )
            except RuntimeError:  # this backend cannot serve the call
                row["backends"][name] = None
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: bf16 on CUDA, fp32 on a CPU")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=48, help="target length T")
    ap.add_argument("--src-length", type=int, help="source length S (default: T + 5, not a multiple of 8)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    torch.manual_seed(args.seed)
    b, h, t, d = args.batch, args.heads, args.length, args.head_dim
    s = args.src_length or t + 5
    print(f"device {device}, {name}, B {b}, H {h}, T {t}, S {s}, Dh {d}, torch {torch.__version__}")
    print(
        f"{'call':32} {'mask':10} {'kernel (train)':>15} {'(eval)':>10} {'fwd+bwd ms':>11} {'|out-math|':>11} "
        f"{'|grad-math|':>12}  forced backends, ms"
    )
    rows = []
    for call in calls(b, h, t, s, d, device, dtype):
        for row in measure(call, device, args.reps):
            rows.append(row)
            forced = ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in row["backends"].items())
            print(
                f"{row['call']:32} {row['mask']:10} {row['kernel_train']:>15} {row['kernel_eval']:>10} "
                f"{row['ms']:11.3f} {row['max_diff_out']:11.2e} {row['max_diff_grad']:12.2e}  {forced}"
            )
    if args.json:
        write_json(
            args.json,
            {
                "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "dtype": name,
                "shape": {"batch": b, "heads": h, "tgt_len": t, "src_len": s, "head_dim": d},
                "dropout_train": TRAIN_DROPOUT,
                "reps": args.reps,
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
