"""scripts/gpu_report.py without a GPU: its dry run (--device cpu) runs every step at toy sizes on a tiny synthetic
corpus, in the order of value, and records each step's command, status and figures; the CUDA tests skip themselves
and the stand-in tests of the same paths (tests/integration/test_cuda_paths.py) run beside them; it replaces only its own block
of a markdown file; nothing it runs imports `datasets` (the GPU machine has none); a step past its time limit is
stopped and recorded, the recipe is then scored by `transformer finish` and still decoded, a spent --budget skips
what is left, and partial reports merge; --prepare-data writes the corpus and vocabulary the GPU machine gets. No
timing is asserted.

The compiled training step (bench_train_compile) is deselected: Inductor compiles C++ on a CPU, minutes even at toy
size; it runs the same script and parser as bench_train, with --compile ours added."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["cuda_tests", "check_sdpa", "bench_train", "recipe", "bench_decode", "phases_decode", "bench_train_compile"]
WORDS = (
    "der die das ein eine mann frau kind hund katze haus auf dem im spielt läuft sitzt "
    "the a man woman child dog cat house on in plays runs sits red blue green big small"
).split()
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


# The suite runs test_cuda_paths.py itself: the dry run's CUDA step leaves out its four slowest tests (9 of its 10 s)
# and still has both files' outcomes to parse.
CUDA_STEP_SUBSET = "-k 'not tf32_leaves and not compute_with_tf32 and not peak_memory and not decoder_step_reads'"


def gpu_report(tmp: Path, *options: str, **env: str) -> subprocess.CompletedProcess:
    """The script in a subprocess, single-threaded, with a `datasets` on the path that records any import of it."""
    shadow = tmp / "shadow" / "datasets"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text(
        f"open({str(tmp / 'datasets_imported')!r}, 'a').write('imported\\n')\n"
        "raise ImportError('the GPU machine has no datasets package')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp / "shadow"), **env}
    return subprocess.run(
        [sys.executable, "scripts/gpu_report.py", *options],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_report")
    data = write_corpus(tmp / "corpus")
    md = tmp / "docs/benchmarks/log.md"
    md.parent.mkdir(parents=True)
    md.write_text(f"# Performance\n\nhand-written text\n\n{OLD_BLOCK}\n\n## After\n", encoding="utf-8")
    result = gpu_report(
        tmp,
        "--device",
        "cpu",
        "--data",
        str(data),
        "--out-dir",
        str(tmp / "out"),
        "--json",
        str(tmp / "report.json"),
        "--out-md",
        str(md),
        "--skip",
        "bench_train_compile",
        PYTEST_ADDOPTS=CUDA_STEP_SUBSET,
    )
    return tmp, result, json.loads((tmp / "report.json").read_text()), md.read_text(encoding="utf-8")


def test_dry_run_records_every_step_with_status_command_and_figures(dry_run):
    tmp, result, report, _ = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["toy"] and report["machine"]["device"] == "cpu"
    steps = {s["name"]: s for s in report["steps"]}
    assert [s["name"] for s in report["steps"]] == STEPS
    assert steps["bench_train_compile"]["status"] == "skipped" and not steps["bench_train_compile"]["selected"]
    for name in STEPS[:-1]:
        s = steps[name]
        assert s["status"] == "ok", (name, s.get("output_tail"), s.get("parse_error"))
        assert s["returncode"] == 0 and s["wall_s"] > 0 and s["limit_s"] > 0 and "parse_error" not in s
        assert s["command"].startswith("python3 ") and s["argv"][0] == sys.executable

    cuda = steps["cuda_tests"]["figures"]  # without CUDA the CUDA tests skip; the stand-in tests pass
    assert "tests/integration/test_cuda.py tests/integration/test_cuda_paths.py" in steps["cuda_tests"]["command"]
    by_file = {}
    for case in cuda["cases"]:
        by_file.setdefault(case["file"].split(".")[-1], set()).add(case["outcome"])
    assert by_file == {"test_cuda": {"skipped"}, "test_cuda_paths": {"passed"}}
    assert cuda["failed"] == cuda["errors"] == 0 and cuda["passed"] >= 30

    sdpa = steps["check_sdpa"]["figures"]
    assert {(r["call"], r["mask"]) for r in sdpa["rows"]} == {
        (call, mask)
        for call in ("encoder self-attention", "cross-attention", "decoding step, cross-attention")
        for mask in ("boolean", "additive")
    } | {("decoder self-attention", m) for m in ("boolean", "additive", "is_causal")}
    for row in sdpa["rows"]:
        assert row["ms"] > 0 and row["backends"]["math"] > 0 and row["kernel_eval"] in ("math", "flash_attention")
        assert row["max_diff_out"] < 1e-4 and row["max_diff_grad"] < 1e-4  # the same attention as the math kernel

    train = steps["bench_train"]["figures"]
    assert "--impls ours,marian" in steps["bench_train"]["command"]
    rows = {r["impl"]: r for r in train["results"]}
    assert set(rows) | {f["impl"] for f in train["failed"]} == {"ours", "marian"}  # a failure is named
    assert rows["ours"]["tgt_tokens_per_s"] > 0 and 0 < rows["ours"]["mfu"] and rows["ours"]["ours_speedup"] == 1.0
    assert train["peak_source"].startswith("measured")  # no datasheet for a CPU

    recipe = steps["recipe"]["figures"]
    assert "-m transformer train configs/multi30k.yaml" in steps["recipe"]["command"]
    assert recipe["reached_end"] and recipe["updates"] == recipe["max_steps"] == 6
    assert 0 <= recipe["test_bleu"] <= 100 and recipe["bleu_signature"].startswith("nrefs:1")
    assert recipe["wall_s"] >= recipe["training_seconds"] > 0 and 0 < recipe["mfu_last"] <= 1

    decode = steps["bench_decode"]["figures"]
    assert decode["checkpoint"] == str(tmp / "out" / "recipe" / "run")  # the model the recipe step trained
    ours = [r for r in decode["results"] if r["impl"] == "ours"]
    assert {r["beam"] for r in ours} == {1, 4} and {r["stop"] for r in ours} == {"exact"}
    assert all(r["sentences"] == 8 and r["sentences_per_s"] > 0 and 0 <= r["bleu"] <= 100 for r in ours)
    if importlib.util.find_spec("transformers") is not None:
        assert {r["beam"] for r in decode["results"] if r["impl"] == "hf_marian"} == {1, 4}

    phases = steps["phases_decode"]["figures"]  # the same model's beam-4 search, encoder apart, and its profile
    assert phases["checkpoint"] == decode["checkpoint"] and phases["beam"] == 4 and phases["sentences"] == 8
    split = phases["split"]["ours"]
    assert split["rest_s"] == split["whole_s"] - split["first_s"]
    # Every profile the steps took: each update's and the search's costliest host operators; a CPU has no kernels.
    profiles = [r["profile"] for r in train["results"]] + [phases["profile"]]
    for prof in profiles:
        assert len(prof["host"]) == 3 and prof["wall_s"] > 0 and "gpu" not in prof


def test_the_block_shows_each_profile_and_the_decoder_split(dry_run):
    _, result, report, md = dry_run
    assert result.returncode == 0
    steps = {s["name"]: s for s in report["steps"]}
    assert "**Profiles**" in md and "| the whole beam-4 search |" in md
    for r in steps["bench_train"]["figures"]["results"]:
        assert f"| one update, {r['impl']} |" in md
        assert f"`{r['profile']['host'][0]['op'][:48]}`" in md  # its costliest operator
    split = steps["phases_decode"]["figures"]["split"]["ours"]
    assert f"the decoder's steps {split['rest_s']:.3f} s" in md


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


def test_a_step_past_its_limit_is_stopped_the_recipe_finished_and_decoded_and_reports_merge(dry_run):
    tmp, _, first, _ = dry_run
    out = tmp / "capped"
    result = gpu_report(
        tmp,
        "--device",
        "cpu",
        "--data",
        str(tmp / "corpus"),
        "--out-dir",
        str(out),
        "--steps",
        "check_sdpa,recipe,bench_decode",
        "--limit",
        "check_sdpa=0.5",
        "--limit",
        "recipe=15",
        "--recipe-set",
        "train.max_steps=1000000",
        "--recipe-set",
        "train.valid_every=1",
        "--budget",
        "300",
    )
    assert result.returncode == 1, result.stderr[-3000:]  # a step timed out
    report = json.loads((out / "gpu_report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["check_sdpa"]["status"] == "timeout" and steps["check_sdpa"]["returncode"] != 0
    recipe = steps["recipe"]
    assert recipe["status"] == "timeout" and recipe["rescue"]["returncode"] == 0, recipe.get("output_tail")
    assert "-m transformer finish" in recipe["rescue"]["command"]
    f = recipe["figures"]
    assert not f["reached_end"] and 1 <= f["updates"] < f["max_steps"] and 0 <= f["test_bleu"] <= 100
    assert steps["bench_decode"]["status"] == "ok", steps["bench_decode"].get("output_tail")  # the rescued model
    assert [s["name"] for s in report["steps"] if s["selected"]] == ["check_sdpa", "recipe", "bench_decode"]
    assert not (tmp / "datasets_imported").exists()

    md = tmp / "merged.md"
    merged = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_report.py",
            "--render",
            str(tmp / "report.json"),
            str(out / "gpu_report.json"),
            "--out-md",
            str(md),
            "--json",
            str(tmp / "merged.json"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert merged.returncode == 0, merged.stderr
    steps = {s["name"]: s for s in json.loads((tmp / "merged.json").read_text())["steps"]}
    assert steps["check_sdpa"]["status"] == "timeout"  # the later report wins for a step both ran
    assert steps["cuda_tests"] == next(s for s in first["steps"] if s["name"] == "cuda_tests")  # only the first ran it
    assert "stopped at its time limit" in md.read_text() and "| check_sdpa | timeout" in md.read_text()
    assert "(--budget —, 300 s)" in md.read_text()  # each call's budget in order (the first ran without one)


def test_a_spent_budget_skips_the_steps_left_and_says_so(tmp_path):
    data = write_corpus(tmp_path / "corpus")
    result = gpu_report(
        tmp_path,
        "--device",
        "cpu",
        "--data",
        str(data),
        "--out-dir",
        str(tmp_path / "out"),
        "--steps",
        "check_sdpa,recipe",
        "--budget",
        "1",
    )
    assert result.returncode == 1  # something to run again
    steps = {s["name"]: s for s in json.loads((tmp_path / "out" / "gpu_report.json").read_text())["steps"]}
    for name in ("check_sdpa", "recipe"):
        assert steps[name]["status"] == "skipped" and steps[name]["reason"].startswith("--budget spent")
    assert "| recipe | skipped: --budget spent" in (tmp_path / "out" / "gpu_report.md").read_text()


def test_prepare_data_writes_the_corpus_and_a_vocabulary_inside_the_repository_layout(tmp_path):
    source = write_corpus(tmp_path / "source")
    data, vocab = tmp_path / "gpu" / "multi30k", tmp_path / "gpu" / "vocab" / "spm.model"
    result = gpu_report(tmp_path, "--prepare-data", str(source), "--data", str(data), "--vocab", str(vocab))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in data.iterdir()) == sorted(
        f"{s}.{lang}" for s in ("train", "valid", "test") for lang in ("de", "en")
    )
    assert (data / "train.de").read_bytes() == (source / "train.de").read_bytes()
    assert vocab.is_file() and sorted(p.name for p in vocab.parent.iterdir()) == ["spm.model"]
    from transformer.data.vocab import Vocab

    assert len(Vocab.load(vocab)) > 10
