"""Data path at WMT14 scale: prepare once, then start (and resume) in seconds with flat memory. Prints a table and
writes JSON.

    python scripts/bench_data.py --pairs 1000000 4500000 --json docs/benchmarks/bench_data_cpu.json
    python scripts/bench_data.py --pairs 20000 --json /tmp/bench_data.json     # a quick look

A synthetic corpus is generated into a temporary directory (deleted afterwards unless --keep): two made-up languages
with Zipf-distributed vocabularies of --words word types built from syllables, sentence lengths drawn from a
log-normal with a mean of about 27 words and a tail past 100 (like WMT14 en-de), the target length following the
source's. The smaller sizes are prefixes of the largest. For each size, with --config's model (tiny by default):

  spm         `transformer prepare` stage 1: SentencePiece training on a sample of data.spm_max_sentences
  encode      stage 2: streaming encode of train + valid into the store (pairs/s), store size on disk
  prepare     the whole `transformer prepare` command: wall time and peak RSS
  cold start  `transformer train` in a new run directory holding only spm.model: builds the store, then trains;
              seconds from launch to the end of the first update, peak RSS
  warm start  `transformer train --resume` on that run: the store is reused
  2 ranks     the same resumed under `torchrun --nproc_per_node 2` (gloo): time to the first update, peak RSS
              of each rank
  stream      batches/s drawn from the memory-mapped store by the training stream (make_batches + gathering)

--baseline DIR runs the first and the resumed `transformer train` with the package found in DIR (an older
checkout, e.g. one that read and encoded the corpus at every start) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import write_json

from transformer.config import load_config
from transformer.data.loader import BatchStream
from transformer.data.store import Store

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the synthetic corpus


def _lexicon(rng: np.random.Generator, n_words: int, syllables: list[str]) -> np.ndarray:
    """n_words distinct made-up words of 1-5 syllables, most frequent (shortest, on average) first."""
    words: dict[str, None] = {}
    while len(words) < n_words:
        lengths = np.minimum(rng.geometric(0.45, n_words), 5)
        parts = rng.integers(0, len(syllables), (n_words, 5))
        for n, row in zip(lengths, parts):
            words.setdefault("".join(syllables[i] for i in row[:n]), None)
    ranked = sorted(list(words)[:n_words], key=len)
    return np.array(ranked, dtype=object)


def _zipf(n_words: int, exponent: float = 1.1) -> np.ndarray:
    p = 1.0 / np.arange(1, n_words + 1) ** exponent
    return np.cumsum(p / p.sum())


def generate(directory: Path, pairs: int, valid: int, n_words: int, seed: int = 1) -> None:
    """train.{de,en} with `pairs` lines and valid.{de,en} with `valid` lines, written in chunks."""
    rng = np.random.default_rng(seed)
    consonants, vowels = "bdfghklmnprstvwz", "aeiou"
    de_syl = [c + v for c in consonants for v in vowels] + ["sch" + v for v in vowels] + ["ein", "ung", "ch"]
    en_syl = [c + v for c in consonants + "y" for v in vowels] + ["th" + v for v in vowels] + ["ing", "ed", "ly"]
    lexicon = {"de": _lexicon(rng, n_words, de_syl), "en": _lexicon(rng, n_words, en_syl)}
    cdf = _zipf(n_words)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", pairs), ("valid", valid)):
        files = {lang: (directory / f"{split}.{lang}").open("w", encoding="utf-8") for lang in lexicon}
        for start in range(0, n, 100_000):
            m = min(100_000, n - start)
            src_len = np.clip(np.round(rng.lognormal(np.log(23.2), 0.55, m)), 1, 250).astype(np.int64)
            tgt_len = np.clip(np.round(src_len * rng.lognormal(0.0, 0.12, m)), 1, 250).astype(np.int64)
            for lang, lengths in (("de", src_len), ("en", tgt_len)):
                ids = np.searchsorted(cdf, rng.random(int(lengths.sum())))
                words = lexicon[lang][np.minimum(ids, n_words - 1)]
                cuts = np.cumsum(lengths)[:-1]
                lines = [" ".join(sentence) for sentence in np.split(words, cuts)]
                lines = [line[0].upper() + line[1:] + "." for line in lines]
                files[lang].write("\n".join(lines) + "\n")
        for f in files.values():
            f.close()


def take_prefix(source: Path, target: Path, pairs: int) -> None:
    """The first `pairs` training lines of a larger corpus, and its whole validation split."""
    target.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "en"):
        with (source / f"train.{lang}").open("rb") as f, (target / f"train.{lang}").open("wb") as out:
            for i, line in enumerate(f):
                if i == pairs:
                    break
                out.write(line)
        shutil.copyfile(source / f"valid.{lang}", target / f"valid.{lang}")


# --------------------------------------------------------------------------- running the command line


def _env(pythonpath: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def timed(command: list[str], pythonpath: Path | None = None) -> dict:
    """Run under /usr/bin/time: wall seconds, peak RSS of the process (MiB), its stderr, launch time.
    With `pythonpath` the command also runs there: `python -m` puts the working directory first on sys.path."""
    launched = time.time()
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "MAXRSS_KB=%M", *command],
        capture_output=True,
        text=True,
        env=_env(pythonpath),
        cwd=pythonpath or ROOT,
    )
    wall = time.time() - launched
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(command)}\n{proc.stderr[-3000:]}")
    rss = int(re.findall(r"MAXRSS_KB=(\d+)", proc.stderr)[-1]) / 1024
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(rss, 1), "stderr": proc.stderr, "launched": launched}


def events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def train_run(args, data_dir: Path, run_dir: Path, steps: int, resume: bool, ranks: int = 1) -> dict:
    overrides = [
        f"data.dir={data_dir}",
        f"train.run_dir={run_dir}",
        "data.max_train_pairs=0",
        f"data.vocab_size={args.vocab_size}",
        f"data.max_len={args.max_len}",
        f"train.max_steps={steps}",
        "train.valid_every=1000000",
        "train.log_every=1",
        "train.device=cpu",
        "train.finish=false",  # the start is timed, not the end-of-training translations
        *args.set,
    ]
    tail = [args.config, *(x for o in overrides for x in ("--set", o)), *(["--resume"] if resume else [])]
    if ranks == 1:
        command = [sys.executable, "-m", "transformer", "train", *tail]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "-m",
            "transformer",
            "train",
            *tail,
        ]
    result = timed(command)
    first = events(run_dir, "first_update")[-1]
    done = events(run_dir, "done")[-1]
    return {
        "wall_s": result["wall_s"],
        "to_first_update_s": round(first["time"] - result["launched"], 2),
        "peak_rss_mib": done["peak_rss_mib"] if ranks > 1 else result["peak_rss_mib"],
    }


def prepare_run(args, data_dir: Path, run_dir: Path) -> dict:
    overrides = [
        f"data.dir={data_dir}",
        f"train.run_dir={run_dir}",
        "data.max_train_pairs=0",
        f"data.vocab_size={args.vocab_size}",
        f"data.max_len={args.max_len}",
        *args.set,
    ]
    result = timed(
        [sys.executable, "-m", "transformer", "prepare", args.config, *(x for o in overrides for x in ("--set", o))]
    )
    log = result["stderr"]
    spm = float(re.search(r"vocab: trained in ([\d.]+) s", log).group(1))
    encode = [(int(n), float(s)) for n, s in re.findall(r"store: \w+: encoded (\d+) pairs in ([\d.]+) s", log)]
    store = run_dir / "store"
    size = sum(f.stat().st_size for f in store.iterdir())
    encoded = sum(n for n, _ in encode)
    seconds = sum(s for _, s in encode)
    return {
        "wall_s": result["wall_s"],
        "peak_rss_mib": result["peak_rss_mib"],
        "spm_s": spm,
        "encode_s": round(seconds, 1),
        "encode_pairs_per_s": round(encoded / seconds),
        "store_mib": round(size / 2**20, 1),
        "pairs_kept": Store(store).stats("train")["pairs"],
    }


def stream_rate(args, run_dir: Path, n_batches: int = 300) -> dict:
    cfg = load_config(args.config, [f"data.vocab_size={args.vocab_size}", *args.set])
    corpus = Store(run_dir / "store").corpus("train")
    start = time.perf_counter()
    stream = BatchStream(corpus, cfg.data, seed=1)
    epoch_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n_batches):
        next(stream)
    return {"epoch_batching_s": round(epoch_s, 2), "batches_per_s": round(n_batches / (time.perf_counter() - start))}


def baseline(args, data_dir: Path, work: Path) -> dict:
    """The first run and a resume with an older checkout's package (the same commands the issue timed)."""
    run_dir = work / "baseline_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(work / "run" / "spm.model", run_dir / "spm.model")
    overrides = [
        f"data.dir={data_dir}",
        f"train.run_dir={run_dir}",
        "data.max_train_pairs=0",
        f"data.vocab_size={args.vocab_size}",
        f"data.max_len={args.max_len}",
        "train.valid_every=1000000",
        "train.device=cpu",
        *args.set,
    ]
    package = subprocess.run(
        [sys.executable, "-c", "import transformer; print(transformer.__file__)"],
        capture_output=True,
        text=True,
        env=_env(args.baseline),
        cwd=args.baseline,
    ).stdout.strip()
    if not Path(package).resolve().is_relative_to(args.baseline.resolve()):
        raise SystemExit(
            f"--baseline {args.baseline}: python -m transformer there imports {package}, not that checkout"
        )
    out = {"package": package}
    for name, steps, resume in (("first", 2, False), ("resume", 4, True)):
        command = [
            sys.executable,
            "-m",
            "transformer",
            "train",
            args.config,
            *(x for o in [*overrides, f"train.max_steps={steps}"] for x in ("--set", o)),
            *(["--resume"] if resume else []),
        ]
        result = timed(command, pythonpath=args.baseline)
        out[name] = {"wall_s": result["wall_s"], "peak_rss_mib": result["peak_rss_mib"]}
    return out


