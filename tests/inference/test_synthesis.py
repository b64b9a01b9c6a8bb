"""`transformer synthesize` (synthesis.py): pairs written from a model's translations, line for line; degenerate
outputs left out and counted; the record; a stopped run (kill -9) continued to the very bytes an uninterrupted run
writes, with beam search and with seeded samples; another command's directory refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, sentences, subprocess_env
from transformer.files import file_sha256
from transformer.inference.settings import SearchFlags
from transformer.inference.synthesis import RECORD, degenerate
from transformer.inference.translator import Translator

LINES = sentences(11, 23)


@pytest.mark.parametrize(
    "source, output, reason",
    [
        ("ein hund läuft", "", "empty"),
        ("ein hund läuft", "   ", "empty"),
        ("Ein Hund  läuft", "ein hund läuft", "copy"),
        ("ein hund", "a dog runs through the snow in the park next to a house by the river", "length_ratio"),
        ("ein großer hund läuft durch den schnee im park", "a", "length_ratio"),
        ("ein hund läuft", "a dog dog dog dog", "repetition"),
        ("ein hund läuft im park mit einem ball und einer katze", "a dog runs a dog runs a dog runs", "repetition"),
        ("ein hund läuft", "a dog runs", None),
        ("ein hund läuft", "a dog dog runs", None),  # a word twice in a row is language, not a loop
    ],
)
def test_degenerate_outputs_are_named(source, output, reason):
    assert degenerate(source, output) == reason


def synthesize(*args, env_extra=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "transformer", "synthesize", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(**(env_extra or {})),
        cwd=ROOT,
        **kwargs,
    )


def test_the_pairs_are_the_input_lines_and_their_translations_with_a_record(run, tmp_path, call):
    source = tmp_path / "mono.de"
    source.write_text("\n".join(LINES[:10] + [""] + LINES[10:]) + "\n", encoding="utf-8")
    options = ["--dtype", "fp32", "--no-filter", "--chunk-lines", "4"]
    command = ["synthesize", run, "--input", source, "--out", tmp_path / "syn", *options]
    status, _, err = call(*command)
    assert status == 0, err
    ins = (tmp_path / "syn" / "train.de").read_text(encoding="utf-8").splitlines()
    outs = (tmp_path / "syn" / "train.en").read_text(encoding="utf-8").splitlines()
    expected = Translator(run, "cpu", SearchFlags(dtype="fp32")).translate(LINES)
    assert ins == LINES and outs == expected  # the blank line is no pair
    total = len(LINES) + 1
    shown = re.findall(r"synthesize: (\d+) of (\d+) lines, \d+ lines/s, \d+ min left", err)  # a log line per part
    assert [(int(n), int(of)) for n, of in shown] == [(min(n, total), total) for n in range(4, total + 4, 4)]
    record = json.loads((tmp_path / "syn" / RECORD).read_text(encoding="utf-8"))
    assert record["status"] == "done" and record["counts"]["sources"] == len(LINES) + 1
    assert record["counts"]["kept"] == len(LINES) == record["counts"]["outputs"]
    checkpoint = run / "best.pt"
    assert record["models"] == [{"path": str(checkpoint.resolve()), "sha256": file_sha256(checkpoint)}]
    assert record["languages"] == {"input": "de", "output": "en"} and record["settings"]["beam"] == 3
    assert not (tmp_path / "syn" / "parts").exists()
    status, _, err = call(*command)
    assert status == 0 and "is complete" in err  # the same command again: nothing to do
    status, _, err = call(*command, "--beam", "1")
    assert status == 2 and "holds a synthesis of other settings" in err, err


def test_filtered_outputs_are_counted_by_reason_and_n_samples_make_n_pairs(run, tmp_path, call):
    source = tmp_path / "mono.de"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    status, _, err = call(
        "synthesize",
        run,
        "--input",
        source,
        "--out",
        tmp_path / "syn",
        "--sample",
        "topk:5",
        "--seed",
        "3",
        "--nbest",
        "2",
    )
    assert status == 0, err
    record = json.loads((tmp_path / "syn" / RECORD).read_text(encoding="utf-8"))
    counts = record["counts"]
    assert counts["outputs"] == 2 * len(LINES)
    assert counts["kept"] + sum(counts["left_out"].values()) == counts["outputs"]
    pairs = list(
        zip(
            *(
                p.read_text(encoding="utf-8").splitlines()
                for p in (tmp_path / "syn" / "train.de", tmp_path / "syn" / "train.en")
            )
        )
    )
    assert len(pairs) == counts["kept"] and all(degenerate(s, t) is None for s, t in pairs)
    assert "left out" in err


@pytest.mark.parametrize("search", [("--beam", "2"), ("--sample", "topp:0.9", "--seed", "7")], ids=["beam", "sample"])
def test_killed_half_way_and_run_again_it_writes_what_an_uninterrupted_run_writes(run, tmp_path, search):
    source = tmp_path / "mono.de"
    source.write_text("\n".join(LINES * 3) + "\n", encoding="utf-8")
    common = ["--input", source, "--dtype", "fp32", "--chunk-lines", "3", "--device", "cpu", *search]
    straight = synthesize(run, *common, "--out", tmp_path / "straight")
    assert straight.wait(timeout=300) == 0, straight.stderr.read()
    stopped = synthesize(run, *common, "--out", tmp_path / "stopped")
    parts, deadline = tmp_path / "stopped" / "parts", time.monotonic() + 120
    while not (parts.is_dir() and len(list(parts.glob("*.json"))) >= 4) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(stopped.pid, signal.SIGKILL)
    stopped.wait(timeout=60)
    assert not (tmp_path / "stopped" / "train.en").exists()  # stopped before the end
    again = synthesize(run, *common, "--out", tmp_path / "stopped")
    assert again.wait(timeout=300) == 0, again.stderr.read()
    for name in ("train.de", "train.en"):
        assert (tmp_path / "stopped" / name).read_bytes() == (tmp_path / "straight" / name).read_bytes()
    assert (
        json.loads((tmp_path / "stopped" / RECORD).read_text())["counts"]
        == json.loads((tmp_path / "straight" / RECORD).read_text())["counts"]
    )


def test_the_input_counts_by_its_content_not_its_path_or_time(run, tmp_path, call):
    """A corpus copied or mounted afresh (a new path, a new modification time) is the same input: the finished
    synthesis is not redone, and one made before records held content hashes is matched on size and lines; the
    same path with other text of the same size is another input, refused."""
    source = tmp_path / "mono.de"
    source.write_text("\n".join(LINES[:6]) + "\n", encoding="utf-8")
    options = ["--dtype", "fp32", "--no-filter", "--beam", "1"]
    out = tmp_path / "syn"
    status, _, err = call("synthesize", run, "--input", source, "--out", out, *options)
    assert status == 0, err
    elsewhere = tmp_path / "mounted" / "mono.de"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(source.read_bytes())
    os.utime(elsewhere, ns=(1, 1))
    status, _, err = call("synthesize", run, "--input", elsewhere, "--out", out, *options)
    assert status == 0 and "is complete" in err, err

    record_path = out / RECORD
    record = json.loads(record_path.read_text(encoding="utf-8"))
    legacy = {k: v for k, v in record["input"].items() if k != "sha256"} | {"mtime_ns": 123}
    record_path.write_text(json.dumps({**record, "input": legacy}), encoding="utf-8")
    status, _, err = call("synthesize", run, "--input", source, "--out", out, *options)
    assert status == 0 and "is complete" in err, err

    record_path.write_text(json.dumps(record), encoding="utf-8")
    text = source.read_text(encoding="utf-8")
    changed = text.replace(text[0], "X" if text[0] != "X" else "Y", 1)  # one letter: the same size and lines
    assert len(changed.encode()) == len(text.encode()) and changed != text
    source.write_text(changed, encoding="utf-8")
    status, _, err = call("synthesize", run, "--input", source, "--out", out, *options)
    assert status == 2 and "holds a synthesis of other input" in err, err
