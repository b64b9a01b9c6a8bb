"""The translate, evaluate and average commands end to end, on tiny run directories built here; dtypes, stop
rules and the CTranslate2 engine."""

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer import cli, translate
from transformer.batch import Batch
from transformer.checkpoint import load_model, save_checkpoint
from transformer.config import from_dict, to_dict
from transformer.evaluate import bleu_chrf
from transformer.model import Transformer
from transformer import device as device_module
from transformer.device import cpu_bf16_flags
from transformer.translate import Translator, pick_dtype, search_ids, translate_ids
from transformer.vocab import PAD_ID, train_vocab

WORDS = ("ein zwei drei hund katze mann frau kind spielt läuft auf der die das im park mit einem ball "
         "sitzt steht vor haus baum wasser rot blau grün").split()


def synthetic(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(n)]


def raw_config(data_dir: Path, run_dir: Path, d_ff: int = 64) -> dict:
    return {
        "model": {"d_model": 32, "n_heads": 4, "n_encoder_layers": 1, "n_decoder_layers": 2, "d_ff": d_ff,
                  "dropout": 0.0, "max_positions": 40},
        "data": {"dir": str(data_dir), "src_lang": "de", "tgt_lang": "en", "vocab_size": 80,
                 "max_len": 30, "max_tokens": 64},
        "train": {"run_dir": str(run_dir)},
        "decode": {"beam": 3, "lenpen": 0.6, "max_len_offset": 4, "max_tokens": 64},
    }


