"""The peak rate that model FLOPs utilisation (MFU) divides by: train.peak_tflops, a GPU's datasheet, or a measured
matmul rate, which on a CPU its class (cores x clock x FLOP per cycle) keeps from reading a busy moment."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.device import cpuinfo_fields, tf32_matmuls

_MAX_KHZ = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"  # absent in most virtual machines

# Dense tensor-core peaks from NVIDIA's datasheets, TFLOP/s, for (bf16 and fp16, TF32): the datasheets print the
# figures "with sparsity", twice these. Matched on torch.cuda.get_device_name(), first match wins.
DATASHEET_TFLOPS = (
    (r"GH200", "GH200", 989.4, 494.7),
    (r"\bH200 NVL", "H200 NVL", 835.5, 417.5),
    (r"\bH200", "H200 SXM", 989.4, 494.7),
    (r"\bH100 NVL", "H100 NVL", 835.5, 417.5),
    (r"\bH100 PCIe", "H100 PCIe", 756.5, 378.0),
    (r"\bH100\b.*(HBM3|SXM)", "H100 SXM", 989.4, 494.7),
    (r"\bA100\b", "A100", 312.0, 156.0),
    (r"\bL40S\b", "L40S", 362.05, 183.0),
    (r"\bL40\b", "L40", 181.05, 90.5),
    (r"\bL4\b", "L4", 121.0, 60.0),
    (r"\bA10\b", "A10", 125.0, 62.5),
)


def datasheet_tflops(device_name: str, precision: str) -> tuple[float, str] | None:
    """(dense peak TFLOP/s, which datasheet figure) for a GPU by its name, in bf16/fp16 or, for fp32 (which runs
    in TF32 where training enables it), TF32; None for a device not in the table."""
    for pattern, name, half, tf32 in DATASHEET_TFLOPS:
        if re.search(pattern, device_name):
            if precision == "fp32":
                return tf32, f"{name} datasheet, dense TF32"
            return half, f"{name} datasheet, dense {precision}"
    return None


def matmul_tflops(device: torch.device, precision: str, size: int = 0, repeats: int = 3, seconds: float = 0.5) -> float:
    """The dense matmul rate this device reaches in `precision` (TFLOP/s), measured with square matmuls: the best
    of rounds of `repeats` products over about `seconds` (at least one round). The best round, because another
    process (or a busy moment) can only slow a round down: a single short probe at start-up on a busy 2-core CPU
    gave a peak that training then beat. fp32 on CUDA is measured as training runs it, in TF32. On a CPU the
    products are 512 wide: they read a higher rate there than 1024, and bf16 without native instructions,
    emulated, takes a fraction of the time a product of 1024 takes (rounds at 1024 kept a bf16 run waiting for
    its first update)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    n = size or (8192 if device.type == "cuda" else 512)
    generator = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG streams alone
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    best, rounds = float("inf"), 0
    with tf32_matmuls(device):
        for _ in range(2):
            a @ b
        _synchronize(device)
        started = time.perf_counter()
        while rounds < 1 or time.perf_counter() - started < seconds:
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            _synchronize(device)
            best, rounds = min(best, time.perf_counter() - start), rounds + 1
    return 2 * n**3 * repeats / best / 1e12


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Peak:
    """What MFU divides by (TFLOP/s) and where the figure comes from, for the log. A figure above 100 % is never
    reported: before one would be, a measured peak is measured again, and a peak of any source is raised to what
    training reached (a datasheet's is then wrong for this device, or train.peak_tflops is set too low)."""

    tflops: float
    source: str  # where the first figure came from
    measure: Callable[[], float] | None = None  # the probe, for a measured peak
    changed: str = ""  # how it has changed since, if it has

    def describe(self) -> str:
        return f"{self.tflops:.3g} TFLOP/s ({self.source}{'; ' + self.changed if self.changed else ''})"

    def utilisation(self, achieved_tflops: float) -> tuple[float, str | None]:
        """-> (MFU of `achieved_tflops`, at most 1; what changed in the peak, for the log, or None)."""
        if achieved_tflops <= self.tflops:
            return achieved_tflops / self.tflops, None
        before = self.tflops
        if self.measure is not None:
            self.tflops = max(self.tflops, self.measure())
            self.changed = "measured again"
        if achieved_tflops > self.tflops:
            self.tflops = achieved_tflops
            self.changed = "raised to the rate training reached"
        return achieved_tflops / self.tflops, (
            f"training reached {achieved_tflops:.3g} TFLOP/s, above the peak of "
            f"{before:.3g}: MFU from here is against {self.describe()}"
        )