# --------------------------------------------------------------------------- main


def bench_size(args, corpus: Path, pairs: int, work: Path) -> dict:
    data_dir = work / "data"
    take_prefix(corpus, data_dir, pairs)
    print(f"\n== {pairs:,} pairs", flush=True)
    result: dict = {"pairs": pairs}
    result["prepare"] = prepare_run(args, data_dir, work / "run")
    print(f"prepare: {result['prepare']}", flush=True)
    shutil.rmtree(work / "run" / "store")  # keep spm.model: the cold start builds the store itself
    result["cold"] = train_run(args, data_dir, work / "run", steps=2, resume=False)
    print(f"cold start: {result['cold']}", flush=True)
    result["warm"] = train_run(args, data_dir, work / "run", steps=4, resume=True)
    print(f"warm start: {result['warm']}", flush=True)
    result["ranks2"] = train_run(args, data_dir, work / "run", steps=6, resume=True, ranks=2)
    print(f"2 ranks: {result['ranks2']}", flush=True)
    result["stream"] = stream_rate(args, work / "run")
    print(f"stream: {result['stream']}", flush=True)
    if args.baseline and pairs <= args.baseline_max_pairs:
        result["baseline"] = baseline(args, data_dir, work)
        print(f"baseline: {result['baseline']}", flush=True)
    if not args.keep:
        shutil.rmtree(data_dir)
    return result


