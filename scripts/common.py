"""What more than one script needs: waiting for the GPU before a clock is read, a process's resident memory,
CTranslate2 called as its users call it, passes timed in interleaved rounds, and the JSON a script writes.

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
