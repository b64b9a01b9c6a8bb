"""The `evaluate` command (inference/evaluation.py): hypotheses and scores written per setting, splits and files."""

import errno
import json
import os
import shutil
import threading

import pytest

from tests.helpers import SENTENCES
from transformer.inference import evaluation as evaluate_module
from transformer.inference.scoring import NAMES, SCORES
from transformer.inference.translator import Translator

# Result names carry the dtype unless it is fp32, and --dtype auto is bf16 on CPUs with native bf16: tests of
# the names pin fp32 so they hold on any CPU.
FP32 = ("--dtype", "fp32")


def test_evaluate_writes_hypotheses_and_scores(run, call):
    status, out, _ = call("evaluate", run, "--split", "test", "--beam", "2", *FP32)
    assert status == 0
    hyp = (run / "eval" / "test.beam2.lp0.6.hyp").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyp) == len((run.parent / "data" / "test.de").read_text(encoding="utf-8").splitlines())
    scores = json.loads((run / "eval" / "test.beam2.lp0.6.json").read_text())
    assert 0 <= scores["bleu"] <= 100 and 0 <= scores["chrf"] <= 100 and scores["beam"] == 2
    assert "tok:13a" in scores["bleu_signature"] and "case:mixed" in scores["chrf_signature"]
    assert "BLEU" in out and "chrF" in out and scores["bleu_signature"] in out
    for score in SCORES:  # every score, printed with its signature and kept in the JSON
        assert isinstance(scores[score.name], float) and scores[f"{score.name}_signature"] in out
    assert "comparison" not in scores
    # Another beam writes beside it instead of over it.
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "1", "--lenpen", "0", *FP32)
    assert status == 0 and json.loads((run / "eval" / "test.beam1.lp0.json").read_text())["beam"] == 1
    assert json.loads((run / "eval" / "test.beam2.lp0.6.json").read_text())["beam"] == 2


def test_evaluate_src_ref_files(run, tmp_path, call):
    (tmp_path / "a.de").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("a dog\ntwo cats\na man\n", encoding="utf-8")
    status, _, _ = call("evaluate", run, "--src", tmp_path / "a.de", "--ref", tmp_path / "a.en")
    assert status == 0 and len(list((run / "eval").glob("a.de.beam*.lp*.json"))) == 1


def test_evaluate_src_from_a_pipe_names_its_results_pipe(run, tmp_path, call):
    fifo = tmp_path / "63"  # what `--src <(zcat test.de.gz)` hands over: /dev/fd/63
    os.mkfifo(fifo)
    # A daemon: if evaluate failed before opening the FIFO, the writer would block for ever in open().
    writer = threading.Thread(
        target=lambda: fifo.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8"), daemon=True
    )
    writer.start()
    (tmp_path / "a.en").write_text("a dog\ntwo cats\na man\n", encoding="utf-8")
    status, out, err = call("evaluate", run, "--src", fifo, "--ref", tmp_path / "a.en", "--beam", "1", *FP32)
    writer.join(timeout=10)
    assert status == 0 and not writer.is_alive(), err
    record = json.loads((run / "eval" / "pipe.beam1.lp0.6.json").read_text())
    assert status == 0 and record["sentences"] == len(SENTENCES) and "pipe.beam1.lp0.6.hyp" in out
    assert not list((run / "eval").glob("63.*"))


