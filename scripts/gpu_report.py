#!/usr/bin/env python
"""The GPU check in one command of at most 7 minutes: the CUDA tests, which attention kernel serves each call
(check_sdpa.py), a training step at base dims in bf16 beside MarianMTModel with MFU (bench_train.py), the Multi30k
recipe on the GPU to its test BLEU, decoding that model greedy and beam 4 beside MarianMTModel.generate
(bench_decode.py), its beam-4 search split into encoder and decoder (bench_phases.py), and a compiled training step
if time is left. The training steps and the split each profile one more call (torch.profiler: how busy the GPU was,
the kernels and host operators with the most time). Each step is a subprocess with its own time
limit, in this order (the order of value); --budget bounds the whole command, and a step that would not get
MIN_STEP_S seconds is skipped and said so. A failing step is recorded and the next one runs. Writes one JSON
(every step's command, exit status, wall time and the figures read from the step's own output) and the generated
block of docs/benchmarks/log.md between its marker comments.

    PYTHONPATH=. python3 scripts/gpu_report.py --prepare-data ../shared/data/multi30k   # here, once: data/gpu/
    PYTHONPATH=. python3 scripts/gpu_report.py --budget 430 --json $OUT/gpu_report.json --out-md $OUT/gpu_report.md
    PYTHONPATH=. python3 scripts/gpu_report.py --device cpu                              # dry run at toy sizes
    PYTHONPATH=. python3 scripts/gpu_report.py --steps recipe,bench_decode --budget 400 --json B.json   # a second call
    python3 scripts/gpu_report.py --render A.json B.json --json docs/benchmarks/gpu_report.json  # merge; write the block

Everything the GPU machine needs travels with the repository: the corpus and its SentencePiece vocabulary in
data/gpu/ (git-ignored), written here by --prepare-data; nothing is read from ../shared, nothing imports
`datasets`, and there is no torchrun step (one GPU runs no DDP) and no CTranslate2 one (its wheels need CUDA 12).
--device cpu runs every step at toy sizes on the first lines of --data (the CUDA tests skip themselves; the
stand-in tests of the CUDA paths, tests/integration/test_cuda_paths.py, run instead): it checks the pipeline, not the speed.
The recipe's training stops at its limit less FINISH_RESERVE_S (SIGTERM: it saves last.pt), and `transformer
finish` then scores what it has.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- gpu_report:begin", "<!-- gpu_report:end -->"
SPLITS = [f"{split}.{lang}" for split in ("train", "valid", "test") for lang in ("de", "en")]
TOY_LINES = {"train": 400, "valid": 16, "test": 16}
TOY_MODEL = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_encoder_layers=1",
    "model.n_decoder_layers=1",
    "model.d_ff=64",
    "data.vocab_size=200",
    "train.warmup_steps=2",
    "train.log_every=1",
    "decode.max_len_offset=10",
]
DATA, VOCAB = "data/gpu/multi30k", "data/gpu/vocab/spm.model"  # what --prepare-data writes
RECIPE = "configs/multi30k.yaml"
GRACE_S = 30  # after SIGTERM at a limit: time to save a checkpoint before SIGKILL
FINISH_RESERVE_S = 90  # of the recipe's limit, kept for `transformer finish` when training hits the limit
MIN_STEP_S = 20  # a step with less time than this left in --budget is skipped
PROFILE_TOP = 12  # operators and kernels per profile


def fail(message: str) -> None:
    """A usage error: one line, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@dataclass
class Context:
    args: argparse.Namespace
    device: str  # cuda or cpu
    toy: bool  # toy sizes (the dry run)
    data: Path  # the corpus the steps read: --data, or a slice of it in toy mode
    out: Path  # scratch space: the steps' JSON, logs and run directories
    device_name: str

    def py(self, *argv: str) -> list[str]:
        return [sys.executable, *argv]

    def sets(self, *items: str) -> list[str]:
        return [a for item in items for a in ("--set", item)]

    def dir(self, step: str) -> Path:
        """Where a step writes: its own folder, emptied before it runs (no figure is read from an earlier run)."""
        return self.out / step


@dataclass
class Step:
    name: str
    title: str
    limits: tuple[int, int]  # seconds: (full size, toy size)
    command: Callable[[Context], list[str] | str]  # argv, or why the step is skipped
    parse: Callable[[Context, dict], dict]  # the step's figures, from its own output files
    rescue: Callable[[Context], list[str] | None] | None = None  # run after a timeout, in the reserve
    keep_after: int = 0  # seconds of --budget this step leaves for the selected steps after it


# --------------------------------------------------------------------------- the steps


def cuda_tests(ctx: Context):
    # On a CPU the CUDA tests skip themselves: the dry run runs the stand-in tests of the same paths beside them.
    files = ["tests/integration/test_cuda.py"] + (
        ["tests/integration/test_cuda_paths.py"] if ctx.device == "cpu" else []
    )
    return ctx.py(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, f"--junitxml={ctx.dir('cuda_tests') / 'junit.xml'}"
    )


