"""The benchmark scripts run end to end at toy size and write their JSON (no timing is asserted): the counts they
report and the rates derived from them agree."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

import pytest

from tests.helpers import ROOT, sentences, subprocess_env
from transformer.config import load_config
from transformer.data.batch import source_limit
from transformer.device import cpu_description
from transformer.model.transformer import Transformer, count_parameters


def test_bench_train_runs_and_writes_json(tmp_path):
    out = tmp_path / "train.json"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench_train.py",
            "--config",
            "configs/tiny.yaml",
            "--vocab",
            "100",
            "--tokens",
            "64",
            "--length",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--impls",
            "ours,torch",
            "--peak-tflops",
            "0.1",
            "--profile",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["peak_flops"] == 0.1e12 and report["tokens"] == 64 and report["length"] == 8
    rows = {r["impl"]: r for r in report["results"]}
    assert list(rows) == ["ours", "torch"]
    for r in rows.values():
        assert r["sentences"] == 64 // 8 and len(r["step_s_all"]) == 2
        assert_a_host_profile(r["profile"], 3, result.stdout)  # --profile: one more update, its 3 costliest ops
        assert r["step_s_median"] == statistics.median(r["step_s_all"])
        assert r["tgt_tokens_per_s"] == pytest.approx(64 / r["step_s_median"])
        assert r["tokens_per_s"] == pytest.approx(2 * r["tgt_tokens_per_s"])  # source tokens as many as target
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.1)
    # The same work per update for both (FLOPs depend on the dimensions only); ours is the package's model.
    assert rows["ours"]["tflops_per_s"] * rows["ours"]["step_s_median"] == pytest.approx(
        rows["torch"]["tflops_per_s"] * rows["torch"]["step_s_median"]
    )
    assert rows["ours"]["params"] == count_parameters(Transformer(load_config(ROOT / "configs/tiny.yaml").model, 100))
    assert rows["ours"]["ours_speedup"] == 1.0
    assert rows["torch"]["ours_speedup"] == pytest.approx(
        rows["ours"]["tgt_tokens_per_s"] / rows["torch"]["tgt_tokens_per_s"]
    )
    table = result.stdout.splitlines()
    assert any(line.startswith("ours ") for line in table) and any(line.startswith("torch ") for line in table)
    assert "MFU" in result.stdout


def test_bench_memory_runs_both_precisions_and_probes_both_cache_settings(tmp_path):
    out = tmp_path / "memory.json"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench_memory.py",
            "--config",
            "configs/tiny.yaml",
            "--vocab",
            "100",
            "--set",
            "data.max_tokens=96",
            "--updates",
            "4",
            "--every",
            "2",
            "--probe-shapes",
            "40",
            "--probe-width",
            "32",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["cpu"] == cpu_description() and report["bounded_capacity"] == 64
    settings = {
        "default": {
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": None,
            "DNNL_PRIMITIVE_CACHE_CAPACITY": None,
            "LRU_CACHE_CAPACITY": None,
        },
        "bounded": {
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
            "DNNL_PRIMITIVE_CACHE_CAPACITY": None,
            "LRU_CACHE_CAPACITY": "64",
        },
    }
    runs = [(r["precision"], r["caches"]) for r in report["training"]]
    assert runs == [("fp32", "bounded"), ("bf16", "bounded")]  # the probe runs both settings
    for r in report["training"]:
        assert r["settings"] == settings[r["caches"]] and r["updates"] == 4 and 1 <= r["distinct_shapes"] <= 4
        assert [step for step, _ in r["rss_mib"]] == [2, 4]
        assert r["peak_mib"] >= max(rss for _, rss in r["rss_mib"]) > 0 and r["start_mib"] > 0
    assert [r["caches"] for r in report["probe"]] == ["default", "bounded"]
    for r in report["probe"]:
        assert r["settings"] == settings[r["caches"]] and r["width"] == 32
        assert [rows for rows, _ in r["growth_mib"]] == list(range(4, 41, 4))
    lines = result.stdout.splitlines()
    assert sum(line.startswith(("fp32 ", "bf16 ")) for line in lines) == 2 and "wrote" in lines[-1]


def _run_bench_decode(
    checkpoint, tmp_path, *options: str, repeats: int = 1
) -> tuple[subprocess.CompletedProcess, dict]:
    """bench_decode.py on a 12-sentence toy set with an untrained toy model; -> (process, its JSON)."""
    (tmp_path / "test.de").write_text("\n".join(sentences(1, 12)) + "\n", encoding="utf-8")
    (tmp_path / "test.en").write_text("\n".join(sentences(2, 12)) + "\n", encoding="utf-8")
    out = tmp_path / "decode.json"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench_decode.py",
            str(tmp_path / "test.de"),
            "--checkpoint",
            str(checkpoint),
            "--ref",
            str(tmp_path / "test.en"),
            "--device",
            "cpu",
            "--repeats",
            str(repeats),
            "--no-hf",
            *options,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text())


def _check_rates(row: dict) -> None:
    """What a row's rates are made of: its timed passes, its sentences and their output tokens."""
    assert len(row["times_s"]) == len(row["started_s"]) and row["median_s"] == statistics.median(row["times_s"])
    assert row["sentences_per_s"] == pytest.approx(row["sentences"] / row["median_s"])
    assert row["tokens_per_s"] == pytest.approx(row["target_tokens"] / row["median_s"])
    # Every output ends with EOS and holds at most source length (with EOS) + max_len_offset (4) tokens.
    longest = source_limit(max_positions=40) + 1 + 4
    assert row["sentences"] <= row["target_tokens"] <= row["sentences"] * (longest + 1)