def write_checkpoint(path: Path, raw: dict, vocab, seed: int) -> None:
    cfg = from_dict(raw)
    torch.manual_seed(seed)
    model = Transformer(cfg.model, len(vocab))
    with torch.no_grad():
        model.output.weight.mul_(3.0)  # peaky, so that outputs differ between sentences
    # Deliberately only what translation needs: no optimizer, scheduler or step.
    save_checkpoint({"config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict()}, path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only spin
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("translate")
    rng = random.Random(0)
    data_dir, run_dir = root / "data", root / "run"
    data_dir.mkdir()
    (data_dir / "test.de").write_text("\n".join(synthetic(rng, 12)) + "\n", encoding="utf-8")
    (data_dir / "test.en").write_text("\n".join(synthetic(rng, 12)) + "\n", encoding="utf-8")
    vocab = train_vocab(synthetic(rng, 300), vocab_size=80)
    raw = raw_config(data_dir, run_dir)
    write_checkpoint(run_dir / "best.pt", raw, vocab, seed=1)
    write_checkpoint(run_dir / "step_00000100.pt", raw, vocab, seed=2)
    write_checkpoint(run_dir / "step_00000200.pt", raw, vocab, seed=3)
    write_checkpoint(root / "other_shape.pt", raw_config(data_dir, run_dir, d_ff=48), vocab, seed=4)
    return run_dir


def call(*argv, stdin: str = None, monkeypatch=None, capsys=None):
    """Run the CLI in-process; -> (exit status, stdout, stderr)."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    status = 0
    try:
        cli.main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


SENTENCES = ["ein hund spielt im park", "zwei katzen", "der mann sitzt auf einem roten haus vor dem baum"]


@pytest.fixture(scope="module")
def singles(run):
    """Each sentence translated alone: what any batching and ordering must reproduce."""
    translator = Translator(run, device="cpu")
    return [translator.translate([s])[0] for s in SENTENCES]


def test_translate_arguments_keep_order(run, singles, capsys):
    status, out, _ = call("translate", run, *SENTENCES, capsys=capsys)
    assert status == 0
    assert out.splitlines() == singles
    assert len(set(singles)) > 1  # the sentences do get different translations: the order check means something


def test_translate_input_file_with_empty_lines(run, singles, tmp_path, capsys):
    lines = [SENTENCES[0], "", SENTENCES[1], "   ", SENTENCES[2], ""]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    status, out, _ = call("translate", run, "--input", src, "--output", tmp_path / "out.txt", capsys=capsys)
    assert status == 0 and out == ""
    got = (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert got == [singles[0], "", singles[1], "", singles[2], ""]


def test_translate_stdin(run, singles, monkeypatch, capsys):
    status, out, _ = call("translate", run, stdin="\n".join(SENTENCES) + "\n", monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0 and out.splitlines() == singles


def test_translate_stdin_subprocess_streams_line_by_line(run, singles):
    """A real pipe: the first line's translation arrives before the second line is written."""
    proc = subprocess.Popen([sys.executable, "-m", "transformer", "translate", str(run), "--device", "cpu"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8",
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        proc.stdin.write(SENTENCES[0] + "\n")
        proc.stdin.flush()
        first = proc.stdout.readline().rstrip("\n")
        proc.stdin.write("\n".join(SENTENCES[1:]) + "\n")
        proc.stdin.close()
        rest = proc.stdout.read().splitlines()
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert [first] + rest == singles


def test_nbest_format(run, capsys):
    status, out, _ = call("translate", run, "--beam", "3", "--nbest", "3", SENTENCES[0], "", SENTENCES[1], capsys=capsys)
    assert status == 0
    rows = [line.split("\t") for line in out.split("\n")[:-1]]
    assert len(rows) == 9 and all(len(r) == 2 for r in rows)
    for group in (rows[0:3], rows[6:9]):
        scores = [float(r[0]) for r in group]
        assert scores == sorted(scores, reverse=True)
        assert len({r[1] for r in group}) == 3
    assert [r[1] for r in rows[3:6]] == ["", "", ""]


def test_nbest_larger_than_beam_is_an_error(run, capsys):
    status, _, err = call("translate", run, "--beam", "2", "--nbest", "3", "x", capsys=capsys)
    assert status == 2 and err.startswith("error:") and "--nbest" in err


def test_long_and_odd_inputs_do_not_crash(run, capsys):
    long_line = " ".join(["hund katze"] * 60)
    odd = ["\x00\x07 hund\x1b[31m katze", "😀🐕 " * 5, "\u2028 mann\u200b frau \ufeff", "\t"]
    status, out, err = call("translate", run, long_line, *odd, capsys=capsys)
    assert status == 0
    assert len(out.split("\n")[:-1]) == 1 + len(odd)
    assert "warning" in err and "truncat" in err


def test_translate_ids_keeps_order_and_matches_translator(run):
    model, vocab, cfg = load_model(run)
    ids = vocab.encode(SENTENCES)
    reordered = [ids[2], [], ids[0], ids[1]]
    out = translate_ids(model, reordered, beam=2, lenpen=0.6, max_len_offset=4, max_tokens=16, device="cpu")
    alone = [translate_ids(model, [s], beam=2, lenpen=0.6, max_len_offset=4, max_tokens=16, device="cpu")[0]
             for s in reordered]
    assert out == alone and out[1] == []


def test_evaluate_writes_hypotheses_and_scores(run, capsys):
    status, out, _ = call("evaluate", run, "--split", "test", "--beam", "2", capsys=capsys)
    assert status == 0
    hyp = (run / "eval" / "test.beam2.lp0.6.hyp").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyp) == len((run.parent / "data" / "test.de").read_text(encoding="utf-8").splitlines())
    scores = json.loads((run / "eval" / "test.beam2.lp0.6.json").read_text())
    assert 0 <= scores["bleu"] <= 100 and 0 <= scores["chrf"] <= 100 and scores["beam"] == 2
    assert "tok:13a" in scores["bleu_signature"] and "case:mixed" in scores["chrf_signature"]
    assert "BLEU" in out and "chrF" in out and scores["bleu_signature"] in out
    # Another beam writes beside it instead of over it.
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "1", "--lenpen", "0", capsys=capsys)
    assert status == 0 and json.loads((run / "eval" / "test.beam1.lp0.json").read_text())["beam"] == 1
    assert json.loads((run / "eval" / "test.beam2.lp0.6.json").read_text())["beam"] == 2


def test_evaluate_src_ref_files(run, tmp_path, capsys):
    (tmp_path / "a.de").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("a dog\ntwo cats\na man\n", encoding="utf-8")
    status, _, _ = call("evaluate", run, "--src", tmp_path / "a.de", "--ref", tmp_path / "a.en", capsys=capsys)
    assert status == 0 and len(list((run / "eval").glob("a.de.beam*.lp*.json"))) == 1


def test_evaluate_unknown_split(run, capsys):
    status, out, err = call("evaluate", run, "--split", "nosuch", capsys=capsys)
    assert status == 2 and err.startswith("error:") and "unknown split 'nosuch'" in err and "Traceback" not in err


def test_bleu_chrf_identity_is_perfect():
    scores = bleu_chrf(["A dog runs .", "Two cats"], ["A dog runs .", "Two cats"])
    assert scores["bleu"] == pytest.approx(100) and scores["chrf"] == pytest.approx(100)
    assert bleu_chrf(["a dog runs ."], ["A dog runs ."])["bleu"] < 100  # cased


def test_average_two_files_is_the_mean_and_loads(run, tmp_path, capsys):
    a, b = run / "step_00000100.pt", run / "step_00000200.pt"
    status, _, _ = call("average", a, b, "--output", tmp_path / "avg.pt", capsys=capsys)
    assert status == 0
    avg = torch.load(tmp_path / "avg.pt", weights_only=True)
    wa, wb = (torch.load(p, weights_only=True)["model"] for p in (a, b))
    assert avg["model"].keys() == wa.keys()
    for k in wa:
        torch.testing.assert_close(avg["model"][k], (wa[k] + wb[k]) / 2)
    assert "optimizer" not in avg
    load_model(tmp_path / "avg.pt")
    status, out, _ = call("translate", tmp_path / "avg.pt", SENTENCES[0], capsys=capsys)
    assert status == 0 and len(out.splitlines()) == 1


def test_average_last_n_of_run_dir(run, capsys):
    status, out, _ = call("average", run, "--last", "2", capsys=capsys)
    assert status == 0 and (run / "averaged.pt").is_file()
    status, _, err = call("average", run, "--last", "3", capsys=capsys)
    assert status == 2 and "holds 2" in err


def test_error_messages(run, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x00not a checkpoint" * 10)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((run / "best.pt").read_bytes()[:1000])
    cases = [
        (("translate", tmp_path / "missing.pt", "x"), "no such file"),
        (("translate", corrupt, "x"), "not a checkpoint"),
        (("evaluate", truncated), "truncated"),
        (("average", run / "best.pt", tmp_path / "missing.pt", "--output", tmp_path / "o.pt"), "no such file"),
        (("average", run / "best.pt", corrupt, "--output", tmp_path / "o.pt"), "not a checkpoint"),
        (("average", run / "best.pt", run.parent / "other_shape.pt", "--output", tmp_path / "o.pt"),
         "different model configs (differing: d_ff)"),
    ]
    for argv, message in cases:
        status, _, err = call(*argv, capsys=capsys)
        assert status == 2, argv
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, (argv, err)
    assert not (tmp_path / "o.pt").exists()


def test_int8_translation_runs_and_mostly_agrees(run, capsys):
    fp32 = Translator(run / "best.pt", device="cpu", beam=1)
    int8 = Translator(run / "best.pt", device="cpu", beam=1, dtype="int8")
    lines = synthetic(random.Random(5), 20) + [""]
    a, b = fp32.translate(lines), int8.translate(lines)
    assert len(b) == len(lines) and b[-1] == ""
    assert isinstance(int8.model.output, torch.ao.nn.quantized.dynamic.Linear)  # really the int8 path
    assert type(fp32.model.output) is torch.nn.Linear                            # and the float model untouched
    assert sum(x == y for x, y in zip(a, b)) >= len(lines) // 2  # quantization noise flips few argmaxes
    assert call("translate", str(run), "ein hund", "--int8", "--device", "cpu", capsys=capsys)[0] == 0


# --------------------------------------------------------------------------- dtype, stop rule, engines


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory) -> Path:
    """A checkpoint briefly trained to copy its input: peaky enough that most argmaxes are not near-ties."""
    root = tmp_path_factory.mktemp("copy")
    vocab = train_vocab(synthetic(random.Random(0), 300), vocab_size=80)
    cfg = from_dict(raw_config(root, root))
    torch.manual_seed(0)
    model = Transformer(cfg.model, len(vocab))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    sentences = vocab.encode(synthetic(random.Random(2), 3200))
    for step in range(100):
        batch = Batch.from_pairs([(s, s) for s in sentences[step * 32: step * 32 + 32]])
        logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.tgt_out, ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_checkpoint({"config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict()}, root / "model.pt")
    return root / "model.pt"


LINES = synthetic(random.Random(5), 40)


def test_cpu_bf16_flags_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert cpu_bf16_flags(info) == []
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_flags(info) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags(tmp_path / "missing") == []


def test_auto_dtype_is_bf16_only_where_native(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(device_module, "cpu_bf16_flags", lambda: [])
    assert pick_dtype("auto", cpu)[0] == "fp32"  # emulated bf16 is far slower than fp32
    monkeypatch.setattr(device_module, "cpu_bf16_flags", lambda: ["amx_bf16"])
    assert pick_dtype("auto", cpu) == ("bf16", "auto: this CPU has amx_bf16")
    for supported, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: supported)
        assert pick_dtype("auto", cuda)[0] == expected
    assert pick_dtype("int8", cpu)[0] == "int8"  # an explicit choice is kept


def test_translate_says_which_dtype_auto_picked(run, monkeypatch, capsys):
    monkeypatch.setattr(device_module, "cpu_bf16_flags", lambda: [])
    status, out, err = call("translate", run, "--device", "cpu", SENTENCES[0], capsys=capsys)
    assert status == 0 and err.splitlines() == ["dtype: fp32 (auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16))"]
    monkeypatch.setattr(device_module, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    translator = Translator(run, device="cpu", dtype="auto")
    assert translator.dtype == "bf16" and next(translator.model.parameters()).dtype == torch.bfloat16
    status, _, err = call("translate", run, "--device", "cpu", "--dtype", "fp32", SENTENCES[0], capsys=capsys)
    assert status == 0 and err == ""  # nothing to say about an explicit choice
    monkeypatch.setattr(device_module, "cpu_bf16_flags", lambda: [])
    status, _, err = call("translate", run, "--device", "cpu", "--dtype", "bf16", SENTENCES[0], capsys=capsys)
    assert status == 0 and err.startswith("warning:") and "emulated" in err  # unless it is a slow choice


@pytest.mark.parametrize("beam", [1, 3])
def test_bf16_translations_are_close_to_fp32(copy_model, beam):
    fp32 = Translator(copy_model, device="cpu", beam=beam).translate(LINES)
    bf16 = Translator(copy_model, device="cpu", beam=beam, dtype="bf16").translate(LINES)
    assert sum(a == b for a, b in zip(fp32, bf16)) >= 0.75 * len(LINES)
    assert len(set(fp32)) > len(LINES) // 2  # real, varied translations: the agreement above means something


def test_stop_rule_setting(run, capsys):
    model, vocab, _ = load_model(run)
    ids = vocab.encode(SENTENCES)
    for stop in ("exact", "early"):
        translator = Translator(run, device="cpu", beam=3, stop=stop)
        assert translator.stop == stop
        assert translator.search(ids, 3) == search_ids(model, ids, 3, 0.6, 4, 64, "cpu", 3, stop)
    assert Translator(run, device="cpu").stop == "exact"  # decode.stop's default
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "2", "--stop", "early", "--dtype", "bf16",
                        capsys=capsys)
    record = json.loads((run / "eval" / "test.beam2.lp0.6.early.bf16.json").read_text())
    assert status == 0 and record["stop"] == "early" and record["dtype"] == "bf16" and record["engine"] == "ours"
    status, _, err = call("translate", run, "--stop", "never", "x", capsys=capsys)
    assert status == 2 and "--stop" in err


def test_missing_ctranslate2_is_a_one_line_error(run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 now raises ImportError
    for argv in (("translate", run, "--engine", "ctranslate2", "x"), ("evaluate", run, "--engine", "ctranslate2"),
                 ("export", "ctranslate2", run, run.parent / "ct2_out")):
        status, _, err = call(*argv, capsys=capsys)
        assert status == 2 and len(err.splitlines()) == 1 and "transformer[ctranslate2]" in err, (argv, err)


@pytest.fixture(scope="module")
def ctranslate2():
    return pytest.importorskip("ctranslate2")


def test_ctranslate2_engine_greedy_equals_ours(ctranslate2, copy_model, capsys):
    ours = Translator(copy_model, device="cpu", beam=1).translate(LINES + [""])
    theirs = Translator(copy_model, device="cpu", beam=1, engine="ctranslate2")
    assert theirs.translate(LINES + [""]) == ours
    assert ours[-1] == "" and len(set(ours)) > len(LINES) // 2
    # Through the command, with the conversion reused.
    capsys.readouterr()
    status, out, err = call("translate", copy_model, "--beam", "1", "--engine", "ctranslate2", "--dtype", "fp32",
                            *LINES[:5], capsys=capsys)
    assert status == 0 and out.splitlines() == ours[:5] and "converting" not in err


def test_ctranslate2_engine_nbest_scores_are_ours(ctranslate2, copy_model):
    ours = Translator(copy_model, device="cpu", beam=3, lenpen=0.6).translate_nbest(LINES[:15], 3)
    theirs = Translator(copy_model, device="cpu", beam=3, lenpen=0.6, engine="ctranslate2").translate_nbest(LINES[:15], 3)
    shared = 0
    for mine, other in zip(ours, theirs):
        assert len(other) == 3 and [s for s, _ in other] == sorted((s for s, _ in other), reverse=True)
        scores = dict((text, score) for score, text in mine)
        for score, text in other:
            if text in scores:  # the same hypothesis found by both: the same score definition
                assert score == pytest.approx(scores[text], abs=1e-3)
                shared += 1
    assert shared >= 30  # most hypotheses are found by both, so the score check was not vacuous


def test_ctranslate2_conversion_is_cached_and_follows_the_checkpoint(ctranslate2, copy_model, tmp_path, capsys):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(copy_model.read_bytes())
    first = Translator(checkpoint, device="cpu", beam=1, engine="ctranslate2").translate(LINES[:8])
    model_bin = tmp_path / "ct2" / "model" / "model.bin"
    built = model_bin.stat().st_mtime_ns
    assert "converting" in capsys.readouterr().err
    os.utime(checkpoint)  # touched, same bytes: the sha256 says it is current
    assert Translator(checkpoint, device="cpu", beam=1, engine="ctranslate2").translate(LINES[:8]) == first
    assert model_bin.stat().st_mtime_ns == built and "converting" not in capsys.readouterr().err
    state = torch.load(checkpoint, weights_only=True)
    state["model"]["output.weight"] = -state["model"]["output.weight"]  # (tied) a different model
    save_checkpoint(state, checkpoint)
    changed = Translator(checkpoint, device="cpu", beam=1, engine="ctranslate2").translate(LINES[:8])
    assert "converting" in capsys.readouterr().err
    assert changed == Translator(checkpoint, device="cpu", beam=1).translate(LINES[:8]) != first


def test_evaluate_with_ctranslate2(ctranslate2, run, capsys):
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "2", "--engine", "ctranslate2",
                        "--dtype", "int8", capsys=capsys)
    record = json.loads((run / "eval" / "test.beam2.lp0.6.int8.ct2.json").read_text())
    assert status == 0 and record["engine"] == "ctranslate2" and record["dtype"] == "int8" and record["stop"] is None


def test_ctranslate2_engine_at_the_length_limit(ctranslate2, run):
    """An untrained model runs to its length limits, which differ per sentence but are one per CTranslate2
    call: outputs are cut to each sentence's own limit and rescored, so they still equal ours."""
    lines = synthetic(random.Random(6), 12)
    ours = Translator(run, device="cpu", beam=1)
    theirs = Translator(run, device="cpu", beam=1, engine="ctranslate2")
    ids = ours.encode(lines)
    mine, other = ours.search(ids), theirs.search(ids)
    limits = [len(s) + 1 + ours.max_len_offset for s in ids]
    assert sum(len(h[0].tokens) == n for h, n in zip(mine, limits)) >= 3  # the limit case is exercised
    assert len(set(limits)) > 1
    for a, b in zip(mine, other):
        assert a[0].tokens == b[0].tokens and a[0].score == pytest.approx(b[0].score, abs=1e-3)