def test_results_that_cannot_be_written_fail_before_translating(run, tmp_path, call, monkeypatch):
    """A read-only run used to translate the whole test set, then fail without showing the scores."""
    shutil.copy(run / "best.pt", tmp_path / "model.pt")
    (tmp_path / "eval").write_text("not a directory\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("a dog\ntwo cats\na man\n", encoding="utf-8")
    translated = []
    monkeypatch.setattr(Translator, "translate", lambda self, lines: translated.append(lines) or list(lines))
    status, out, err = call("evaluate", tmp_path / "model.pt", "--src", tmp_path / "a.de", "--ref", tmp_path / "a.en")
    assert status == 2 and out == "" and translated == []
    assert err.splitlines()[-1] == (
        f"error: evaluate: cannot write the results to {tmp_path / 'eval'} (it is a file, "
        "not a directory); evaluate a copy of the run or checkpoint in a directory you "
        "can write to"
    )
    (tmp_path / "eval").unlink()
    (tmp_path / "eval").symlink_to(tmp_path / "gone")  # e.g. results kept on a disk that is not mounted
    status, _, err = call("evaluate", tmp_path / "model.pt", "--src", tmp_path / "a.de", "--ref", tmp_path / "a.en")
    assert status == 2 and translated == []
    assert f"(it is a link to {tmp_path / 'gone'}, which does not exist)" in err.splitlines()[-1]
    (tmp_path / "eval").unlink()
    (tmp_path / "eval").symlink_to("a.de")  # relative to the link's directory; a file that exists
    status, _, err = call("evaluate", tmp_path / "model.pt", "--src", tmp_path / "a.de", "--ref", tmp_path / "a.en")
    assert status == 2 and "(it is a file, not a directory)" in err.splitlines()[-1]


def test_scores_are_printed_before_the_files_are_written(run, tmp_path, call, monkeypatch):
    shutil.copy(run / "best.pt", tmp_path / "model.pt")
    (tmp_path / "a.de").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("a dog\ntwo cats\na man\n", encoding="utf-8")

    def disk_full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluate_module, "atomic_write", disk_full)
    status, out, err = call("evaluate", tmp_path / "model.pt", "--src", tmp_path / "a.de", "--ref", tmp_path / "a.en")
    assert status == 2 and "No space left on device" in err
    assert "BLEU" in out and "chrF" in out  # what the translating was for is not lost


def test_evaluate_unknown_split(run, call):
    status, out, err = call("evaluate", run, "--split", "nosuch")
    assert status == 2 and err.startswith("error:") and "unknown split 'nosuch'" in err and "Traceback" not in err
    # valid is a split of every run: its files are missing (this data.dir holds only the test split), not unknown.
    status, out, err = call("evaluate", run, "--split", "valid")
    assert status == 2 and err.startswith("error: evaluate: split 'valid': data:") and "unknown" not in err, err


def test_a_broken_split_is_reported_as_such_not_as_unknown(run, call):
    data = run.parent / "data"
    (data / "uneven.de").write_text("ein hund\nzwei katzen\n", encoding="utf-8")
    (data / "uneven.en").write_text("a dog\n", encoding="utf-8")
    status, _, err = call("evaluate", run, "--split", "uneven")
    assert status == 2 and err == (
        f"error: data: {data}/uneven.de has 2 lines but {data}/uneven.en has 1; "
        "line N of one side must translate line N of the other\n"
    )


def test_evaluate_with_ctranslate2(ctranslate2, run, call):
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "2", "--engine", "ctranslate2", "--dtype", "int8")
    record = json.loads((run / "eval" / "test.beam2.lp0.6.int8.ct2.json").read_text())
    assert status == 0 and record["engine"] == "ctranslate2" and record["dtype"] == "int8" and record["stop"] is None


def test_two_checkpoints_of_one_run_write_results_of_their_own(run, call):
    """evaluate RUN/best.pt and RUN/step_...pt on the same split must not overwrite each other's results."""
    for name in ("best", "step_00000100"):
        status, _, err = call("evaluate", run / f"{name}.pt", "--split", "test", "--beam", "1", *FP32)
        assert status == 0, err
    assert (run / "eval" / "best.test.beam1.lp0.6.json").is_file()
    assert (run / "eval" / "step_00000100.test.beam1.lp0.6.json").is_file()