def test_bench_decode_grid_of_stop_rules_and_dtypes(untrained_checkpoint, tmp_path):
    _, report = _run_bench_decode(
        untrained_checkpoint,
        tmp_path,
        "--beam",
        "1",
        "3",
        "--stop",
        "exact",
        "early",
        "--dtype",
        "fp32",
        "int8",
        repeats=2,
    )
    rows = {(r["beam"], r["stop"], r["dtype"]): r for r in report["results"]}
    assert report["cpu"] == cpu_description()
    for beam in (1, 3):
        _check_rounds([r for r in report["results"] if r["beam"] == beam], 2)
    # Greedy has no stop rule to vary; beam 3 runs the whole grid.
    assert sorted(rows) == sorted(
        [(1, "exact", "fp32"), (1, "exact", "int8")] + [(3, s, d) for s in ("exact", "early") for d in ("fp32", "int8")]
    )
    for r in rows.values():
        assert r["impl"] == "ours" and r["sentences"] == 12
        _check_rates(r)
        # A batch runs as long as its longest sentence: the steps of all batches are at least one sentence's.
        assert r["decoder_steps"] >= r["steps_per_sentence"] >= 1
        assert 0 <= r["bleu"] <= 100 and 0 <= r["same_as_first"] <= 1
    assert rows[1, "exact", "fp32"]["same_as_first"] == 1.0 and rows[3, "exact", "fp32"]["same_as_first"] == 1.0
    assert rows[1, "exact", "fp32"]["batches"] == rows[3, "early", "int8"]["batches"] >= 1
    for dtype in ("fp32", "int8"):  # the early rule never takes more steps
        assert rows[3, "early", dtype]["steps_per_sentence"] <= rows[3, "exact", dtype]["steps_per_sentence"]


def _check_rounds(rows: list[dict], repeats: int) -> None:
    """A beam's settings are timed in interleaved rounds: every setting's pass r starts before any pass r+1."""
    for row in rows:
        assert len(row["times_s"]) == repeats and row["started_s"] == sorted(row["started_s"])
    for r in range(repeats - 1):
        assert max(row["started_s"][r] for row in rows) < min(row["started_s"][r + 1] for row in rows)


