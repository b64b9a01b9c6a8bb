"""Devices: which one to run on, whether it computes bf16 natively, the training precision `auto` picks, and the
matmul rate that model FLOPs utilisation (MFU) divides by."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from transformer.errors import UserError

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def pick_device(name: str, setting: str = "--device") -> torch.device:
    """auto, cpu or cuda -> the device; `setting` names where the choice came from, for the error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{setting} is 'cuda' but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise UserError(f"{setting} must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def _cpuinfo_fields(cpuinfo: str | Path) -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo, and how many processors it lists ("processors");
    empty where there is none to read."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    processors = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            processors += 1
        if key and processors <= 1:
            fields.setdefault(key, value.strip())
    fields["processors"] = str(processors)
    return fields


def cpu_bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str]:
    """The native bf16 instruction sets this CPU reports (avx512_bf16, amx_bf16); none where it reports none
    or there is no /proc/cpuinfo to read. Without them torch emulates bf16 matmuls, far slower than fp32."""
    flags = set(_cpuinfo_fields(cpuinfo).get("flags", "").split())
    return [f for f in NATIVE_BF16_FLAGS if f in flags]


def cpu_description(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """Which CPU a benchmark ran on, for its JSON: machines that share a model name ("AMD EPYC") differ in
    generation (family/model), vector units and cache, and so in speed ratios against other engines. The cache
    size is what /proc/cpuinfo reports (per core L2 on AMD, L3 on Intel)."""
    fields = _cpuinfo_fields(cpuinfo)
    if not fields.get("flags"):
        return {}
    flags = set(fields["flags"].split())
    return {"model_name": fields.get("model name"), "family": fields.get("cpu family"), "model": fields.get("model"),
            "processors": int(fields["processors"]), "cache_size": fields.get("cache size"),
            "flags": [f for f in ("avx2", "avx512f", *NATIVE_BF16_FLAGS) if f in flags]}


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether this device runs bf16 matmuls in hardware, and why, in words for the log."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "this CUDA device supports bf16"
        return False, "this CUDA device has no native bf16"
    flags = cpu_bf16_flags()
    if flags:
        return True, f"this CPU has {'/'.join(flags)}"
    return False, "this CPU has no native bf16 (no avx512_bf16 or amx_bf16)"


def auto_precision(device: torch.device) -> tuple[str, str]:
    """What `auto` means for training and for translation: (bf16 where the hardware has it, else fp32, why)."""
    native, why = native_bf16(device)
    return ("bf16" if native else "fp32"), f"auto: {why}"


def pick_precision(name: str, device: torch.device) -> tuple[str, str]:
    """Training precision -> (fp32|bf16|fp16, why). `auto`: bf16 autocast where the hardware has it, else fp32."""
    if name != "auto":
        if name == "fp16" and device.type != "cuda":
            raise UserError("train.precision 'fp16' needs CUDA; use 'bf16' or 'fp32' on CPU")
        return name, "train.precision"
    return auto_precision(device)


def autocast_context(device: torch.device, precision: str):
    """Mixed precision for the forward pass and loss (bf16/fp16 autocast); fp32 runs as it is."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def matmul_tflops(device: torch.device, precision: str, size: int = 0, repeats: int = 5) -> float:
    """The dense matmul rate this device reaches in `precision` (TFLOP/s), measured with square matmuls:
    the peak that MFU divides by when train.peak_tflops does not give one. About a second on a CPU."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    n = size or (8192 if device.type == "cuda" else 1024)
    generator = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG streams alone
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12