# Dense matmul FLOP per cycle and core that a CPU with these instructions reaches at least, by precision (first
# match wins): two 256-bit FMAs a cycle for fp32 (AVX2; AVX-512 CPUs that split 512-bit work in two, as Zen 4 does,
# reach no more), one 512-bit VDPBF16PS a cycle for AVX512-BF16, half of AMX's 1024 bf16 FLOP. A lower bound on
# purpose: it only tells a probe taken on a busy machine (far below it) from a slow CPU. bf16 without these
# instructions is emulated: no class.
CPU_CLASSES = {
    "fp32": (("avx512f", 32, "AVX-512"), ("fma", 32, "AVX2 FMA")),
    "bf16": (("amx_bf16", 512, "AMX"), ("avx512_bf16", 64, "AVX512-BF16")),
}
FAR_BELOW = 0.25  # a probe under this share of the CPU's class was taken while other work held the cores
PROBES = 3  # at most, while they read far below the class


def cpu_class_tflops(
    precision: str, threads: int, cpuinfo: str | Path = "/proc/cpuinfo", max_khz: str | Path = _MAX_KHZ
) -> tuple[float, str] | None:
    """(the dense matmul rate a CPU of this kind reaches at least with `threads` threads, TFLOP/s; how it was
    reckoned) from /proc/cpuinfo: cores x clock x FLOP per cycle (CPU_CLASSES); None where it cannot be told.
    Threads count as cores up to the physical cores this process may run on (a core's second hardware thread
    shares its vector units); the clock is the maximum the kernel reports, else the one /proc/cpuinfo shows."""
    fields = cpuinfo_fields(cpuinfo)
    flags = set(fields.get("flags", "").split())
    found = next(((flops, name) for flag, flops, name in CPU_CLASSES.get(precision, ()) if flag in flags), None)
    try:
        ghz = int(Path(max_khz).read_text().strip()) / 1e6
    except (OSError, ValueError):
        try:
            ghz = float(fields.get("cpu MHz", "")) / 1e3
        except ValueError:
            return None
    if found is None or ghz <= 0:
        return None
    try:
        per_core = max(1, int(fields["siblings"]) // int(fields["cpu cores"]))
    except (KeyError, ValueError, ZeroDivisionError):
        per_core = 1
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cores = max(1, min(threads, available // per_core))
    flops, name = found
    return (
        cores * ghz * 1e9 * flops / 1e12,
        f"{cores} core(s) x {ghz:.2f} GHz x {flops} {precision} FLOP/cycle ({name})",
    )


def best_of_probes(
    probe: Callable[[], float], floor: float | None, tries: int = PROBES, pause_s: float = 0.2
) -> tuple[float, int]:
    """(the best reading of `probe`, how many were taken): one, and more (up to `tries`, `pause_s` apart) while the
    best reads below `floor`: a busy moment at start-up should not become the run's peak."""
    best, taken = probe(), 1
    while floor is not None and best < floor and taken < tries:
        time.sleep(pause_s)
        best, taken = max(best, probe()), taken + 1
    return best, taken


def mfu_peak(device: torch.device, precision: str, configured: float = 0.0) -> Peak:
    """The peak for MFU: train.peak_tflops when set; else the datasheet's dense peak of a known GPU in this precision
    (TF32 for fp32); else measured with matmul_tflops: on a CPU the best of up to PROBES probes, and where even that
    reads under FAR_BELOW of the CPU's class (cpu_class_tflops; another process held the cores: a probe read a
    fraction of the CPU's rate, and every MFU line was several times too high), the class's own figure. The source
    says which, for the log."""
    if configured:
        return Peak(configured, "train.peak_tflops")
    if device.type == "cuda":
        found = datasheet_tflops(torch.cuda.get_device_name(device), precision)
        if found is not None:
            return Peak(found[0], found[1])

    def measure() -> float:
        return matmul_tflops(device, precision)

    known = cpu_class_tflops(precision, torch.get_num_threads()) if device.type == "cpu" else None
    best, taken = best_of_probes(measure, known[0] * FAR_BELOW if known else None)
    probes = f"{taken} probe{'s' if taken > 1 else ''}"
    if known is not None and best < known[0] * FAR_BELOW:
        return Peak(
            known[0],
            f"this CPU's class: {known[1]}; {probes} read at most {best:.3g} TFLOP/s, under {FAR_BELOW:.0%} of it: "
            "the machine was busy",
            measure,
        )
    about = f"; this CPU's class: {known[0]:.3g}" if known is not None else ""
    return Peak(best, f"measured: the best {precision} matmul rate on {device} of {probes}{about}", measure)
