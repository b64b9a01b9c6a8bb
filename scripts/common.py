"""What more than one script needs: waiting for the GPU before a clock is read, a process's resident memory,
CTranslate2 called as its users call it, passes timed in interleaved rounds, an operator profile, and the JSON a
script writes.

The scripts run as `python scripts/NAME.py`, which puts this folder first on the import path, so they import it as
`from common import sync`; they do not import one another. It imports no torch at module level: bench_memory's
parent process does not load it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def sync(device) -> None:
    """Wait for the work queued on a CUDA device (nothing to wait for on a CPU), so that a clock read next counts
    it."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def rss_mib(pid: int | str = "self", field: str = "VmRSS") -> float:
    """Resident memory of a process (Linux /proc; "self": this one), in MiB; field="VmHWM": its peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ctranslate2_pieces(vocab, src_ids, max_positions: int) -> list[list[str]]:
    """CTranslate2 itself's input: the sources as SentencePiece pieces, cut where our engines cut them (the model
    has no positions beyond)."""
    from transformer.data.batch import source_limit

    return [vocab.pieces(ids[: source_limit(max_positions)]) for ids in src_ids]


def ctranslate2_itself(
    translator, vocab, pieces, settings, max_positions: int, max_batch_size: int, batch_type: str
) -> list[list[int]]:
    """CTranslate2 as its users call it: one `translate_batch` over `pieces` (ctranslate2_pieces) in batches of
    max_batch_size (batch_type "tokens" or "examples"), with settings' beam and length penalty and
    max_decoding_length = max_positions - 1, nothing else set -> the best output's ids per source. The row of
    that name in bench_decode and bench_serve."""
    results = translator.translate_batch(
        pieces,
        beam_size=settings.beam,
        length_penalty=settings.lenpen,
        max_batch_size=max_batch_size,
        batch_type=batch_type,
        max_decoding_length=max_positions - 1,
    )
    return [vocab.piece_ids(r.hypotheses[0]) for r in results]


def write_json(path, record: dict) -> None:
    """A script's results as indented JSON at `path`."""
    Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def interleaved(passes: dict, rounds: int, warm: bool = True) -> dict[str, list[float]]:
    """One untimed call of each pass (warm=False: the caller made it), then `rounds` rounds timing each once; order
    reversed every other round, so that neither the first nor the last place of a round favours one pass."""
    if warm:
        for run in passes.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in passes}
    for r in range(rounds):
        for name in list(passes) if r % 2 == 0 else list(reversed(passes)):
            start = time.perf_counter()
            passes[name]()
            times[name].append(time.perf_counter() - start)
    return times


def operator_profile(run, top: int, device) -> dict:
    """One call of `run` under torch.profiler: its wall time and its `top` operators by self time, on the host (CPU
    time) and, on a CUDA device, on the GPU (kernel time) with the share of the wall the GPU was busy: a GPU idle for
    much of the wall waits on the host (Python, the launch of small kernels, syncs), which a faster kernel will not
    fix."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()

    def table(kind, time_of) -> tuple[list[dict], float]:
        rows = sorted((e for e in events if e.device_type == kind and time_of(e) > 0), key=time_of, reverse=True)
        total = sum(time_of(e) for e in rows) / 1e6
        return [
            {"op": e.key, "self_s": time_of(e) / 1e6, "share": time_of(e) / 1e6 / (total or 1.0), "calls": e.count}
            for e in rows[:top]
        ], total

    host, host_s = table(DeviceType.CPU, lambda e: e.self_cpu_time_total)
    record = {"device": str(device), "torch": torch.__version__, "wall_s": wall, "host_s": host_s, "host": host}
    if cuda:
        # The kernels themselves, not the operators that launched them (those carry the same time again); one
        # stream, so their sum is the time the GPU was busy.
        gpu, busy_s = table(DeviceType.CUDA, lambda e: e.self_device_time_total)
        record.update(gpu=gpu, gpu_busy_s=busy_s, gpu_busy_share=busy_s / wall if wall else 0.0)
    return record


def print_profile(record: dict, what: str) -> None:
    """An operator_profile as tables: the GPU's kernels first where there are any, then the host's operators."""

    def table(title: str, heading: str, rows: list[dict]) -> None:
        print(title)
        print(f"{heading:60} {'self s':>8} {'share':>6} {'calls':>7}")
        for op in rows:
            print(f"{op['op'][:60]:60} {op['self_s']:8.4f} {op['share']:6.1%} {op['calls']:7d}")

    print(f"{what}, one call under torch.profiler on {record['device']}: {record['wall_s']:.3f} s wall")
    if "gpu" in record:
        busy = f"GPU busy {record['gpu_busy_s']:.3f} s = {record['gpu_busy_share']:.1%} of the wall"
        table(f"{busy}; its {len(record['gpu'])} kernels with the most time:", "kernel", record["gpu"])
    table(
        f"host: {len(record['host'])} operators with the most self CPU time (of {record['host_s']:.3f} s):",
        "operator",
        record["host"],
    )
