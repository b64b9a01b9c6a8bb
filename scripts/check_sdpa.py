"""Which scaled_dot_product_attention kernels can run our attention calls, and how fast each is.

    python scripts/check_sdpa.py [--device cuda] [--json sdpa.json]

For the three masks the model passes (encoder: key padding (B,1,1,S); decoder self-attention:
causal & padding (B,1,T,T); incremental decoding: none), each SDPA backend is forced alone with
torch.nn.attention.sdpa_kernel; a backend that cannot serve the call raises, which is reported as
"unsupported". The default (no forcing) is timed too, so its time shows which kernel it picks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.batch import padding_mask, target_mask
from transformer.vocab import PAD_ID

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def timed(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, t, d = args.batch, args.heads, args.length, args.head_dim
    q, k, v = (torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    lengths = torch.randint(t // 2, t + 1, (b,), device=device)
    ids = torch.where(torch.arange(t, device=device)[None, :] < lengths[:, None], 4, PAD_ID)  # (B, T): padded rows
    masks = {"encoder (padding)": padding_mask(ids), "decoder (causal & padding)": target_mask(ids),
             "no mask": None}
    print(f"device {device}, {dtype}, q/k/v {tuple(q.shape)}, torch {torch.__version__}")
    print(f"{'mask':28} {'backend':10} {'fwd+bwd ms':>11}")
    rows = []
    for mask_name, mask in masks.items():
        for name, backend in [("default", None)] + list(BACKENDS.items()):
            def step():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out.sum().backward()
            try:
                if backend is None:
                    ms = timed(step, device, args.reps) * 1e3
                else:
                    with sdpa_kernel([backend]):
                        ms = timed(step, device, args.reps) * 1e3
                shown = f"{ms:11.3f}"
            except RuntimeError:
                ms, shown = None, f"{'unsupported':>11}"
            rows.append({"mask": mask_name, "backend": name, "ms": ms})
            print(f"{mask_name:28} {name:10} {shown}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "shape": [b, h, t, d],
            "reps": args.reps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