def test_other_sentences_under_the_same_file_name_do_not_overwrite_results(run, tmp_path, call):
    """wmt14/newstest.de then wmt17/newstest.de: both results stay; the same file again replaces its own."""
    for corpus, sentences in (("wmt14", SENTENCES), ("wmt17", SENTENCES[::-1])):
        (tmp_path / corpus).mkdir()
        (tmp_path / corpus / "newstest.de").write_text("\n".join(sentences) + "\n", encoding="utf-8")
        (tmp_path / corpus / "newstest.en").write_text("a dog\ntwo cats\na man\n", encoding="utf-8")
    evaluated = []
    for corpus in ("wmt14", "wmt17", "wmt14"):
        status, _, err = call(
            "evaluate",
            run,
            "--src",
            tmp_path / corpus / "newstest.de",
            "--ref",
            tmp_path / corpus / "newstest.en",
            "--beam",
            "1",
            *FP32,
        )
        assert status == 0, err
        evaluated.append(err)
    results = sorted((run / "eval").glob("newstest.de*.beam1.lp0.6.json"))
    assert len(results) == 2, results
    by_src = {json.loads(p.read_text())["src"]: p.name for p in results}
    assert by_src[str(tmp_path / "wmt14" / "newstest.de")] == "newstest.de.beam1.lp0.6.json"
    assert by_src[str(tmp_path / "wmt17" / "newstest.de")].startswith("newstest.de.")  # with the inputs' digest
    assert "holds the scores of other sentences" in evaluated[1] and "other sentences" not in evaluated[2]
    # The same files edited, the plain name's and the digest name's: their results are replaced, not kept beside.
    for corpus, edited in (("wmt14", SENTENCES[1:3] + SENTENCES[:1]), ("wmt17", SENTENCES[2:0:-1] + SENTENCES[:1])):
        (tmp_path / corpus / "newstest.de").write_text("\n".join(edited) + "\n", encoding="utf-8")
        status, _, err = call(
            "evaluate",
            run,
            "--src",
            tmp_path / corpus / "newstest.de",
            "--ref",
            tmp_path / corpus / "newstest.en",
            "--beam",
            "1",
            *FP32,
        )
        assert status == 0 and "other sentences" not in err, err
    assert sorted(p.name for p in (run / "eval").glob("newstest.de*.beam1.lp0.6.json")) == sorted(by_src.values())


def test_the_same_split_replaces_its_results_though_its_sentences_changed(run, call):
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "3", *FP32)
    record = run / "eval" / "test.beam3.lp0.6.json"
    changed = {**json.loads(record.read_text()), "inputs_sha256": "0" * 64}  # as if the test files were edited
    record.write_text(json.dumps(changed))
    status, _, err = call("evaluate", run, "--split", "test", "--beam", "3", *FP32)
    assert status == 0 and "other sentences" not in err
    assert json.loads(record.read_text())["inputs_sha256"] != "0" * 64
    assert not list((run / "eval").glob("test.*.beam3.lp0.6.json"))


# --------------------------------------------------------------------------- comparing systems


def test_compare_translates_another_checkpoint_and_keeps_the_table_in_the_baselines_json(run, call):
    other = run / "step_00000100.pt"
    status, out, err = call("evaluate", run, "--split", "test", "--beam", "1", *FP32, "--compare", other)
    assert status == 0, err
    record = json.loads((run / "eval" / "test.beam1.lp0.6.json").read_text())
    comparison = record["comparison"]
    assert [row["system"] for row in comparison["systems"]] == [str(run), str(other)]
    assert comparison["resamples"] == 1000 and comparison["seed"] == 12345
    for name in NAMES:
        assert {"score", "mean", "ci", "delta", "delta_ci", "p"} <= set(comparison["systems"][1][name])
        assert comparison["systems"][0][name]["score"] == record[name]  # the baseline's own scores
    # The other checkpoint's results are its own, as `evaluate` of it alone would write them.
    alone = json.loads((run / "eval" / "step_00000100.test.beam1.lp0.6.json").read_text())
    assert comparison["systems"][1]["bleu"]["score"] == alone["bleu"] and "comparison" not in alone
    assert "paired bootstrap resampling" in out and f"wrote the comparison to {run / 'eval'}" in out


