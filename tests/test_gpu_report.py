"""scripts/gpu_report.py without a GPU: its dry run (--device cpu) runs every step at toy sizes on a tiny synthetic
corpus and records each step's command, status and figures; it replaces only its own block of a markdown file; nothing
it runs imports `datasets` (the GPU machine has none); a step past its time limit is stopped and recorded, the recipe
is then scored by `transformer finish`, and partial reports merge. No timing is asserted.

The compiled training benchmark (bench_train_compile) is deselected: Inductor compiles C++ on a CPU, about 30 s per
implementation even at toy size; it runs the same script and parser as bench_train, with --compile all added."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["cuda_tests", "check_sdpa", "bench_train", "bench_train_compile", "torchrun", "bench_decode",
         "bench_decode_ct2", "recipe"]
WORDS = ("der die das ein eine mann frau kind hund katze haus auf dem im spielt läuft sitzt "
         "the a man woman child dog cat house on in plays runs sits red blue green big small").split()
OLD_BLOCK = "<!-- gpu_report:begin -->\nan earlier report\n<!-- gpu_report:end -->"


def write_corpus(directory: Path, seed: int = 0) -> Path:
    """Multi30k's file names over a reversal task: the target is the source's words reversed."""
    directory.mkdir(parents=True)
    rng = random.Random(seed)
    for split, n in (("train", 300), ("valid", 16), ("test", 16)):
        src = [[rng.choice(WORDS) for _ in range(rng.randint(2, 8))] for _ in range(n)]
        (directory / f"{split}.de").write_text("".join(" ".join(s) + "\n" for s in src), encoding="utf-8")
        (directory / f"{split}.en").write_text("".join(" ".join(s[::-1]) + "\n" for s in src), encoding="utf-8")
    return directory


def gpu_report(tmp: Path, *options: str) -> subprocess.CompletedProcess:
    """The script in a subprocess, single-threaded, with a `datasets` on the path that records any import of it."""
    shadow = tmp / "shadow" / "datasets"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text(f"open({str(tmp / 'datasets_imported')!r}, 'a').write('imported\\n')\n"
                                        "raise ImportError('the GPU machine has no datasets package')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp / "shadow")}
    return subprocess.run([sys.executable, "scripts/gpu_report.py", *options], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_report")
    data = write_corpus(tmp / "corpus")
    md = tmp / "PERFORMANCE.md"
    md.write_text(f"# Performance\n\nhand-written text\n\n{OLD_BLOCK}\n\n## After\n", encoding="utf-8")
    result = gpu_report(tmp, "--device", "cpu", "--data", str(data), "--out-dir", str(tmp / "out"),
                        "--json", str(tmp / "report.json"), "--out-md", str(md), "--skip", "bench_train_compile")
    return tmp, result, json.loads((tmp / "report.json").read_text()), md.read_text(encoding="utf-8")


def test_dry_run_records_every_step_with_status_command_and_figures(dry_run):
    tmp, result, report, _ = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["toy"] and report["machine"]["device"] == "cpu"
    steps = {s["name"]: s for s in report["steps"]}
    assert [s["name"] for s in report["steps"]] == STEPS
    assert steps["bench_train_compile"]["status"] == "skipped" and not steps["bench_train_compile"]["selected"]
    ct2 = importlib.util.find_spec("ctranslate2") is not None
    expected = {"cuda_tests": "skipped", "bench_decode_ct2": "ok" if ct2 else "skipped"}
    for name in ("cuda_tests", "check_sdpa", "bench_train", "torchrun", "bench_decode", "recipe") + (
            ("bench_decode_ct2",) if ct2 else ()):
        s = steps[name]
        assert s["status"] == expected.get(name, "ok"), (name, s.get("output_tail"), s.get("parse_error"))
        assert s["returncode"] == 0 and s["wall_s"] > 0 and s["limit_s"] > 0 and "parse_error" not in s
        assert s["command"].startswith("python3 ") and s["argv"][0] == sys.executable

    cuda = steps["cuda_tests"]["figures"]  # pytest ran the file; without CUDA every test skipped itself
    assert "tests/test_cuda.py" in steps["cuda_tests"]["command"]
    assert cuda["tests"] >= 1 and cuda["skipped"] == cuda["tests"] and cuda["passed"] == 0

    sdpa = steps["check_sdpa"]["figures"]["ms"]
    assert set(sdpa) == {"encoder (padding)", "decoder (causal & padding)", "no mask"}
    assert all(ms["math"] > 0 and ms["default"] > 0 for ms in sdpa.values())

    train = steps["bench_train"]["figures"]
    assert "--impls ours,marian,torch" in steps["bench_train"]["command"]
    rows = {r["impl"]: r for r in train["results"]}
    assert set(rows) | {f["impl"] for f in train["failed"]} == {"ours", "marian", "torch"}  # a failure is named
    assert rows["ours"]["tgt_tokens_per_s"] > 0 and rows["ours"]["mfu"] > 0 and rows["ours"]["ours_speedup"] == 1.0

    assert "torch.distributed.run --standalone --nproc_per_node=1 -m transformer train" in steps["torchrun"]["command"]
    torchrun = steps["torchrun"]["figures"]
    assert torchrun["updates"] == 4 and torchrun["valid_loss"] > 0 and torchrun["tokens_per_s"] > 0

    decode = steps["bench_decode"]["figures"]
    assert decode["checkpoint"] == str(tmp / "out" / "torchrun" / "run")  # the model the torchrun step trained
    ours = [r for r in decode["results"] if r["impl"] == "ours"]
    assert {r["beam"] for r in ours} == {1, 4} and {r["stop"] for r in ours if r["beam"] == 4} == {"exact", "early"}
    assert all(r["sentences"] == 8 and r["sentences_per_s"] > 0 and 0 <= r["bleu"] <= 100 for r in ours)
    if ct2:
        assert {r["impl"] for r in steps["bench_decode_ct2"]["figures"]["results"]} == {"ours", "ctranslate2"}

    recipe = steps["recipe"]["figures"]
    assert "-m transformer train configs/multi30k.yaml" in steps["recipe"]["command"]
    assert recipe["reached_end"] and recipe["updates"] == recipe["max_steps"] == 6
    assert 0 <= recipe["test_bleu"] <= 100 and recipe["bleu_signature"].startswith("nrefs:1")
    assert recipe["wall_s"] >= recipe["training_seconds"] > 0


def test_nothing_the_dry_run_runs_imports_datasets(dry_run):
    tmp, result, _, _ = dry_run
    assert result.returncode == 0
    assert not (tmp / "datasets_imported").exists()


def test_the_generated_block_replaces_only_the_old_one(dry_run):
    _, _, report, md = dry_run
    assert md.startswith("# Performance\n\nhand-written text\n\n") and md.endswith("\n\n## After\n")
    assert "an earlier report" not in md
    assert md.count("<!-- gpu_report:begin") == 1 and md.count("<!-- gpu_report:end -->") == 1
    assert "**Dry run at toy sizes**" in md and report["machine"]["device_name"] in md
    for step in report["steps"]:
        assert f"| {step['name']} | {step['status']}" in md
        if step.get("command"):
            assert step["command"] in md  # the exact command, as run
    recipe = next(s for s in report["steps"] if s["name"] == "recipe")["figures"]
    assert f"test BLEU **{recipe['test_bleu']:.2f}**" in md


def test_a_step_past_its_limit_is_stopped_the_recipe_finished_and_reports_merge(dry_run):
    tmp, _, first, _ = dry_run
    out = tmp / "capped"
    result = gpu_report(tmp, "--device", "cpu", "--data", str(tmp / "corpus"), "--out-dir", str(out),
                        "--steps", "check_sdpa,recipe", "--limit", "check_sdpa=0.5", "--limit", "recipe=10",
                        "--recipe-set", "train.max_steps=1000000", "--recipe-set", "train.valid_every=1")
    assert result.returncode == 1, result.stderr[-3000:]  # a step timed out
    report = json.loads((out / "gpu_report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["check_sdpa"]["status"] == "timeout" and steps["check_sdpa"]["returncode"] != 0
    recipe = steps["recipe"]
    assert recipe["status"] == "timeout" and recipe["rescue"]["returncode"] == 0, recipe.get("output_tail")
    assert "-m transformer finish" in recipe["rescue"]["command"]
    f = recipe["figures"]
    assert not f["reached_end"] and 1 <= f["updates"] < f["max_steps"] and 0 <= f["test_bleu"] <= 100
    assert [s["name"] for s in report["steps"] if s["selected"]] == ["check_sdpa", "recipe"]
    assert not (tmp / "datasets_imported").exists()

    md = tmp / "merged.md"
    merged = subprocess.run([sys.executable, "scripts/gpu_report.py", "--render", str(tmp / "report.json"),
                             str(out / "gpu_report.json"), "--out-md", str(md), "--json", str(tmp / "merged.json")],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert merged.returncode == 0, merged.stderr
    steps = {s["name"]: s for s in json.loads((tmp / "merged.json").read_text())["steps"]}
    assert steps["check_sdpa"]["status"] == "timeout"  # the later report wins for a step both ran
    assert steps["cuda_tests"] == next(s for s in first["steps"] if s["name"] == "cuda_tests")  # only the first ran it
    assert "stopped at its time limit" in md.read_text() and "| check_sdpa | timeout" in md.read_text()
