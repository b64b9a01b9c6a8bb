"""Devices: which one to run on (a CUDA device always with its index), whether it computes bf16 natively, the
training precision `auto` picks, the CUDA settings a run starts with (TF32 matmuls, the allocator), the bound on
oneDNN's CPU caches (the peak rate that model FLOPs utilisation divides by: peak.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from transformer.errors import UserError

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Overrides what the CPU's flags say about native bf16: 1 or 0. For a virtual machine whose /proc/cpuinfo hides
# the flags, and for running the test suite as it runs on a CPU of the other kind (`TRANSFORMER_NATIVE_BF16=1
# make test` on an AVX2 machine: `auto` picks bf16 everywhere, emulated and slower, but the same code paths).
NATIVE_BF16_VARIABLE = "TRANSFORMER_NATIVE_BF16"


def device_type(name: str, setting: str = "--device") -> str:
    """auto, cpu or cuda -> "cuda" or "cpu", without touching a GPU; `setting` names where the choice came
    from, for the error."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{setting} is 'cuda' but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise UserError(f"{setting} must be auto, cpu or cuda, got {name!r}")
    return name


def pick_device(name: str, setting: str = "--device") -> torch.device:
    """auto, cpu or cuda -> the device. A CUDA device comes with its index (the current device, cuda:0 unless
    the process chose another): torch.cuda.set_device, which a thread needs to work on the same GPU, refuses
    a device without one ("Expected a torch.device with a specified index")."""
    kind = device_type(name, setting)
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, the current one where `device` names none: resolved in the calling thread
    (the current device is per thread), for handing to another."""
    return device.index if device.index is not None else torch.cuda.current_device()


def cpuinfo_fields(cpuinfo: str | Path) -> dict[str, str]:
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
    flags = set(cpuinfo_fields(cpuinfo).get("flags", "").split())
    return [f for f in NATIVE_BF16_FLAGS if f in flags]


def mkl_without_avx512(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AVX512 that MKL leaves unused: one not made by Intel (AMD Zen 4 and 5). MKL picks its
    kernels by vendor and runs AVX2 ones there, while oneDNN runs AVX512 wherever the CPU has it: on an AMD EPYC
    with AVX512 oneDNN's fp32 product is the faster for every layer of a decoding step, at any row count
    (docs/benchmarks/log.md, "Sixth session of 2026-11-28"). On AVX2-only CPUs the two are even, and MKL the
    faster at a step's few rows."""
    fields = cpuinfo_fields(cpuinfo)
    return "avx512f" in fields.get("flags", "").split() and fields.get("vendor_id") != "GenuineIntel"


def cpu_description(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """Which CPU a benchmark ran on, for its JSON: machines that share a model name ("AMD EPYC") differ in
    generation (family/model), vector units and cache, and so in speed ratios against other engines. The cache
    size is what /proc/cpuinfo reports (per core L2 on AMD, L3 on Intel)."""
    fields = cpuinfo_fields(cpuinfo)
    if not fields.get("flags"):
        return {}
    flags = set(fields["flags"].split())
    return {
        "model_name": fields.get("model name"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "processors": int(fields["processors"]),
        "cache_size": fields.get("cache size"),
        "flags": [f for f in ("avx2", "avx512f", *NATIVE_BF16_FLAGS) if f in flags],
    }


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether this device runs bf16 matmuls in hardware, and why, in words for the log."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "this CUDA device supports bf16"
        return False, "this CUDA device has no native bf16"
    forced = os.environ.get(NATIVE_BF16_VARIABLE, "")
    if forced:
        if forced not in ("0", "1"):
            raise UserError(f"{NATIVE_BF16_VARIABLE} must be 1 (this CPU has native bf16) or 0, got {forced!r}")
        return forced == "1", f"{NATIVE_BF16_VARIABLE}={forced}"
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


# --------------------------------------------------------------------------- CUDA settings of a run

ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: torch >= 2.9's name
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def default_cuda_allocator(environ: dict | None = None) -> bool:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set either allocator variable, or CUDA
    has allocated already (the allocator reads it once, at its first allocation). Every training batch has another
    shape: with fixed-size segments the cached blocks fragment and reserved memory climbs far above what is in use
    (out of memory with half the GPU free); expandable segments grow one mapping instead. Returns whether it set
    it. Called first thing by the command line and by train()."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in ALLOC_CONF_VARIABLES) or torch.cuda.is_initialized():
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOC_CONF
    return True


# oneDNN keeps every primitive it built, one per operation and shape, in two caches of 1,024 entries each (its
# own, and ideep's in torch), so memory grows with every shape it meets, and a bounded cache keeps a small part
# of that. Where torch runs matmuls through oneDNN (bf16 on a CPU with avx512_bf16 or AMX, our packed bf16
# translation), every new batch shape adds primitives that are rarely used again: `make train` in bf16 grew to
# about twice fp32's (MKL) memory (docs/training.md, "Memory in training: oneDNN's caches"). 64 entries hold every
# shape of one update and of a decoder step.
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARIABLES = (
    ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),  # oneDNN's, old name
    ("LRU_CACHE_CAPACITY",),
)  # ideep's (torch)


def bounded_onednn_caches(environ: dict | None = None) -> list[str]:
    """Set each oneDNN primitive cache's capacity to ONEDNN_CACHE_CAPACITY unless the user set it (by either of
    its names): each is read once, when the first primitive is built, so this must run before any CPU work (torch
    may be imported already). Returns the variables it set. Called first thing by the command line, by train()
    and by Translator (translate, evaluate, serve)."""
    environ = os.environ if environ is None else environ
    added = []
    for names in ONEDNN_CACHE_VARIABLES:
        if not any(name in environ for name in names):
            environ[names[0]] = str(ONEDNN_CACHE_CAPACITY)
            added.append(names[0])
    return added


@contextlib.contextmanager
def tf32_matmuls(device: torch.device) -> Iterator[None]:
    """Inside the block, fp32 matrix products on a CUDA device run on tensor cores in TF32 (Ampere and newer:
    inputs rounded to 10 mantissa bits, fp32 accumulation), about 8x the plain fp32 rate: for training in
    `precision: fp32`, validation and the end of training, whose results do not hang on fp32's last bits. torch
    leaves it off by default; translation keeps it off (`--dtype fp32` means full fp32; bf16 is the fast path).
    The flag is put back after the block; nothing changes on a CPU, or where the user chose through torch's newer
    setting (torch.backends.cuda.matmul.fp32_precision), which this one may not be mixed with."""
    matmul = torch.backends.cuda.matmul
    try:
        # The older flag: torch.compile's caches still read it, and they raise once the two settings disagree.
        before = matmul.allow_tf32 if device.type == "cuda" else None
    except RuntimeError:  # the user set fp32_precision: theirs stands
        before = None
    if before is None:
        yield
        return
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def cuda_memory_peaks(device: torch.device) -> dict:
    """Peak GPU memory since the start (MiB): what tensors held (allocated) and what the caching allocator took
    from the GPU (reserved, what nvidia-smi shows and what runs out); empty on a CPU."""
    if device.type != "cuda":
        return {}
    return {
        "peak_cuda_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
        "peak_cuda_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
    }