def test_compare_takes_a_file_of_translations(run, tmp_path, call):
    references = (run.parent / "data" / "test.en").read_text(encoding="utf-8")
    (tmp_path / "perfect.txt").write_text(references, encoding="utf-8")
    status, out, err = call(
        "evaluate", run, "--split", "test", "--beam", "1", *FP32, "--compare", tmp_path / "perfect.txt"
    )
    assert status == 0, err
    row = json.loads((run / "eval" / "test.beam1.lp0.6.json").read_text())["comparison"]["systems"][1]
    assert row["system"] == str(tmp_path / "perfect.txt")
    for score in SCORES:  # the references themselves: each score at its best, and better than the baseline
        assert row[score.name]["score"] == pytest.approx(100 if score.higher_is_better else 0)
        assert (row[score.name]["delta"] > 0) == score.higher_is_better


def test_bad_comparisons_are_one_line_errors_before_translating(run, tmp_path, call, monkeypatch):
    translated = []
    monkeypatch.setattr(Translator, "translate", lambda self, lines: translated.append(lines) or list(lines))
    (tmp_path / "short.txt").write_text("a dog\n", encoding="utf-8")
    cases = {
        tmp_path / "short.txt": f"error: evaluate: --compare {tmp_path / 'short.txt'} has 1 lines but the references "
        "have 12; line N must translate the source of reference N",
        tmp_path / "missing.txt": f"error: evaluate: --compare {tmp_path / 'missing.txt'}: no such run directory, "
        "checkpoint or file of translations",
        tmp_path / "missing.pt": f"error: evaluate: --compare {tmp_path / 'missing.pt'}: checkpoint: no such file or "
        f"run directory: {tmp_path / 'missing.pt'}",
    }
    for path, message in cases.items():
        status, out, err = call("evaluate", run, "--split", "test", "--compare", path)
        assert status == 2 and err == message + "\n" and translated == [] and out == ""


def test_hyp_scores_and_compares_files_without_a_model(tmp_path, call):
    (tmp_path / "ref.txt").write_text("a dog runs in the park .\ntwo cats sit on a red sofa .\n", encoding="utf-8")
    (tmp_path / "base.txt").write_text("the park dog\ncats sofa\n", encoding="utf-8")
    status, out, err = call(
        "evaluate", "--hyp", tmp_path / "base.txt", "--ref", tmp_path / "ref.txt", "--compare", tmp_path / "ref.txt"
    )
    assert status == 0, err
    assert "paired bootstrap resampling" in out and all(score.label in out for score in SCORES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.txt", "ref.txt"]  # nothing written
    status, out, err = call("evaluate", "--hyp", tmp_path / "base.txt", "--ref", tmp_path / "ref.txt")
    assert status == 0 and "BLEU" in out and "paired" not in out


def test_hyp_refuses_what_it_cannot_use_in_one_line(run, tmp_path, call):
    (tmp_path / "ref.txt").write_text("a dog\ntwo cats\n", encoding="utf-8")
    (tmp_path / "one.txt").write_text("a dog\n", encoding="utf-8")
    hyp = ("--hyp", tmp_path / "one.txt")
    cases = [
        ((*hyp, "--ref", tmp_path / "ref.txt"), "has 1 lines but the references have 2"),
        ((*hyp,), "--hyp needs --ref"),
        ((run, *hyp, "--ref", tmp_path / "ref.txt"), "give no run, checkpoint, --split or --src with it"),
        ((*hyp, "--ref", tmp_path / "ref.txt", "--beam", "4"), "--beam has nothing to search"),
        (("--hyp", tmp_path / "none.txt", "--ref", tmp_path / "ref.txt"), "--hyp {}: no such file"),
        ((*hyp, "--ref", tmp_path / "ref.txt", "--compare", run), "with --hyp, --compare takes files of translations"),
    ]
    for argv, message in cases:
        status, out, err = call("evaluate", *argv)
        message = message.format(tmp_path / "none.txt")
        assert status == 2 and err.startswith("error: evaluate: ") and message in err and err.count("\n") == 1, err
