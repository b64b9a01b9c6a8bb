"""The translate, evaluate and average commands end to end, on a tiny run directory built here."""

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer import cli
from transformer.checkpoint import load_model, save_checkpoint
from transformer.config import from_dict, to_dict
from transformer.model import Transformer
from transformer.translate import Translator, bleu_chrf, translate_ids
from transformer.vocab import train_vocab

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
    int8 = Translator(run / "best.pt", device="cpu", beam=1, int8=True)
    lines = synthetic(random.Random(5), 20) + [""]
    a, b = fp32.translate(lines), int8.translate(lines)
    assert len(b) == len(lines) and b[-1] == ""
    assert isinstance(int8.model.output, torch.ao.nn.quantized.dynamic.Linear)  # really the int8 path
    assert type(fp32.model.output) is torch.nn.Linear                            # and the float model untouched
    assert sum(x == y for x, y in zip(a, b)) >= len(lines) // 2  # quantization noise flips few argmaxes
    assert call("translate", str(run), "ein hund", "--int8", "--device", "cpu", capsys=capsys)[0] == 0
