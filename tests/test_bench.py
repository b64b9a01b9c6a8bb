"""The benchmark scripts run end to end at toy size and write their JSON (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, sentences, subprocess_env


def test_bench_train_runs_and_writes_json(tmp_path):
    out = tmp_path / "train.json"
    result = subprocess.run([sys.executable, "scripts/bench_train.py", "--config", "configs/tiny.yaml", "--vocab", "100",
                             "--tokens", "64", "--length", "8", "--steps", "2", "--warmup", "1", "--device", "cpu",
                             "--impls", "ours,torch", "--peak-tflops", "0.1", "--json", str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [r["impl"] for r in report["results"]] == ["ours", "torch"]
    for r in report["results"]:
        assert r["tgt_tokens_per_s"] > 0 and 0 < r["mfu"] and len(r["step_s_all"]) == 2
    assert "ours" in result.stdout and "MFU" in result.stdout


def _run_bench_decode(checkpoint, tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    """bench_decode.py on a 12-sentence toy set with an untrained toy model; -> (process, its JSON)."""
    (tmp_path / "test.de").write_text("\n".join(sentences(1, 12)) + "\n", encoding="utf-8")
    (tmp_path / "test.en").write_text("\n".join(sentences(2, 12)) + "\n", encoding="utf-8")
    out = tmp_path / "decode.json"
    result = subprocess.run([sys.executable, "scripts/bench_decode.py", str(tmp_path / "test.de"), "--checkpoint",
                             str(checkpoint), "--ref", str(tmp_path / "test.en"), "--device", "cpu",
                             "--repeats", "1", "--no-hf", *options, "--json", str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text())


def test_bench_decode_grid_of_stop_rules_and_dtypes(untrained_checkpoint, tmp_path):
    _, report = _run_bench_decode(untrained_checkpoint, tmp_path, "--beam", "1", "3", "--stop", "exact", "early",
                                  "--dtype", "fp32", "int8")
    rows = {(r["beam"], r["stop"], r["dtype"]): r for r in report["results"]}
    # Greedy has no stop rule to vary; beam 3 runs the whole grid.
    assert sorted(rows) == sorted([(1, "exact", "fp32"), (1, "exact", "int8")] +
                                  [(3, s, d) for s in ("exact", "early") for d in ("fp32", "int8")])
    for (beam, stop, dtype), r in rows.items():
        assert r["impl"] == "ours" and r["sentences"] == 12 and r["sentences_per_s"] > 0
        assert r["steps_per_sentence"] >= 1 and 0 <= r["bleu"] <= 100 and 0 <= r["same_as_first"] <= 1
    assert rows[1, "exact", "fp32"]["same_as_first"] == 1.0 and rows[3, "exact", "fp32"]["same_as_first"] == 1.0
    for dtype in ("fp32", "int8"):  # the early rule never takes more steps
        assert rows[3, "early", dtype]["steps_per_sentence"] <= rows[3, "exact", dtype]["steps_per_sentence"]


def test_bench_decode_times_ctranslate2_on_our_weights(ctranslate2, untrained_checkpoint, tmp_path):
    result, report = _run_bench_decode(untrained_checkpoint, tmp_path, "--beam", "1", "2", "--stop", "early",
                                       "--ctranslate2")
    assert report["ctranslate2"]
    for beam in (1, 2):
        rows = {(r["impl"], r["dtype"]): r for r in report["results"] if r["beam"] == beam}
        assert set(rows) == {("ours", "fp32"), ("ctranslate2", "fp32"), ("ctranslate2", "int8")}
        assert rows["ours", "fp32"]["vs_ct2_fp32"] > 0 and rows["ctranslate2", "fp32"]["vs_ct2_fp32"] == 1.0
    greedy = {r["dtype"]: r for r in report["results"] if r["beam"] == 1 and r["impl"] == "ctranslate2"}
    assert greedy["fp32"]["same_as_first"] == 1.0  # greedy outputs agree with ours, limits included
    assert "ctranslate2" in result.stdout
