"""The benchmark scripts run end to end at toy size and write their JSON (no timing is asserted)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests.test_translate import raw_config, synthetic, write_checkpoint
from tests.trainutil import ROOT
from transformer.vocab import train_vocab

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_bench_train_runs_and_writes_json(tmp_path):
    out = tmp_path / "train.json"
    result = subprocess.run([sys.executable, "scripts/bench_train.py", "--config", "configs/tiny.yaml", "--vocab", "100",
                             "--tokens", "64", "--length", "8", "--steps", "2", "--warmup", "1", "--device", "cpu",
                             "--impls", "ours,torch", "--peak-tflops", "0.1", "--json", str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [r["impl"] for r in report["results"]] == ["ours", "torch"]
    for r in report["results"]:
        assert r["tgt_tokens_per_s"] > 0 and 0 < r["mfu"] and len(r["step_s_all"]) == 2
    assert "ours" in result.stdout and "MFU" in result.stdout


def _run_bench_decode(tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    """bench_decode.py on a 12-sentence toy set with an untrained toy model; -> (process, its JSON)."""
    vocab = train_vocab(synthetic(random.Random(0), 300), vocab_size=80)
    write_checkpoint(tmp_path / "model.pt", raw_config(tmp_path, tmp_path), vocab, seed=1)
    (tmp_path / "test.de").write_text("\n".join(synthetic(random.Random(1), 12)) + "\n", encoding="utf-8")
    out = tmp_path / "decode.json"
    result = subprocess.run([sys.executable, "scripts/bench_decode.py", str(tmp_path / "test.de"), "--checkpoint",
                             str(tmp_path / "model.pt"), "--device", "cpu", "--repeats", "1", "--no-hf", *options,
                             "--json", str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text())


def test_bench_decode_runs_and_writes_json(tmp_path):
    _, report = _run_bench_decode(tmp_path, "--beam", "1", "3", "--int8")
    rows = report["results"]
    assert [r["beam"] for r in rows] == [1, 3]
    assert all(r["ours"]["sentences_per_s"] > 0 and r["ours_int8"]["sentences_per_s"] > 0 for r in rows)


def test_bench_decode_times_ctranslate2_on_our_weights(tmp_path):
    pytest.importorskip("ctranslate2")
    result, report = _run_bench_decode(tmp_path, "--beam", "1", "2", "--int8", "--ctranslate2")
    assert report["ctranslate2"]
    for row in report["results"]:
        for name in ("ct2_float32", "ct2_int8"):
            assert row[name]["sentences_per_s"] > 0 and 0.0 <= row[name]["same_as_ours"] <= 1.0
    assert "ct2_float32" in result.stdout