def table(results: list[dict]) -> str:
    rows = [
        (
            "pairs",
            "spm s",
            "encode s",
            "pairs/s",
            "prepare s",
            "prepare RSS",
            "store MiB",
            "cold s",
            "warm s",
            "warm RSS",
            "2-rank s",
            "2-rank RSS",
            "batches/s",
        )
    ]
    for r in results:
        p = r["prepare"]
        rows.append(
            (
                f"{r['pairs']:,}",
                f"{p['spm_s']:.1f}",
                f"{p['encode_s']:.1f}",
                f"{p['encode_pairs_per_s']:,}",
                f"{p['wall_s']:.1f}",
                f"{p['peak_rss_mib']:.0f}",
                f"{p['store_mib']:.0f}",
                f"{r['cold']['to_first_update_s']:.1f}",
                f"{r['warm']['to_first_update_s']:.1f}",
                f"{r['warm']['peak_rss_mib']:.0f}",
                f"{r['ranks2']['to_first_update_s']:.1f}",
                " / ".join(f"{m:.0f}" for m in r["ranks2"]["peak_rss_mib"]),
                f"{r['stream']['batches_per_s']:,}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    for r in results:
        if "baseline" in r:
            b = r["baseline"]
            lines.append(
                f"baseline at {r['pairs']:,} pairs: first run {b['first']['wall_s']:.1f} s "
                f"({b['first']['peak_rss_mib']:.0f} MiB), resume {b['resume']['wall_s']:.1f} s "
                f"({b['resume']['peak_rss_mib']:.0f} MiB)"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, nargs="+", default=[1_000_000, 4_500_000], help="training pairs")
    parser.add_argument("--valid", type=int, default=3000, help="validation pairs (newstest-sized)")
    parser.add_argument("--words", type=int, default=200_000, help="word types per language")
    parser.add_argument("--config", default="configs/tiny.yaml", help="model and data settings")
    parser.add_argument("--vocab-size", type=int, default=32000, help="data.vocab_size")
    parser.add_argument("--max-len", type=int, default=126, help="data.max_len (subwords)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="more config overrides for every run"
    )
    parser.add_argument("--baseline", type=Path, help="a checkout whose package to time for before/after")
    parser.add_argument(
        "--baseline-max-pairs",
        type=int,
        default=10**12,
        metavar="N",
        help="run the baseline only at sizes up to N pairs (an old checkout holds the corpus in "
        "Python lists: gigabytes at millions of pairs)",
    )
    parser.add_argument("--workdir", type=Path, help="where to generate (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the generated corpus and runs")
    parser.add_argument("--json", default="bench_data.json")
    args = parser.parse_args()

    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_data_", dir=args.workdir))
    try:
        start = time.perf_counter()
        corpus = work / "corpus"
        generate(corpus, max(args.pairs), args.valid, args.words)
        print(f"generated {max(args.pairs):,} pairs in {time.perf_counter() - start:.0f} s into {corpus}", flush=True)
        results = []
        for pairs in sorted(args.pairs):
            size_dir = work / f"n{pairs}"
            results.append(bench_size(args, corpus, pairs, size_dir))
            if not args.keep:
                shutil.rmtree(size_dir)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))
    write_json(
        args.json,
        {
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
            },
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": results,
        },
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