def test_bench_decode_times_ctranslate2_itself_and_our_engine(ctranslate2, untrained_checkpoint, tmp_path):
    """CTranslate2 itself and our engine on it, per compute type; every ratio is against CTranslate2 itself."""
    result, report = _run_bench_decode(
        untrained_checkpoint,
        tmp_path,
        "--beam",
        "1",
        "2",
        "--stop",
        "early",
        "--ctranslate2",
        repeats=3,
    )
    assert report["ctranslate2"] == ctranslate2.__version__
    engines = ("ctranslate2_itself", "ctranslate2")
    for beam in (1, 2):
        rows = {(r["impl"], r["dtype"]): r for r in report["results"] if r["beam"] == beam}
        assert set(rows) == {("ours", "fp32")} | {(impl, dtype) for impl in engines for dtype in ("fp32", "int8")}
        _check_rounds(list(rows.values()), 3)
        for row in rows.values():
            _check_rates(row)
            for dtype in ("fp32", "int8"):  # paired: the median of the per-round speed ratios
                base = rows["ctranslate2_itself", dtype]["times_s"]
                assert row[f"vs_ct2_{dtype}"] == pytest.approx(
                    statistics.median(b / t for t, b in zip(row["times_s"], base))
                )
        assert rows["ctranslate2_itself", "fp32"]["vs_ct2_fp32"] == 1.0
        itself = rows["ctranslate2_itself", "fp32"]
        assert itself["max_batch_tokens"] >= 1 and itself["max_decoding_length"] == 39  # max_positions 40 - 1
    greedy = {r["impl"]: r for r in report["results"] if r["beam"] == 1 and r["dtype"] == "fp32"}
    # Greedy outputs of our engine are ours, limits included (an untrained model: <s> searched again, suppressed).
    assert greedy["ctranslate2"]["same_as_first"] == 1.0
    assert "ctranslate2_itself" in result.stdout


def test_compare_decode_runs_revisions_side_by_side(untrained_checkpoint, tmp_path):
    """Two copies of the working tree, the last commit and a folder holding a copy of the package (as on a machine
    without the history) load as separate packages in one process; a revision compared with itself has identical
    outputs, and the first revision's paired ratio is 1."""
    folder = tmp_path / "copy"
    shutil.copytree(ROOT / "transformer", folder / "transformer", ignore=shutil.ignore_patterns("__pycache__"))
    test_set = tmp_path / "test.txt"
    test_set.write_text("\n".join(sentences(5, 6)) + "\n")
    out = tmp_path / "compare.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "compare_decode.py"),
            str(test_set),
            "--checkpoint",
            str(untrained_checkpoint),
            "--rev",
            ".",
            "--rev",
            ".",
            "--rev",
            "HEAD",
            "--rev",
            str(folder),
            "--beam",
            "2",
            "--rounds",
            "2",
            "--threads",
            "1",
            "--max-tokens",
            "1",
            "--workers",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = report["results"]
    assert report["cpu"] == cpu_description()  # which machine: ratios differ between CPUs of one model name
    assert [r["rev"] for r in rows] == [".", ".", "HEAD", str(folder)]
    assert report["max_tokens"] == 1 and report["workers"] == 2 and report["device"] == "cpu"
    assert (
        rows[0]["time_vs_first"] == 1.0 and rows[1]["same_outputs_as_first"] == rows[3]["same_outputs_as_first"] == 1.0
    )
    for r in rows:
        assert len(r["times_s"]) == 2 and r["min_s"] <= r["median_s"] and 0 <= r["same_outputs_as_first"] <= 1


@pytest.mark.parametrize("engines", ["ours", "both"])
def test_bench_phases_splits_encoder_from_decoder(untrained_checkpoint, tmp_path, engines, request):
    """Every pass timed once per round; a split is the whole pass less the first, and the table prints it."""
    if engines == "both":
        request.getfixturevalue("ctranslate2")
    (tmp_path / "test.de").write_text("\n".join(sentences(1, 12)) + "\n", encoding="utf-8")
    out = tmp_path / "phases.json"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench_phases.py",
            str(tmp_path / "test.de"),
            "--checkpoint",
            str(untrained_checkpoint),
            "--beam",
            "2",
            "--rounds",
            "3",
            "--json",
            str(out),
            *(["--no-ctranslate2", "--profile", "4"] if engines == "ours" else []),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["sentences"] == 12 and report["beam"] == 2 and report["cpu"] == cpu_description()
    expected = {"ours"} | ({"CTranslate2"} if engines == "both" else set())
    assert set(report["split"]) == expected and len(report["times_s"]) == 2 * len(expected)
    for _name, times in report["times_s"].items():
        assert len(times) == 3 and all(t > 0 for t in times)
    for engine, split in report["split"].items():
        first, whole = (statistics.median(t) for name, t in report["times_s"].items() if name.startswith(engine))
        assert split == pytest.approx({"first_s": first, "whole_s": whole, "rest_s": whole - first})
        assert f"{engine:12} first pass {first:.3f}s" in result.stdout
    profile = report["profile"]
    if engines == "ours":  # the costliest operators first, each a share of all operators' time
        assert_a_host_profile(profile, 4, result.stdout)
        assert "gpu" not in profile  # a CPU run has no kernels to show
    else:
        assert profile == {}


