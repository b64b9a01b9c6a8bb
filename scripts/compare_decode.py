#!/usr/bin/env python
"""Our search at several revisions of the package, timed in one process with the runs interleaved: for
before/after figures on a machine whose speed drifts between processes (this project's 2-core CPUs: the same
setting measured 1.3 s in one process and 1.9 s in the next).

    python scripts/compare_decode.py data/multi30k/test.de --checkpoint runs/multi30k --rev 2ebcc63 --rev . \
        [--beam 4] [--stop early] [--dtype fp32] [--limit 500] [--max-tokens N] [--workers 1] [--rounds 5] \
        [--threads 2] [--json out.json]

Each --rev is a git revision, "." for the working tree, or a folder holding a `transformer/` package (for a
machine without the repository's history: `git archive REV transformer | tar -x -C DIR` makes one). Its
`transformer/` is copied to a temporary folder as a package of another name (t_0, t_1, ...; the package imports only itself by absolute imports), so every
revision loads side by side; then round after round, each revision translates the same sentences once.
Reported per revision: the fastest and the median pass, the median of its per-round time ratio to the first
revision (paired rounds: drift cancels), and whether its outputs equal the first revision's.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import write_json

from transformer.data.corpus import read_lines
from transformer.device import cpu_description
from transformer.inference.settings import STOP_RULES

ROOT = Path(__file__).resolve().parent.parent


def package_copy(rev: str, name: str, into: Path) -> None:
    """`transformer/` at `rev` ("." = working tree, or a folder that holds one) as package `name` under `into`."""
    target = into / name
    folder = ROOT if rev == "." else Path(rev)
    if (folder / "transformer" / "__init__.py").is_file():
        shutil.copytree(folder / "transformer", target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "transformer"], capture_output=True)
        if archive.returncode != 0:
            sys.exit(f"compare_decode: git archive {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
        (into / "transformer").rename(target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(from|import) transformer\b", rf"\1 {name}", text))


def load_package(name: str, into: Path) -> None:
    """The copy `into/name` imported as package `name`, its submodules found under it, without putting `into` on
    the import path."""
    spec = importlib.util.spec_from_file_location(
        name, into / name / "__init__.py", submodule_search_locations=[str(into / name)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_set", help="source sentences, one per line")
    ap.add_argument("--checkpoint", required=True, help="run directory or .pt file")
    ap.add_argument(
        "--rev",
        action="append",
        required=True,
        help="git revision, . for the working tree, or a folder holding transformer/",
    )
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--stop", default="exact", choices=STOP_RULES)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--lenpen", type=float, default=None, help="default: the checkpoint's decode.lenpen")
    ap.add_argument("--limit", type=int, default=500, help="first N sentences (0 = all)")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="source tokens per batch (default: decode.max_tokens; 1: one sentence at a time, for latency)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="searches side by side (decode.workers; revisions from a38a639 on); default 1",
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed passes per revision, interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: every revision searches there")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    return ap


def revision_search(i: int, rev: str, tmp: Path, args, lines: list[str]):
    """Revision `rev` unpacked as the package t_i -> a function that searches the sentences with it (its search
    settings as objects, or as the separate values of revisions before them)."""
    package_copy(rev, f"t_{i}", tmp)
    load_package(f"t_{i}", tmp)
    try:  # the translator's module since the subpackages (issue 34), then before them
        translate = importlib.import_module(f"t_{i}.inference.translator")
    except ModuleNotFoundError:
        translate = importlib.import_module(f"t_{i}.translate")
    try:  # the search settings as objects since they got one owner (issue 34), separate values before
        settings = importlib.import_module(f"t_{i}.inference.settings")
    except ModuleNotFoundError:
        settings = None
    if settings is not None:
        tr = translate.Translator(args.checkpoint, args.device, settings.SearchFlags(dtype=args.dtype))
    else:
        tr = translate.Translator(args.checkpoint, device=args.device, dtype=args.dtype)
    src = tr.vocab.encode(lines)
    dec = tr.cfg.decode
    lenpen = dec.lenpen if args.lenpen is None else args.lenpen

    max_tokens = args.max_tokens or dec.max_tokens
    if settings is not None:
        chosen = settings.SearchSettings(
            beam=args.beam,
            lenpen=lenpen,
            stop=args.stop,
            max_len_offset=dec.max_len_offset,
            max_tokens=max_tokens,
            workers=args.workers,
        )

        # search_ids: in inference/batched.py since the translator held one concept, in translator.py before
        batches = getattr(translate, "search_ids", None) and translate
        batches = batches or importlib.import_module(f"t_{i}.inference.batched")

        def run(batches=batches, tr=tr, src=src, chosen=chosen):
            return batches.search_ids(tr.model, src, chosen, torch.device(args.device))
    else:

        def run(translate=translate, tr=tr, src=src, lenpen=lenpen, dec=dec, max_tokens=max_tokens):
            # workers only when asked: revisions before decode.workers (a38a639) do not take it
            side_by_side = {"workers": args.workers} if args.workers > 1 else {}
            return translate.search_ids(
                tr.model,
                src,
                args.beam,
                lenpen,
                dec.max_len_offset,
                max_tokens,
                torch.device(args.device),
                1,
                args.stop,
                **side_by_side,
            )

    return run


def report(args, lines: list[str], times: list[list[float]], outputs: list) -> None:
    """Each revision's times against the first's, round by round, and its outputs; --json too."""
    rows = []
    print(
        f"{len(lines)} sentences, beam {args.beam}, stop {args.stop}, {args.dtype}, {args.rounds} rounds, "
        f"max tokens {args.max_tokens or 'decode.max_tokens'}, {args.workers} worker(s)"
    )
    print(f"{'revision':>12} {'min s':>7} {'median s':>9} {'time / first':>13} {'same outputs':>13}")
    for rev, ts, out in zip(args.rev, times, outputs):
        ratio = statistics.median(a / b for a, b in zip(ts, times[0]))
        same = sum(a == b for a, b in zip(out, outputs[0])) / len(out) if out else 1.0
        rows.append(
            {
                "rev": rev,
                "times_s": ts,
                "min_s": min(ts),
                "median_s": statistics.median(ts),
                "time_vs_first": ratio,
                "same_outputs_as_first": same,
            }
        )
        print(f"{rev:>12} {min(ts):7.3f} {statistics.median(ts):9.3f} {ratio:12.3f}x {same:12.1%}")
    if args.json:
        write_json(
            args.json,
            {
                "test_set": args.test_set,
                "checkpoint": args.checkpoint,
                "beam": args.beam,
                "stop": args.stop,
                "dtype": args.dtype,
                "sentences": len(lines),
                "max_tokens": args.max_tokens or None,
                "workers": args.workers,
                "threads": args.threads,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "torch": torch.__version__,
                "cpu": cpu_description(),
                "results": rows,
            },
        )
        print(f"wrote {args.json}")


def main() -> None:
    ap = argument_parser()
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = read_lines(args.test_set)  # as bench_decode reads it
    lines = lines[: args.limit] if args.limit else lines

    with tempfile.TemporaryDirectory() as tmp:
        runs, outputs = [], []
        for i, rev in enumerate(args.rev):
            run = revision_search(i, rev, Path(tmp), args, lines)
            outputs.append([hyps[0].tokens for hyps in run()])  # untimed: warms up, and the outputs to compare
            runs.append(run)
        times: list[list[float]] = [[] for _ in runs]
        for _ in range(args.rounds):
            for i, run in enumerate(runs):
                start = time.perf_counter()
                run()  # its hypotheses come back to the host: the time includes the GPU's work
                times[i].append(time.perf_counter() - start)

    report(args, lines, times, outputs)


if __name__ == "__main__":
    main()