def parse_cuda_tests(ctx: Context, record: dict) -> dict:
    suite = ET.parse(ctx.dir("cuda_tests") / "junit.xml").getroot().find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        message = next((c.get("message") or "" for c in case if c.tag in ("failure", "error", "skipped")), "")
        cases.append(
            {
                "name": case.get("name"),
                "file": case.get("classname"),
                "outcome": outcome,
                "message": message.splitlines()[0][:200] if message else "",
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    if record["status"] == "ok" and cases and counts["skipped"] == len(cases):
        record["status"], record["reason"] = "skipped", "every test skipped itself: " + cases[0]["message"]
    return {
        "tests": len(cases),
        "passed": counts["passed"],
        "failed": counts["failure"],
        "errors": counts["error"],
        "skipped": counts["skipped"],
        "cases": cases,
    }


def check_sdpa(ctx: Context):
    toy = ["--batch", "2", "--length", "8", "--reps", "1"] if ctx.toy else ["--reps", "10"]
    return ctx.py(
        "scripts/check_sdpa.py", "--device", ctx.device, *toy, "--json", str(ctx.dir("check_sdpa") / "check_sdpa.json")
    )


def parse_check_sdpa(ctx: Context, record: dict) -> dict:
    report = json.loads((ctx.dir("check_sdpa") / "check_sdpa.json").read_text())
    # The masks the model passes now: additive key padding, is_causal in decoder self-attention.
    ours = [
        r
        for r in report["rows"]
        if r["mask"] == "is_causal" or (r["mask"] == "additive" and r["call"] != "decoder self-attention")
    ]
    return {
        "dtype": report["dtype"],
        "shape": report["shape"],
        "rows": report["rows"],
        "math_for_ours": sorted(
            {f"{r['call']} ({r['mask']})" for r in ours if "math" in (r["kernel_train"], r["kernel_eval"])}
        ),
    }


def bench_train(ctx: Context, compile_: bool = False):
    json_path = ctx.dir("bench_train_compile" if compile_ else "bench_train") / "bench_train.json"
    if ctx.toy:
        size = [
            "--config",
            "configs/tiny.yaml",
            "--vocab",
            "128",
            "--tokens",
            "64",
            "--length",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--precision",
            "fp32",
        ]
    else:
        size = [
            "--config",
            "configs/base.yaml",
            "--vocab",
            "37000",
            "--tokens",
            "25000",
            "--length",
            "32",
            "--steps",
            "10",
            "--warmup",
            "3",
            "--precision",
            "bf16",
        ]
    peak = ["--peak-tflops", str(ctx.args.peak_tflops)] if ctx.args.peak_tflops else []  # else the datasheet's
    what = ["--impls", "ours", "--compile", "ours"] if compile_ else ["--impls", "ours,marian"]
    profile = ["--profile", "3" if ctx.toy else str(PROFILE_TOP)]  # where an update's time goes, beside its speed
    return ctx.py(
        "scripts/bench_train.py", "--device", ctx.device, *size, *what, *peak, *profile, "--json", str(json_path)
    )


def parse_bench_train(ctx: Context, record: dict, compile_: bool = False) -> dict:
    step = "bench_train_compile" if compile_ else "bench_train"
    report = json.loads((ctx.dir(step) / "bench_train.json").read_text())
    keep = (
        "impl",
        "compiled",
        "step_s_median",
        "tgt_tokens_per_s",
        "tokens_per_s",
        "tflops_per_s",
        "mfu",
        "peak_mem_gib",
        "params",
        "sentences",
        "ours_speedup",
        "profile",
    )
    return {
        "config": report["config"],
        "compile": report["compile"],
        "precision": report["precision"],
        "tokens": report["tokens"],
        "length": report["length"],
        "vocab": report["vocab"],
        "peak_tflops": report["peak_flops"] / 1e12,
        "peak_source": report.get("peak_source"),
        "peak_measured": report.get("peak_measured"),
        "results": [{k: r.get(k) for k in keep} for r in report["results"]],
        "failed": report.get("failed", []),
    }


def recipe_dir(ctx: Context) -> Path:
    return ctx.dir("recipe") / "run"


def recipe(ctx: Context):
    run_dir = recipe_dir(ctx)
    size = (
        ["train.max_steps=6", "train.valid_every=3", "train.keep_last=2", *TOY_MODEL]
        if ctx.toy
        else ["train.precision=bf16", "data.pad_to_multiple=8"]
    )
    vocab = Path(ctx.args.vocab)
    if not ctx.toy and vocab.is_file():  # SentencePiece trained once, here: not on the GPU's clock
        run_dir.mkdir(parents=True)
        shutil.copyfile(vocab, run_dir / "spm.model")
    return ctx.py(
        "-m",
        "transformer",
        "train",
        RECIPE,
        *ctx.sets(
            f"data.dir={ctx.data}",
            f"train.run_dir={run_dir}",
            f"train.device={ctx.device}",
            *size,
            *ctx.args.recipe_set,
        ),
    )


def recipe_rescue(ctx: Context) -> list[str] | None:
    """Stopped at its limit: score the best checkpoint so far, as the end of training would have."""
    run_dir = recipe_dir(ctx)
    if not (run_dir / "best.pt").is_file() or (run_dir / "summary.json").is_file():
        return None
    return ctx.py("-m", "transformer", "finish", str(run_dir), "--device", ctx.device)


def parse_recipe(ctx: Context, record: dict) -> dict:
    import yaml  # the package's own dependency, like everything the steps run

    run_dir = recipe_dir(ctx)
    summary = json.loads((run_dir / "summary.json").read_text())
    max_steps = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    first = next((r for r in rows if r.get("event") == "first_update"), {})
    test = summary.get("test", {})
    return {
        "test_bleu": test.get("bleu"),
        "test_chrf": test.get("chrf"),
        "bleu_signature": test.get("bleu_signature"),
        "length_ratio": test.get("length_ratio"),
        "updates": summary["updates"],
        "max_steps": max_steps,
        "reached_end": summary["updates"] >= max_steps,
        "epochs": summary["epochs"],
        "training_seconds": summary["training_seconds"],
        "finish_seconds": summary.get("finish_seconds"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "best_valid_loss": summary.get("best_valid_loss"),
        "first_update_seconds": first.get("seconds"),
        "mfu_last": train[-1].get("mfu") if train else None,
        "peak_tflops": train[-1].get("peak_tflops") if train else None,
        "peak_cuda_allocated_mib": summary.get("peak_cuda_allocated_mib"),
        "peak_cuda_reserved_mib": summary.get("peak_cuda_reserved_mib"),
        "made_from": summary.get("made_from"),
        "decode": summary.get("decode"),
        "wall_s": record["wall_s"] + record.get("rescue", {}).get("wall_s", 0.0),
    }


def decoded_model(ctx: Context) -> Path | str:
    """The model the decoding steps search with (--checkpoint, else the recipe step's run), or why there is none."""
    run_dir = Path(ctx.args.checkpoint) if ctx.args.checkpoint else recipe_dir(ctx)
    if run_dir.is_file() or any((run_dir / name).is_file() for name in ("final.pt", "best.pt")):
        return run_dir
    return f"no model to decode: {run_dir} holds no final.pt or best.pt (the recipe step made none)"


def bench_decode(ctx: Context):
    run_dir = decoded_model(ctx)
    if isinstance(run_dir, str):
        return run_dir  # the step is skipped, and says why
    dtypes = ["fp32"] if ctx.device == "cpu" else ["fp32", "bf16"]
    return ctx.py(
        "scripts/bench_decode.py",
        str(ctx.data / "test.de"),
        "--ref",
        str(ctx.data / "test.en"),
        "--checkpoint",
        str(run_dir),
        "--device",
        ctx.device,
        "--beam",
        "1",
        "4",
        "--stop",
        "exact",
        "--dtype",
        *dtypes,
        "--limit",
        "8" if ctx.toy else "500",
        "--repeats",
        "1" if ctx.toy else "2",
        "--json",
        str(ctx.dir("bench_decode") / "bench_decode.json"),
    )


def parse_bench_decode(ctx: Context, record: dict) -> dict:
    report = json.loads((ctx.dir("bench_decode") / "bench_decode.json").read_text())
    keep = (
        "beam",
        "impl",
        "stop",
        "dtype",
        "sentences",
        "batches",
        "steps_per_sentence",
        "median_s",
        "sentences_per_s",
        "tokens_per_s",
        "bleu",
        "chrf",
        "same_as_first",
    )
    rows = [{k: r[k] for k in keep if k in r} for r in report["results"]]
    for row in rows:
        marian = next((m for m in rows if m["impl"] == "hf_marian" and m["beam"] == row["beam"]), None)
        if marian is not None and row["impl"] == "ours":
            row["vs_marian"] = row["sentences_per_s"] / marian["sentences_per_s"]
    return {
        "checkpoint": report["checkpoint"],
        "transformers": report.get("transformers"),
        "marian": any(r["impl"] == "hf_marian" for r in rows),
        "results": rows,
    }


def phases_decode(ctx: Context):
    run_dir = decoded_model(ctx)
    if isinstance(run_dir, str):
        return run_dir  # the step is skipped, and says why
    size = ["--limit", "8", "--rounds", "1"] if ctx.toy else ["--limit", "500", "--rounds", "3"]
    return ctx.py(
        "scripts/bench_phases.py",
        str(ctx.data / "test.de"),
        "--checkpoint",
        str(run_dir),
        "--device",
        ctx.device,
        "--beam",
        "4",
        "--stop",
        "exact",
        "--dtype",
        "fp32",
        "--no-ctranslate2",
        *size,
        "--profile",
        "3" if ctx.toy else str(PROFILE_TOP),
        "--json",
        str(ctx.dir("phases_decode") / "bench_phases.json"),
    )


def parse_phases_decode(ctx: Context, record: dict) -> dict:
    report = json.loads((ctx.dir("phases_decode") / "bench_phases.json").read_text())
    return {k: report[k] for k in ("checkpoint", "sentences", "batches", "beam", "dtype", "stop", "split", "profile")}


# In the order of value. Limits (seconds, at full size and at toy size): --budget 430 gives the first six their
# time, and the compiled step what is left (on an H200 it took 64 s of the 126 left).
STEPS = [
    Step("cuda_tests", "CUDA tests", (150, 240), cuda_tests, parse_cuda_tests),
    Step("check_sdpa", "SDPA kernels", (40, 60), check_sdpa, parse_check_sdpa),
    Step("bench_train", "training step, base dims, ours and Marian", (90, 150), bench_train, parse_bench_train),
    Step("recipe", "Multi30k recipe", (300, 150), recipe, parse_recipe, rescue=recipe_rescue, keep_after=45),
    Step("bench_decode", "decoding, ours and Marian", (60, 60), bench_decode, parse_bench_decode),
    Step("phases_decode", "beam 4: encoder, decoder, profile", (60, 60), phases_decode, parse_phases_decode),
    Step(
        "bench_train_compile",
        "training step, torch.compile",
        (150, 480),
        lambda c: bench_train(c, True),
        lambda c, r: parse_bench_train(c, r, True),
    ),
]
NAMES = [s.name for s in STEPS]


# --------------------------------------------------------------------------- running


def shown(argv: list[str]) -> str:
    """The command as a person types it from the repository root (python3, relative paths)."""
    text = shlex.join(["python3" if a == sys.executable else a for a in argv])
    return text.replace(f"{ROOT}{os.sep}", "")


def execute(argv: list[str], log_path: Path, limit: float) -> tuple[int, float, bool]:
    """Run argv in its own process group, output to log_path; at the limit SIGTERM the group, SIGKILL after
    GRACE_S. -> (exit status, wall seconds, whether the limit was hit)."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also when this script is interrupted: never leave a step running
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return proc.returncode, round(time.perf_counter() - start, 1), timed_out


def tail(path: Path, chars: int = 3000) -> str:
    """The end of a log, progress-bar redraws ('\\r') reduced to their last state."""
    text = path.read_text(encoding="utf-8", errors="replace")[-4 * chars :]
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.splitlines())[-chars:]


def run_step(ctx: Context, step: Step, deadline: float | None, later: bool) -> dict:
    """Run one step within its limit, and within what --budget has left less what it keeps for the steps after it
    (`later`: some are selected)."""
    record = {
        "name": step.name,
        "title": step.title,
        "selected": True,
        "device_name": ctx.device_name,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "figures": {},
    }
    limit = ctx.args.limit.get(step.name, step.limits[1] if ctx.toy else step.limits[0])
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < MIN_STEP_S:
            return {**record, "status": "skipped", "reason": f"--budget spent ({left:.0f} s left)"}
        limit = min(limit, max(left - (step.keep_after if later else 0), MIN_STEP_S))
    shutil.rmtree(ctx.dir(step.name), ignore_errors=True)
    argv = step.command(ctx)
    if isinstance(argv, str):
        return {**record, "status": "skipped", "reason": argv}
    ctx.dir(step.name).mkdir(parents=True, exist_ok=True)
    cap = limit - FINISH_RESERVE_S if step.rescue and limit > 2 * FINISH_RESERVE_S else limit
    log = ctx.dir(step.name) / "output.log"
    print(f"gpu_report: {step.name} (limit {cap:.0f} s): {shown(argv)}", flush=True)
    rc, wall, timed_out = execute(argv, log, cap)
    record.update(
        argv=argv,
        command=shown(argv),
        returncode=rc,
        wall_s=wall,
        limit_s=round(cap, 1),
        log=str(log),
        status="timeout" if timed_out else ("ok" if rc == 0 else "failed"),
    )
    record["output_tail"] = tail(log)
    if timed_out and step.rescue and (rescue := step.rescue(ctx)) is not None:
        rescue_log = ctx.dir(step.name) / "rescue.log"
        left = FINISH_RESERVE_S if deadline is None else max(deadline - time.monotonic(), 1)
        rrc, rwall, rtimed_out = execute(rescue, rescue_log, min(FINISH_RESERVE_S, left))
        record["rescue"] = {
            "argv": rescue,
            "command": shown(rescue),
            "returncode": rrc,
            "wall_s": rwall,
            "timed_out": rtimed_out,
            "output_tail": tail(rescue_log, 1500),
        }
    try:
        record["figures"] = step.parse(ctx, record)
    except Exception as e:  # a step that failed early wrote nothing to read: its status and output say why
        record["parse_error"] = f"{type(e).__name__}: {e}"
    print(f"gpu_report: {step.name}: {record['status']} in {wall:.1f} s", flush=True)
    return record


def machine(device: str, device_name: str) -> dict:
    import torch

    versions = {}
    for package in ("torch", "transformers", "sentencepiece", "sacrebleu", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    info = {
        "device": device,
        "device_name": device_name,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "packages": versions,
        "cuda": torch.version.cuda,
        "datasets_installed": importlib.util.find_spec("datasets") is not None,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    return info


def toy_slice(data: Path, out: Path) -> Path:
    """The first lines of each split: what the dry run trains, validates and decodes."""
    out.mkdir(parents=True, exist_ok=True)
    for name in SPLITS:
        with (data / name).open(encoding="utf-8") as f:
            lines = [line for _, line in zip(range(TOY_LINES[name.split(".")[0]]), f)]
        (out / name).write_text("".join(lines), encoding="utf-8")
    return out


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def prepare_data(source: Path, data: Path, vocab: Path) -> None:
    """--prepare-data: Multi30k copied into `data` (data/gpu/multi30k: a copy, since a link would arrive dangling
    on the GPU machine, which gets only the repository) and its SentencePiece vocabulary, trained as the recipe
    trains it (`transformer prepare`), into `vocab` (data/gpu/vocab/spm.model)."""
    missing = [name for name in SPLITS if not (source / name).is_file()]
    if missing:
        fail(
            f"{source} lacks {', '.join(missing)}: give the directory of Multi30k's "
            "{train,valid,test}.{de,en}, e.g. ../shared/data/multi30k"
        )
    data, vocab = data.resolve(), vocab.resolve()
    data.mkdir(parents=True, exist_ok=True)
    for name in SPLITS:
        shutil.copyfile(source / name, data / name)
    scratch = vocab.parent / "run"
    shutil.rmtree(scratch, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer",
            "prepare",
            RECIPE,
            "--set",
            f"data.dir={data}",
            "--set",
            f"train.run_dir={scratch}",
        ],
        cwd=ROOT,
        env=env,
    )
    if result.returncode != 0:
        fail("`transformer prepare` failed (above): no vocabulary written")
    shutil.copyfile(scratch / "spm.model", vocab)
    shutil.rmtree(scratch)
    print(
        f"gpu_report: wrote {shown([str(data)])}/ and {shown([str(vocab)])}: carry their folder (data/gpu, "
        "git-ignored) to the GPU machine"
    )


def measure(args: argparse.Namespace) -> dict:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device here; --device cpu runs the dry run at toy sizes")
    data = Path(args.data)
    missing = [name for name in SPLITS if not (data / name).is_file()]
    if missing:
        fail(
            f"{data} lacks {', '.join(missing)}: write the corpus into the repository first with "
            "--prepare-data ../shared/data/multi30k (then carry data/gpu to the GPU machine)"
        )
    toy = args.toy or args.device == "cpu"
    if not toy and not Path(args.vocab).is_file():
        print(
            f"gpu_report: warning: no vocabulary at {args.vocab}: the recipe trains SentencePiece on the GPU's "
            "time (--prepare-data writes one)",
            flush=True,
        )
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from transformer.device import cpu_description

    device_name = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else cpu_description().get("model_name") or platform.processor() or "cpu"
    )
    corpus = toy_slice(data, out / "toy_data") if toy else data.resolve()
    ctx = Context(args, args.device, toy, corpus, out, device_name)
    selected = [n for n in (args.steps or NAMES) if n not in args.skip]
    json_path = Path(args.json) if args.json else out / "gpu_report.json"
    report = {
        "script": "scripts/gpu_report.py",
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "toy": toy,
        "data": args.data,
        "out_dir": str(out),
        "budget_s": args.budget,
        "machine": machine(args.device, device_name),
        "steps": [],
    }
    deadline = time.monotonic() + args.budget if args.budget else None
    start = time.perf_counter()
    # A SIGTERM (a limit outside this script) raises SystemExit: the running step is stopped, the JSON written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for i, step in enumerate(STEPS):
        if step.name not in selected:
            report["steps"].append(
                {
                    "name": step.name,
                    "title": step.title,
                    "selected": False,
                    "status": "skipped",
                    "reason": "not selected (--steps / --skip)",
                    "figures": {},
                }
            )
            continue
        later = any(s.name in selected for s in STEPS[i + 1 :])
        try:
            report["steps"].append(run_step(ctx, step, deadline, later))
        except BaseException:  # SIGTERM or Ctrl-C: keep what was measured, say which step was cut
            report["steps"].append(
                {"name": step.name, "title": step.title, "selected": True, "status": "interrupted", "figures": {}}
            )
            write_json(json_path, report)
            raise
        report["wall_s"] = round(time.perf_counter() - start, 1)
        write_json(json_path, report)
    report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json(json_path, report)
    print(f"gpu_report: wrote {json_path}")
    return report


def merge(reports: list[dict]) -> dict:
    """Several partial reports (one per device call) as one: for each step, the last report that ran it."""
    merged = {
        **reports[-1],
        "parts": [{k: r.get(k) for k in ("started", "finished", "toy", "budget_s", "machine")} for r in reports],
    }
    steps = []
    for step in STEPS:
        found = [s for r in reports for s in r["steps"] if s["name"] == step.name]
        ran = [s for s in found if s.get("selected", True)]
        steps.append(
            (
                ran
                or found
                or [
                    {
                        "name": step.name,
                        "title": step.title,
                        "selected": False,
                        "status": "skipped",
                        "reason": "in none of the reports",
                        "figures": {},
                    }
                ]
            )[-1]
        )
    merged["steps"] = steps
    merged["toy"] = any(r.get("toy") for r in reports)
    return merged


# --------------------------------------------------------------------------- the generated block


def fmt(value, spec: str = ".1f", none: str = "—") -> str:
    return none if value is None else format(value, spec)


def render(report: dict) -> str:
    """The markdown block: what ran where, the exact commands, each step's figures and the issue's targets. It
    shows only what the JSON holds (and ratios of it)."""
    steps = {s["name"]: s for s in report["steps"]}
    parts = report.get("parts") or [report]
    names = sorted({p["machine"]["device_name"] for p in parts if p.get("machine")})
    m = parts[-1].get("machine") or {}
    pk = m.get("packages", {})
    when = max(p.get("finished") or p.get("started") or "" for p in parts)
    out = [
        f"{BEGIN}: written by scripts/gpu_report.py; running it again replaces everything down to the end marker -->",
        "",
        f"### Report: {', '.join(names) or '?'} ({when[:10]})",
        "",
    ]
    if report.get("toy"):
        out += [
            "**Dry run at toy sizes** (`--device cpu` or `--toy`): it checks that every step, the JSON and "
            "this block work. None of its figures measures anything.",
            "",
        ]
    if len(names) > 1:
        out += [f"**The steps ran on different devices ({', '.join(names)}): compare figures within a step only.**", ""]
    budgets = [p.get("budget_s") for p in parts]
    out += [
        f"Written {when} by `scripts/gpu_report.py` (--budget {', '.join(fmt(b, '.0f') for b in budgets)} s): "
        f"torch {pk.get('torch')} (CUDA {m.get('cuda')}), Python {m.get('python')}, transformers "
        f"{pk.get('transformers')}, sacrebleu {pk.get('sacrebleu')}, sentencepiece {pk.get('sentencepiece')}; "
        f"`datasets` {'installed' if m.get('datasets_installed') else 'not installed'}. Each command below ran "
        "from the repository root with `PYTHONPATH=.`, one after the other.",
        "",
        "| step | status | wall s | limit s |",
        "| --- | --- | ---: | ---: |",
    ]
    for s in report["steps"]:
        status = s["status"] + (f": {s['reason']}" if s.get("reason") else "")
        if s.get("returncode") not in (None, 0):
            status += f" (exit {s['returncode']})"
        out.append(f"| {s['name']} | {status} | {fmt(s.get('wall_s'))} | {fmt(s.get('limit_s'), '.0f')} |")
    out += ["", "```sh"]
    for s in report["steps"]:
        if s.get("command"):
            out.append(f"# {s['name']}\n{s['command']}")
        if s.get("rescue"):
            out.append(f"# {s['name']}: stopped at its limit, then\n{s['rescue']['command']}")
    out += ["```", ""]
    for name, section in (
        ("cuda_tests", md_cuda_tests),
        ("check_sdpa", md_sdpa),
        ("bench_train", md_train),
        ("recipe", md_recipe),
        ("bench_decode", md_decode),
        ("phases_decode", md_phases),
    ):
        if any(s["name"].startswith(name) and s.get("figures") for s in report["steps"]):
            out += section(steps) + [""]
    profiles = md_profiles(steps)
    out += profiles + ([""] if profiles else [])
    out += md_targets(steps, bool(report.get("toy"))) + ["", END]
    return "\n".join(out)


def md_cuda_tests(steps: dict) -> list[str]:
    f = steps["cuda_tests"]["figures"]
    files = sorted({c["file"].replace(".", "/") + ".py" for c in f["cases"] if c.get("file")})  # JUnit's classname
    lines = [
        f"**CUDA tests** (`{'`, `'.join(files) or 'tests/integration/test_cuda.py'}`): {f['tests']} tests, {f['passed']} "
        f"passed, {f['failed']} failed, {f['errors']} errors, {f['skipped']} skipped."
    ]
    return lines + [f"- `{c['name']}`: {c['outcome']}: {c['message']}" for c in f["cases"] if c["outcome"] != "passed"]


def md_sdpa(steps: dict) -> list[str]:
    f = steps["check_sdpa"]["figures"]
    shape = f["shape"]
    backends = list(f["rows"][0]["backends"]) if f["rows"] else []
    lines = [
        f"**SDPA kernels** (`scripts/check_sdpa.py`, {f['dtype']}, batch {shape['batch']}, {shape['heads']} "
        f"heads of {shape['head_dim']}, targets of {shape['tgt_len']}, sources of {shape['src_len']}): the "
        "kernel torch picks with dropout 0.1 (training) and 0 (validation, search), forward + backward ms at "
        "dropout 0.1, the largest difference from the math kernel (boolean mask, dropout 0) over real query "
        "positions, and each backend forced alone (ms; — = it cannot serve the call). The model passes the "
        "additive masks and is_causal; boolean is what it passed before issue 32. "
        + (
            "**The math kernel serves " + ", ".join(f["math_for_ours"]) + ".**"
            if f["math_for_ours"]
            else "The math kernel serves none of the model's calls."
        ),
        "",
        "| call | mask | kernel (train) | kernel (eval) | ms | Δ out | Δ grad | " + " | ".join(backends) + " |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |" + " ---: |" * len(backends),
    ]
    return lines + [
        f"| {r['call']} | {r['mask']} | {r['kernel_train']} | {r['kernel_eval']} | {fmt(r['ms'], '.3f')} | "
        f"{fmt(r['max_diff_out'], '.1e')} | {fmt(r['max_diff_grad'], '.1e')} | "
        + " | ".join(fmt(r["backends"][b], ".3f") for b in backends)
        + " |"
        for r in f["rows"]
    ]


def md_train(steps: dict) -> list[str]:
    runs = [steps[n]["figures"] for n in ("bench_train", "bench_train_compile") if steps[n].get("figures")]
    f = runs[0]
    lines = [
        f"**Training step** (`scripts/bench_train.py`, {f['config']}, vocabulary {f['vocab']}): "
        f"{f['tokens']} target tokens per update ({f['tokens'] // f['length']} sentences of {f['length']}), "
        f"{f['precision']}; MFU against "
        + " and ".join(f"{fmt(r['peak_tflops'], '.4g')} TFLOP/s ({r['peak_source']})" for r in runs)
        + ".",
        "",
        "| impl | compiled | step s | target tok/s | TFLOP/s | MFU | peak GiB | ours × |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        for r in run["results"]:
            lines.append(
                f"| {r['impl']} | {'yes' if r['compiled'] else 'no'} | {fmt(r['step_s_median'], '.4f')} | "
                f"{fmt(r['tgt_tokens_per_s'], ',.0f')} | {fmt(r['tflops_per_s'])} | {fmt(r['mfu'], '.1%')} | "
                f"{fmt(r['peak_mem_gib'], '.2f')} | {fmt(r['ours_speedup'], '.2f')} |"
            )
        compiled = "no" if run["compile"] == "none" else "yes"
        lines += [f"| {x['impl']} | {compiled} | failed: {x['error'][:120]} | | | | | |" for x in run["failed"]]
    return lines


def md_decode(steps: dict) -> list[str]:
    f = steps["bench_decode"]["figures"]
    rows = sorted(f["results"], key=lambda r: r["beam"])
    return [
        f"**Decoding, ours and Marian** (`scripts/bench_decode.py`, checkpoint `{shown([f['checkpoint']])}`, "
        f"{rows[0]['sentences']} test sentences, median of the timed passes; Marian has random weights and runs "
        "exactly our number of decoder steps, so it has no BLEU)",
        "",
        "| beam | impl | stop | dtype | steps/sentence | sentences/s | tokens/s | BLEU | ours / Marian |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ] + [
        f"| {r['beam']} | {r['impl']} | {r['stop']} | {r['dtype']} | {fmt(r.get('steps_per_sentence'))} | "
        f"{fmt(r['sentences_per_s'])} | {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('bleu'), '.2f')} | "
        f"{fmt(r.get('vs_marian'), '.2f') if r['impl'] == 'ours' else ''} |"
        for r in rows
    ]


def md_phases(steps: dict) -> list[str]:
    f = steps["phases_decode"]["figures"]
    split = f["split"]["ours"]
    return [
        f"**Beam {f['beam']}, where the time goes** (`scripts/bench_phases.py`, {f['dtype']}, {f['sentences']} "
        f"sentences in {f['batches']} batches, median of the rounds): the encoder (and the cross-attention keys "
        f"and values) {fmt(split['first_s'], '.3f')} s, the decoder's steps {fmt(split['rest_s'], '.3f')} s, "
        f"the whole search {fmt(split['whole_s'], '.3f')} s."
    ]


def md_profiles(steps: dict) -> list[str]:
    """Each profile the steps took (a training update per implementation, one whole beam search): how busy the GPU
    was, and the kernels and host operators with the most time."""
    found = []
    for name in ("bench_train", "bench_train_compile"):
        for r in (steps.get(name, {}).get("figures") or {}).get("results", []):
            if r.get("profile"):
                found.append((f"one update, {r['impl']}{' compiled' if r['compiled'] else ''}", r["profile"]))
    decode = (steps.get("phases_decode", {}).get("figures") or {}).get("profile")
    if decode:
        found.append(("the whole beam-4 search", decode))
    if not found:
        return []
    lines = [
        f"**Profiles** (`torch.profiler`, one more call after the timed ones; the {PROFILE_TOP // 2} kernels and "
        "host operators with the most self time of each; GPU busy = the kernels' time over the call's wall "
        "clock: the rest of the wall the GPU waited for the host)",
        "",
        "| call | wall s | GPU busy | kernels: share of GPU time | host operators: share of host time |",
        "| --- | ---: | ---: | --- | --- |",
    ]

    def top(rows) -> str:
        return "; ".join(f"`{r['op'][:48]}` {r['share']:.0%}" for r in rows[: PROFILE_TOP // 2]) or "—"

    for what, prof in found:
        lines.append(
            f"| {what} | {fmt(prof['wall_s'], '.3f')} | {fmt(prof.get('gpu_busy_share'), '.0%')} | "
            f"{top(prof.get('gpu', []))} | {top(prof['host'])} |"
        )
    return lines


def md_recipe(steps: dict) -> list[str]:
    f = steps["recipe"]["figures"]
    decode = f["decode"] or {}
    end = (
        "to its end"
        if f["reached_end"]
        else f"**stopped at its time limit** after {f['updates']} of "
        f"{f['max_steps']} updates, then `transformer finish`"
    )
    gpu = (
        f"; GPU peak {fmt(max(f['peak_cuda_allocated_mib']), ',.0f')} MiB allocated, "
        f"{fmt(max(f['peak_cuda_reserved_mib']), ',.0f')} MiB reserved"
        if f.get("peak_cuda_reserved_mib")
        else ""
    )
    return [
        f"**Multi30k recipe** (`{RECIPE}`), {end}: test BLEU **{fmt(f['test_bleu'], '.2f')}** "
        f"(chrF {fmt(f['test_chrf'], '.2f')}, length ratio {fmt(f['length_ratio'], '.3f')}, "
        f"`{f['bleu_signature']}`) with {f['made_from']}, beam {decode.get('beam')}, "
        f"lenpen {decode.get('lenpen')}; "
        f"{f['updates']} updates, {f['epochs']} epochs, {fmt(f['tokens_per_s'], ',')} tokens/s, MFU "
        f"{fmt(f['mfu_last'], '.1%')} at the last log line (against {fmt(f['peak_tflops'], '.4g')} TFLOP/s){gpu}; "
        f"first update {fmt(f['first_update_seconds'])} s after start; wall clock {fmt(f['wall_s'])} s for the "
        f"whole command, of which training {fmt(f['training_seconds'])} s and the end of training (averaging, "
        f"choosing, test) {fmt(f['finish_seconds'])} s (`summary.json`)."
    ]


def md_targets(steps: dict, toy: bool) -> list[str]:
    def verdict(ok: bool | None) -> str:
        return "dry run" if toy else ("not measured" if ok is None else ("met" if ok else "**not met**"))

    rows = []
    train = [r for n in ("bench_train", "bench_train_compile") for r in steps[n].get("figures", {}).get("results", [])]
    sources = {
        steps[n]["figures"]["peak_source"] for n in ("bench_train", "bench_train_compile") if steps[n].get("figures")
    }
    datasheet = bool(sources) and all("datasheet" in (s or "") for s in sources)
    mfu = [(r["mfu"], r["compiled"]) for r in train if r["impl"] == "ours"]
    rows.append(
        (
            "training at base dims: ≥ 45 % MFU in bf16 (datasheet peak)",
            ", ".join(f"{'compiled' if c else 'eager'} {v:.1%}" for v, c in mfu)
            + ("" if datasheet or not mfu else f" (against {', '.join(sorted(sources))}: no datasheet peak)")
            or "—",
            verdict(max(v for v, _ in mfu) >= 0.45 if mfu and datasheet else None),
        )
    )
    # bench_train's ours_speedup on Marian's row: our target tokens/s over Marian's, same compile setting
    marian = [(r["ours_speedup"], r["compiled"]) for r in train if r["impl"] == "marian" and r["ours_speedup"]]
    rows.append(
        (
            "training: ≥ 2× MarianMTModel's tokens/s",
            ", ".join(f"{'compiled' if c else 'eager'} {v:.2f}×" for v, c in marian) or "—",
            verdict(max(v for v, _ in marian) >= 2 if marian else None),
        )
    )
    decode = steps["bench_decode"].get("figures", {}).get("results", [])
    beam4 = [r for r in decode if r["beam"] == 4 and r["impl"] == "ours" and r["dtype"] == "fp32"]
    vs_marian = [(r["vs_marian"], r["stop"]) for r in beam4 if r.get("vs_marian")]
    rows.append(
        (
            "beam-4 decoding: ≥ 3× MarianMTModel.generate's sentences/s (both fp32)",
            ", ".join(f"stop {s} {v:.2f}×" for v, s in vs_marian) or "—",
            verdict(max(v for v, _ in vs_marian) >= 3 if vs_marian else None),
        )
    )
    r = steps["recipe"].get("figures")
    rows.append(
        (
            "Multi30k recipe: test BLEU ≥ 40 in ≤ 5 min wall clock",
            f"BLEU {r['test_bleu']:.2f} in {r['wall_s'] / 60:.1f} min"
            + ("" if r["reached_end"] else f" (stopped after {r['updates']} of {r['max_steps']} updates)")
            if r
            else "—",
            verdict(r["test_bleu"] >= 40 and r["wall_s"] <= 300 and r["reached_end"] if r else None),
        )
    )
    sdpa = steps["check_sdpa"].get("figures")
    rows.append(
        (
            "attention: no math kernel for the model's masks (training and eval)",
            ("math for " + ", ".join(sdpa["math_for_ours"]) if sdpa["math_for_ours"] else "none") if sdpa else "—",
            verdict(not sdpa["math_for_ours"] if sdpa else None),
        )
    )
    return [
        "**Targets** (issues 14 and 32; same run, same device, same precision for every implementation)",
        "",
        "| target | measured | status |",
        "| --- | --- | --- |",
    ] + [f"| {a} | {b} | {c} |" for a, b, c in rows]


def write_block(path: Path, block: str) -> None:
    """Replace the generated block in path (or append it; or create the file)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    begin, end = text.find(BEGIN), text.find(END)
    if begin >= 0 and end > begin:
        text = text[:begin] + block + text[end + len(END) :]
    elif begin >= 0 or end >= 0:
        fail(f"{path} has only one of the markers {BEGIN} ... {END}: fix it by hand")
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + ("\n" if text else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data",
        default=DATA,
        help=f"directory with Multi30k's {{train,valid,test}}.{{de,en}}, inside the repository on the GPU "
        f"machine (default {DATA}, which --prepare-data writes)",
    )
    ap.add_argument(
        "--vocab",
        default=VOCAB,
        help=f"the recipe's SentencePiece model, trained beforehand (default "
        f"{VOCAB}); without it the recipe trains one on the GPU's time",
    )
    ap.add_argument(
        "--prepare-data",
        metavar="MULTI30K_DIR",
        help="run nothing on a GPU: copy Multi30k into "
        "--data and train its vocabulary into --vocab, for carrying data/gpu to the GPU machine",
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default); cpu: the dry run, every step at toy sizes",
    )
    ap.add_argument("--toy", action="store_true", help="toy sizes on CUDA too (a quick check that every step runs)")
    ap.add_argument(
        "--steps", type=lambda s: s.split(","), help="run only these steps (comma-separated): " + ", ".join(NAMES)
    )
    ap.add_argument("--skip", type=lambda s: s.split(","), default=[], help="skip these steps (comma-separated)")
    ap.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="STEP=SECONDS",
        help="a step's time limit instead of its default (repeatable)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole command: each step gets at most what is "
        f"left, and is skipped with less than {MIN_STEP_S} s (430 fits the device tool's one call)",
    )
    ap.add_argument("--checkpoint", help="the model bench_decode decodes (default: the recipe step's run)")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the GPU's dense peak for MFU (default: the datasheet's for known GPUs, else measured)",
    )
    ap.add_argument(
        "--recipe-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="another --set for the recipe's training (repeatable)",
    )
    ap.add_argument(
        "--out-dir",
        default="runs/gpu_report",
        help="scratch space: step logs and JSON, run directories (replaced on each run)",
    )
    ap.add_argument("--json", help="the report (default OUT_DIR/gpu_report.json)")
    ap.add_argument(
        "--out-md",
        help="the markdown file whose generated block is replaced (default "
        "docs/benchmarks/log.md; for the dry run OUT_DIR/gpu_report.md)",
    )
    ap.add_argument(
        "--render",
        nargs="+",
        metavar="JSON",
        help="run nothing: merge these reports (later ones win per step) and write the block",
    )
    return ap