def assert_a_host_profile(profile: dict, top: int, stdout: str) -> None:
    """common.operator_profile's host table: the costliest operators first, each a share of all operators' time,
    within the call's wall time, and printed."""
    ops = profile["host"]
    assert len(ops) == top and all(op["calls"] > 0 and 0 < op["share"] <= 1 for op in ops)
    assert [op["self_s"] for op in ops] == sorted((op["self_s"] for op in ops), reverse=True)
    assert sum(op["share"] for op in ops) <= 1 + 1e-9 and ops[0]["op"][:60] in stdout
    assert 0 < sum(op["self_s"] for op in ops) <= profile["host_s"] and profile["wall_s"] > 0


def test_bench_phases_on_cuda_asks_for_our_engine_alone(untrained_checkpoint, tmp_path):
    """CTranslate2 is timed on a CPU: --device cuda without --no-ctranslate2 is refused before anything loads."""
    (tmp_path / "test.de").write_text("ein Satz\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "scripts/bench_phases.py", str(tmp_path / "test.de")]
        + ["--checkpoint", str(untrained_checkpoint), "--device", "cuda"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 2 and "add --no-ctranslate2" in result.stderr


def test_bench_decode_on_an_imported_model_beside_generate_and_ctranslate2_from_the_hf_directory(
    marian_dir, ctranslate2, tmp_path
):
    """--hf-dir runs MarianMTModel.generate on the directory the run was imported from, --ct2-hf CTranslate2's own
    conversion of it, on the same sentences in the same rounds: greedy outputs are generate's."""
    pytest.importorskip("transformers")
    from tests.helpers import marian_sentences
    from transformer.inference.hf_import import import_hf

    run, _ = import_hf(marian_dir, tmp_path / "run")
    (tmp_path / "test.de").write_text("\n".join(marian_sentences(5, 8)) + "\n", encoding="utf-8")
    out = tmp_path / "decode.json"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench_decode.py",
            str(tmp_path / "test.de"),
            "--checkpoint",
            str(run),
            "--hf-dir",
            str(marian_dir),
            "--ct2-hf",
            "--ct2-hf-out",
            str(tmp_path / "ct2"),
            "--ct2-dtype",
            "fp32",
            "--beam",
            "1",
            "2",
            "--stop",
            "hf",
            "--device",
            "cpu",
            "--repeats",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = {(r["beam"], r["impl"]): r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == sorted((b, i) for b in (1, 2) for i in ("ours", "ct2_from_hf", "hf_generate"))
    assert (tmp_path / "ct2" / "model.bin").is_file()
    for beam in (1, 2):
        _check_rounds([r for r in rows.values() if r["beam"] == beam], 2)
    assert rows[1, "hf_generate"]["same_as_first"] == 1.0  # greedy: generate gives our outputs
    for row in rows.values():
        assert row["sentences"] == 8 and len(row["times_s"]) == 2 and 0 <= row["same_as_first"] <= 1


def test_bench_features_times_every_decoding_feature_beside_plain_beam(untrained_checkpoint, tmp_path):
    """bench_features.py on a 12-sentence toy set: a row per feature of issue 43, each paired with plain beam."""
    (tmp_path / "test.de").write_text("\n".join(sentences(1, 12)) + "\n", encoding="utf-8")
    (tmp_path / "test.en").write_text("\n".join(sentences(2, 12)) + "\n", encoding="utf-8")
    out = tmp_path / "features.json"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench_features.py",
            str(tmp_path / "test.de"),
            "--checkpoint",
            str(untrained_checkpoint),
        ]
        + ["--ref", str(tmp_path / "test.en"), "--rounds", "1", "--threads", "1", "--beam", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == [
        "beam 2",
        "greedy",
        "sample topk:10",
        "sample topp:0.9",
        "prefix (first word)",
        "constraints (1 word)",
        "alignments",
        "ensemble of 2",
    ]
    assert report["sentences"] == 12 and rows["beam 2"]["vs_beam"] == 1.0
    for row in rows.values():
        assert len(row["times_s"]) == 1 and row["sentences_per_s"] == pytest.approx(12 / row["times_s"][0])
        assert "bleu" in row and 0 <= row["outputs_like_beam"] <= 1
    # An ensemble of the checkpoint with itself and the alignment pass leave the outputs as they are.
    assert rows["ensemble of 2"]["outputs_like_beam"] == rows["alignments"]["outputs_like_beam"] == 1.0
    assert 0 <= rows["constraints (1 word)"]["constraints_met"] <= 1
    assert result.stdout.splitlines()[-1] == f"wrote {out}"


def bench_models(tmp_path, lines: list[str], *args) -> list[dict]:
    """scripts/bench_models.py on `lines` as sources and references (fp32), with `args`: its JSON's rows."""
    (tmp_path / "src.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "models.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_models.py", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "src.txt")]
        + [str(a) for a in args]
        + ["--dtype", "fp32", "--json", str(out)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())["rows"]


def test_bench_models_times_models_side_by_side(run, copy_model, tmp_path):
    """A model against itself and another: the first's ratio is 1, every model's rate is its sentences over its
    median time, BLEU where references are given."""
    rows = bench_models(tmp_path, sentences(3, 6), "--models", copy_model, run / "best.pt", "--rounds", "3")
    assert [r["model"] for r in rows] == [str(copy_model), str(run / "best.pt")]
    assert rows[0]["speed_vs_first"] == 1.0 and all(r["sentences"] == 6 and r["sentences_per_s"] > 0 for r in rows)
    # Each round's seconds are kept; the rate is over their median, the ratio the median of the rounds' ratios.
    first, second = (r["seconds_per_round"] for r in rows)
    assert len(first) == len(second) == 3 and rows[0]["ratio_per_round"] == [1.0] * 3
    assert rows[1]["sentences_per_s"] == round(6 / sorted(second)[1], 1)
    assert rows[1]["ratio_per_round"] == [round(a / b, 3) for a, b in zip(first, second)]
    assert rows[1]["speed_vs_first"] == round(sorted(a / b for a, b in zip(first, second))[1], 3)
    assert rows[0]["bleu"] == 100.0  # the copy model copies: its outputs are the references


def test_bench_models_times_each_model_without_and_with_its_shortlist(tmp_path):
    """--shortlist both: a row per model and setting, in that order; a copying model copies either way."""
    from tests.inference.test_shortlist import copy_run
    from transformer.inference.shortlist import write_shortlist

    checkpoint = copy_run(tmp_path)
    write_shortlist(str(tmp_path), None, None, frequent=5)
    rows = bench_models(tmp_path, sentences(5, 6), "--models", checkpoint, "--shortlist", "both", "--rounds", "1")
    assert [(r["model"], r["shortlist"]) for r in rows] == [(str(checkpoint), False), (str(checkpoint), True)]
    assert [r["bleu"] for r in rows] == [100.0, 100.0]


def bench_shapes(tmp_path, run, *shapes: list[str]) -> subprocess.CompletedProcess:
    """scripts/bench_shapes.py on the run fixture's 12 test pairs, one timed round, with these --shape groups."""
    data = run.parent / "data"
    argv = [sys.executable, "scripts/bench_shapes.py", str(data / "test.de"), "--ref", str(data / "test.en")]
    for shape in shapes:
        argv += ["--shape", *shape]
    argv += ["--rounds", "1", "--threads", "1", "--json", str(tmp_path / "shapes.json")]
    return subprocess.run(argv, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)


def test_bench_shapes_prices_a_shape_by_its_config_and_vocabulary_not_its_weights(run, tmp_path):
    """Each shape is the run's model with the overrides applied (its parameter count says so) and its own
    vocabulary; every output is as long as its reference in that vocabulary (+ EOS); the first is the baseline."""
    from tests.helpers import train_vocab
    from transformer.config import apply_overrides, from_dict
    from transformer.data.corpus import read_lines
    from transformer.data.vocab import vocab_from_stored
    from transformer.model.checkpoint import load_checkpoint

    small = train_vocab(sentences(5, 300), vocab_size=60)
    (tmp_path / "small.model").write_bytes(small.proto)
    result = bench_shapes(
        tmp_path,
        run,
        ["teacher", str(run)],
        [
            "student",
            str(run / "best.pt"),
            "model.n_decoder_layers=1",
            "model.d_ff=32",
            f"vocab={tmp_path / 'small.model'}",
        ],
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "shapes.json").read_text())["shapes"]
    assert [r["shape"] for r in rows] == ["teacher", "student"] and rows[0]["speed_vs_first"] == 1.0
    state = load_checkpoint(run / "best.pt")
    refs = read_lines(run.parent / "data" / "test.en")
    for row, overrides, vocab in [
        (rows[0], [], vocab_from_stored(state["vocab"])),
        (rows[1], ["model.n_decoder_layers=1", "model.d_ff=32"], small),
    ]:
        cfg = from_dict(apply_overrides(state["config"], overrides))
        assert row["parameters"] == count_parameters(Transformer(cfg.model, len(vocab)))
        assert row["vocab_size"] == len(vocab) and row["model"]["n_decoder_layers"] == cfg.model.n_decoder_layers
        lengths = [len(ids) + 1 for ids in vocab.encode_target(refs)]
        assert row["output_tokens"] == sum(lengths)
        assert max(lengths) <= row["decoder_steps"] <= sum(lengths)  # a batch runs as long as its longest
        assert len(row["seconds"]) == 1 and row["seconds"][0] > 0
        assert row["shape"] in result.stdout


def test_bench_shapes_names_a_bad_override_in_one_line(run, tmp_path):
    result = bench_shapes(tmp_path, run, ["teacher", str(run)], ["odd", str(run), "model.d_model=30"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("bench_shapes: ")


def test_bench_shapes_replays_a_search_whose_sentences_leave_at_their_reference_length(run, monkeypatch):
    """The replay decodes a batch's first step with a row per sentence, then `beam` rows for each sentence whose
    reference (+ EOS) is longer than the steps so far: a sentence leaves the batch once it has its length."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from bench_shapes import Shape

    from transformer.data.corpus import read_lines

    data = run.parent / "data"
    shape = Shape("s", str(run), [], read_lines(data / "test.de"), read_lines(data / "test.en"), beam=3)
    rows: list[int] = []
    decode = shape.model.decode_states
    monkeypatch.setattr(
        shape.model, "decode_states", lambda tokens, **kw: rows.append(len(tokens)) or decode(tokens, **kw)
    )
    shape.search()
    expected = []
    for src, lengths in shape.batches:
        expected += [src.size(0)] + [3 * sum(n > t for n in lengths) for t in range(1, max(lengths))]
    assert rows == expected and len(rows) == shape.steps and len(shape.batches) > 1


def scripts_common():
    """scripts/common.py as the scripts import it (they run with scripts/ first on the path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scripts_common", ROOT / "scripts" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("warm", [True, False])
def test_interleaved_times_each_pass_once_a_round_and_reverses_every_other_round(warm):
    calls = []
    passes = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = scripts_common().interleaved(passes, rounds=3, warm=warm)
    untimed = list("abc") if warm else []
    assert calls == untimed + list("abc") + list("cba") + list("abc")
    assert list(times) == list("abc") and all(len(t) == 3 and min(t) >= 0 for t in times.values())
