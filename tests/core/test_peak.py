"""The peak MFU divides by (peak.py) on a CPU: a probe taken on a busy machine is told from a slow CPU by the CPU's
class; an MFU above 100 % is never reported; the probe's rounds. A GPU's (its datasheet, train.peak_tflops first):
tests/integration/test_cuda_paths.py, with the other CUDA paths."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from transformer import peak as peak_module
from transformer.peak import Peak, mfu_peak

ZEN4 = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16\n"


def cpuinfo(tmp_path, text: str, mhz: str = "3700.000", siblings: int = 2, cores: int = 2) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"{text}cpu MHz\t\t: {mhz}\nsiblings\t: {siblings}\ncpu cores\t: {cores}\n")
    return path


def test_a_cpus_class_is_cores_times_clock_times_its_flop_per_cycle(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    zen4, no_file = cpuinfo(tmp_path, ZEN4), tmp_path / "no_max_freq"
    tflops, how = peak_module.cpu_class_tflops("bf16", 2, zen4, no_file)
    assert (
        tflops == pytest.approx(2 * 3.7e9 * 64 / 1e12)
        and how == "2 core(s) x 3.70 GHz x 64 bf16 FLOP/cycle (AVX512-BF16)"
    )
    assert peak_module.cpu_class_tflops("fp32", 8, zen4, no_file)[0] == pytest.approx(4 * 3.7e9 * 32 / 1e12)
    (tmp_path / "max").write_text("4100000\n")  # kHz, where the kernel says: the clock's maximum, not the current one
    assert peak_module.cpu_class_tflops("fp32", 1, zen4, tmp_path / "max")[0] == pytest.approx(4.1e9 * 32 / 1e12)
    two_per_core = cpuinfo(tmp_path, ZEN4, siblings=4, cores=2)  # 4 logical CPUs are 2 cores' vector units
    assert peak_module.cpu_class_tflops("fp32", 4, two_per_core, no_file)[0] == pytest.approx(2 * 3.7e9 * 32 / 1e12)
    amx = cpuinfo(tmp_path, ZEN4.replace("avx512_bf16", "avx512_bf16 amx_bf16"))
    assert peak_module.cpu_class_tflops("bf16", 1, amx, no_file)[1].endswith("512 bf16 FLOP/cycle (AMX)")
    avx2 = cpuinfo(tmp_path, ZEN4.replace(" avx512f avx512_bf16", ""))
    assert peak_module.cpu_class_tflops("bf16", 1, avx2, no_file) is None  # emulated bf16: no class
    assert peak_module.cpu_class_tflops("fp32", 1, tmp_path / "missing", no_file) is None


@pytest.mark.parametrize(
    "readings, tflops, source",
    [
        ([0.405], 0.405, "measured: the best bf16 matmul rate on cpu of 1 probe; this CPU's class: 0.474"),
        ([0.108, 0.11, 0.398], 0.398, "measured: the best bf16 matmul rate on cpu of 3 probes; this CPU's class"),
        (
            [0.108, 0.11, 0.09],
            0.4736,
            "this CPU's class: 2 core(s) x 3.70 GHz x 64 bf16 FLOP/cycle (AVX512-BF16); "
            "3 probes read at most 0.11 TFLOP/s, under 25% of it: the machine was busy",
        ),
    ],
    ids=["a quiet machine", "busy at first", "busy throughout"],
)
def test_the_cpu_peak_does_not_depend_on_the_load_at_start(monkeypatch, readings, tflops, source):
    """A probe on a machine busy at that moment read 0.108 TFLOP/s for a CPU that does 0.405 (AMD EPYC Zen 4, bf16),
    and every MFU line was 3.7x too high. Stand-ins for the probe and /proc/cpuinfo: probes are repeated while they
    read under a quarter of the CPU's class, and where they all do, the class is the peak; the source says which."""
    probes = iter(readings)
    monkeypatch.setattr(peak_module, "matmul_tflops", lambda device, precision: next(probes))
    monkeypatch.setattr(
        peak_module,
        "cpu_class_tflops",
        lambda precision, threads: (0.4736, "2 core(s) x 3.70 GHz x 64 bf16 FLOP/cycle (AVX512-BF16)"),
    )
    monkeypatch.setattr(peak_module.time, "sleep", lambda seconds: None)
    peak = mfu_peak(torch.device("cpu"), "bf16")
    assert peak.tflops == pytest.approx(tflops) and peak.source.startswith(source), peak.source
    assert next(probes, None) is None  # every reading was taken: none more than needed


def test_an_mfu_above_100_percent_is_never_reported():
    probe = iter([12.0, 11.0])
    measured = Peak(10.0, "measured", lambda: next(probe))
    assert measured.utilisation(5.0) == (0.5, None)
    mfu, note = measured.utilisation(11.0)  # beyond the start-up probe: measured again, higher
    assert mfu == 11.0 / 12.0 and measured.tflops == 12.0 and "measured again" in note
    mfu, note = measured.utilisation(13.0)  # beyond the new measurement too: the rate reached is the peak
    assert mfu == 1.0 and measured.tflops == 13.0 and "raised to the rate training reached" in note
    given = Peak(1.0, "train.peak_tflops")
    assert given.utilisation(4.0)[0] == 1.0 and given.tflops == 4.0


def test_the_probe_takes_the_best_of_rounds_over_the_time_given():
    start = time.perf_counter()
    rate = peak_module.matmul_tflops(torch.device("cpu"), "fp32", size=64, repeats=2, seconds=0.3)
    assert rate > 0 and time.perf_counter() - start >= 0.3