def main() -> None:
    ap = argument_parser()
    args = ap.parse_args()
    if args.prepare_data:
        prepare_data(Path(args.prepare_data), Path(args.data), Path(args.vocab))
        return
    limits = {}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        try:
            limits[name] = float(seconds)
        except ValueError:
            fail(f"--limit takes STEP=SECONDS, e.g. --limit recipe=300, got {item!r}")
    args.limit = limits
    for name in [*(args.steps or []), *args.skip, *limits]:
        if name not in NAMES:
            fail(f"unknown step {name!r}; the steps are {', '.join(NAMES)}")
    if args.render:
        reports = []
        for path in args.render:
            try:
                reports.append(json.loads(Path(path).read_text(encoding="utf-8")))
            except (OSError, ValueError) as e:
                fail(f"cannot read the report {path}: {e}")
        report = merge(reports)
        if args.json:
            write_json(Path(args.json), report)
        out_md = Path(args.out_md or ROOT / "docs" / "benchmarks" / "log.md")
        failed = False
    else:
        report = measure(args)
        out_md = Path(
            args.out_md
            or (Path(args.out_dir) / "gpu_report.md" if report["toy"] else ROOT / "docs" / "benchmarks" / "log.md")
        )
        failed = any(
            s["status"] in ("failed", "timeout", "interrupted") or s.get("reason", "").startswith("--budget")
            for s in report["steps"]
        )  # exit status 1: something to look at, or to run again
    write_block(out_md, render(report))
    print(f"gpu_report: wrote the generated block of {out_md}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
