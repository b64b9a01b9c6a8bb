"""The end of training (training/finish.py, the `finish` verb): the summary, final.pt and the search settings chosen
on validation, when it counts as done, the training record it reads, and its checks of the test split."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers import read_metrics, tiny_config, write_config, write_corpus
from transformer.config import from_dict, load_config
from transformer.data.store import Store
from transformer.errors import UserError
from transformer.inference.scoring import SCORES
from transformer.inference.settings import search_settings
from transformer.model.checkpoint import load_checkpoint, resolve_checkpoint
from transformer.training.finish import LENPENS, _tune
from transformer.training.loop import train


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def finished_run(tmp_path, **train_settings):
    corpus = write_corpus(tmp_path / "c", n_train=200, n_valid=12)
    shutil.copy(corpus / "valid.de", corpus / "test.de")
    shutil.copy(corpus / "valid.en", corpus / "test.en")
    raw = tiny_config(
        tmp_path,
        data_dir=corpus,
        decode={"max_len_offset": 4, "beam": 2},
        model={"dropout": 0.0},
        train={
            "max_steps": 60,
            "valid_every": 20,
            "lr_schedule": "constant",
            "lr": 3e-3,
            "keep_last": 2,
            "finish": True,
            **train_settings,
        },
    )
    return train(from_dict(raw), quiet=True), raw


def test_training_ends_with_a_summary_the_final_model_and_tuned_search(tmp_path, capsys):
    run_dir, raw = finished_run(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    test = summary["test"]
    assert test["split"] == "test" and 0 <= test["bleu"] <= 100 and test["length_ratio"] > 0
    assert test["bleu_signature"].startswith("nrefs:1|case:mixed") and "chrf_signature" in test
    for score in SCORES:  # every score, with its signature, in the summary line too
        assert isinstance(test[score.name], float) and test[f"{score.name}_signature"].startswith("nrefs:1|")
    assert summary["made_from"] in ("best.pt", "averaged.pt") and (run_dir / "averaged.pt").is_file()
    assert summary["updates"] == 60 and summary["training_seconds"] > 0 and summary["tokens_per_s"] > 0
    assert summary["best_valid_loss"] == min(m["loss"] for m in read_metrics(run_dir) if m.get("split") == "valid")
    # Every setting of the validation grid was scored; the chosen one scored best.
    grid = summary["valid_grid_bleu"]
    chosen = f"beam{summary['decode']['beam']}_lp{summary['decode']['lenpen']:g}"
    assert len(grid) >= 5 and grid[chosen] == max(grid.values())
    # final.pt is what a run directory means now, and it carries the chosen search settings; so does config.yaml.
    assert resolve_checkpoint(run_dir) == run_dir / "final.pt"
    final = load_checkpoint(run_dir / "final.pt")
    made_from = load_checkpoint(run_dir / final["made_from"])
    if final["made_from"] == "best.pt":  # its step and score come along, for serve's /info
        assert final["run"] == made_from["run"]
    else:  # an average has neither
        assert "run" not in final and "run" not in made_from
    assert (final["config"]["decode"]["beam"], final["config"]["decode"]["lenpen"]) == (
        summary["decode"]["beam"],
        summary["decode"]["lenpen"],
    )
    assert load_config(run_dir / "config.yaml").decode.lenpen == summary["decode"]["lenpen"]
    err = capsys.readouterr().err
    assert "summary: test BLEU" in err and "summary: use" in err and "final.pt" in err
    (line,) = [x for x in err.splitlines() if "summary: test BLEU" in x]
    assert all(f" {score.label} {test[score.name]:.2f}" in line for score in SCORES)
    assert all(f"summary:   {test[f'{score.name}_signature']}" in err for score in SCORES)
    kept = len(Store(run_dir / "store").corpus("valid"))  # 10 of the 12: not the raw split evaluate reads
    assert kept < 12 and f"finish: choosing on the {kept} validation pairs training kept" in err
    # The test translations are where the summary says.
    assert len((run_dir / "eval" / "test.final.hyp").read_text().splitlines()) == 12
    # Resumed with nothing left to train (a job script that always passes --resume), with settings of its own: the
    # end of training is not done again, its summary is shown again, and config.yaml stays the run's, as it chose.
    # Moved first: config.yaml and the summary shown name where the run is now.
    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)  # copied with their times, as `cp -a` does
    written = {name: (moved / name).stat().st_mtime_ns for name in ("final.pt", "summary.json", "averaged.pt")}
    other = {
        **raw,
        "decode": {**raw["decode"], "beam": 5, "lenpen": 0.9},
        "train": {**raw["train"], "lr": 0.5, "run_dir": str(moved)},
    }
    train(from_dict(other), resume=True, quiet=True)
    assert {name: (moved / name).stat().st_mtime_ns for name in written} == written
    saved = load_config(moved / "config.yaml")
    assert (saved.decode.beam, saved.decode.lenpen) == (summary["decode"]["beam"], summary["decode"]["lenpen"])
    assert saved.train.lr == raw["train"]["lr"]  # nothing trained with the resume's 0.5
    assert saved.train.run_dir == str(moved)
    err = capsys.readouterr().err
    assert "nothing left to train; keeping final.pt and summary.json" in err and "summary: test BLEU" in err
    assert f"summary: use {moved / 'final.pt'}" in err


def test_the_end_of_training_counts_as_done_only_with_a_summary_of_its_step_written_after_final_pt(tmp_path):
    from transformer.training.finish import finished_summary

    (tmp_path / "final.pt").write_bytes(b"weights")
    assert finished_summary(tmp_path, 60) is None  # killed before the summary
    record = {"updates": 60, "decode": {"beam": 6, "lenpen": 1.2}}
    (tmp_path / "summary.json").write_text(json.dumps(record), encoding="utf-8")
    assert finished_summary(tmp_path, 60) == record
    assert finished_summary(tmp_path, 80) is None  # another step's summary (e.g. copied without their times)
    os.utime(tmp_path / "summary.json", ns=(0, 0))  # an older run's summary, then a final.pt it does not describe
    assert finished_summary(tmp_path, 60) is None


def test_finish_command_redoes_the_end_and_resume_drops_a_stale_final(tmp_path, call):
    run_dir, raw = finished_run(tmp_path)
    (run_dir / "summary.json").unlink()
    status, _, err = call("finish", run_dir, "--device", "cpu")
    assert status == 0, err
    assert json.loads((run_dir / "summary.json").read_text())["test"]["split"] == "test"
    # Its data not where the config says (moved, or a relative data.dir from another directory): an error,
    # not a summary without its test score.
    summary = (run_dir / "summary.json").read_text()
    (tmp_path / "c").rename(tmp_path / "c_moved")
    status, _, err = call("finish", run_dir, "--device", "cpu")
    assert (
        status == 2 and err == f"error: finish: data.dir '{tmp_path}/c' is not a directory; put the corpus back there\n"
    )
    assert (run_dir / "summary.json").read_text() == summary
    (tmp_path / "c_moved").rename(tmp_path / "c")
    # Resumed with nothing left to train (and finish off): final.pt still describes the weights, and stays.
    same = write_config(tmp_path / "same.yaml", {**raw, "train": {**raw["train"], "finish": False}})
    assert call("train", same, "--resume")[0] == 0
    assert resolve_checkpoint(run_dir) == run_dir / "final.pt"
    # Training on from this run: final.pt belonged to the end of the shorter run.
    config = write_config(tmp_path / "more.yaml", {**raw, "train": {**raw["train"], "max_steps": 62, "finish": False}})
    status, _, err = call("train", config, "--resume")
    assert status == 0
    assert not (run_dir / "final.pt").exists() and resolve_checkpoint(run_dir) == run_dir / "best.pt"
    assert f"removed final.pt; train.finish is off: `transformer finish {run_dir}` chooses again" in err
    assert call("finish", tmp_path / "nowhere")[2].startswith("error: finish:")


@pytest.mark.parametrize("beam, tried", [(1, {(1, 0.6)}), (4, {(4, a) for a in LENPENS} | {(4, 0.6), (6, 1.0)})])
def test_the_search_grid_skips_length_penalties_where_greedy_cannot_change(beam, tried):
    # A score that prefers lenpen 1.0 and the wider beam. Each setting is scored once; the config's own is known.
    calls = []

    def score(model, settings):
        b, lenpen = settings.beam, settings.lenpen
        calls.append((b, lenpen))
        return {"bleu": 10 + (lenpen == 1.0) + b / 100, "chrf": 30.0, "sys_len": 9, "ref_len": 10}, []

    cfg = from_dict(tiny_config(Path("/nowhere"), data_dir=Path("/nowhere"), decode={"beam": beam, "lenpen": 0.6}))
    config = search_settings(cfg.decode)
    chosen, grid = _tune(score, None, config, score(None, config)[0])
    chosen_beam, chosen_lenpen = chosen.beam, chosen.lenpen
    assert calls[0] == (beam, 0.6)  # the known score, made above
    assert set(calls) == tried and len(calls) == len(tried) and (beam, 0.6) not in calls[1:]
    assert (chosen_beam, chosen_lenpen) == ((1, 0.6) if beam == 1 else (6, 1.0))
    assert set(grid) == {f"beam{b}_lp{a:g}" for b, a in tried}


# ----------------------------------------------------------------------------- what mutation testing found unchecked


@pytest.mark.parametrize(
    "valid_bleu, rows, best_step",
    [
        (False, [(100, 3.0, 10.0), (200, 2.0, 12.0), (300, 2.5, 30.0)], 200),  # the lowest loss
        (True, [(100, 3.0, 10.0), (200, 2.0, 12.0), (300, 2.5, 30.0)], 300),  # the highest BLEU
    ],
)
def test_the_summarys_best_step_is_the_best_validation(tmp_path, valid_bleu, rows, best_step):
    from transformer.training.finish import _training_record

    lines = [{"step": s, "split": "valid", "loss": loss, "bleu": bleu, "elapsed": float(s)} for s, loss, bleu in rows]
    lines += [{"split": "valid", "loss": 0.1}, {"step": "x", "split": "valid", "loss": 0.1}]  # no numeric step
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    cfg = from_dict(tiny_config(tmp_path, train={"valid_bleu": valid_bleu}))
    record = _training_record(tmp_path, cfg, {"step": 300, "data": {"epoch": 1}, "elapsed": 60.0, "tokens": 6000}, 0)
    assert (record["best_step"], record["seconds_to_best"]) == (best_step, float(best_step))
    assert record["best_valid_loss"] == 2.0 and record["tokens_per_s"] == 100


def test_the_summary_reads_a_resumed_runs_later_validation_and_nothing_past_last_pt(tmp_path):
    """A kill between metrics.jsonl and last.pt: the step is validated again on resume (the later line wins);
    never resumed, its line names no checkpoint, unless best.pt was written before the kill."""
    from transformer.training.finish import _training_record

    lines = [(100, 3.0), (200, 1.0), (100, 2.5), (200, 2.0), (300, 2.2), (400, 0.5)]  # killed after 200, resumed
    rows = [{"step": s, "split": "valid", "loss": loss, "elapsed": float(i)} for i, (s, loss) in enumerate(lines)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = from_dict(tiny_config(tmp_path, train={"valid_bleu": False}))
    last = {"step": 300, "data": {"epoch": 1}, "elapsed": 60.0, "tokens": 6000}
    record = _training_record(tmp_path, cfg, last, 200)
    assert (record["best_step"], record["best_valid_loss"], record["seconds_to_best"]) == (200, 2.0, 3.0)
    # Killed between best.pt and last.pt at step 400, then `transformer finish`: best.pt holds that validation.
    record = _training_record(tmp_path, cfg, last, 400)
    assert (record["best_step"], record["best_valid_loss"]) == (400, 0.5)


def test_a_tie_keeps_the_configured_search_settings(tmp_path):
    """Equal BLEU everywhere: the configured beam and length penalty stay (a wider beam is only slower)."""
    from transformer.inference.scoring import corpus_scores

    cfg = from_dict(tiny_config(tmp_path, decode={"beam": 4, "lenpen": 0.6}))
    same = {**corpus_scores(["a dog runs"], ["a dog runs"]), "bleu": 30.0}
    tried = []

    def score(model, settings):
        tried.append((settings.beam, settings.lenpen))
        return same, None

    chosen, _ = _tune(score, None, search_settings(cfg.decode), same)
    beam, lenpen = chosen.beam, chosen.lenpen
    assert (beam, lenpen) == (4, 0.6) and (6, 0.6) in tried  # the wider beam was tried, and not taken


def test_the_chosen_search_settings_go_into_final_pt_and_config_yaml(tmp_path, monkeypatch):
    """Settings other than the config's (whatever validation found), so that their being written shows."""
    from transformer.training import finish as finish_module

    monkeypatch.setattr(
        finish_module,
        "_tune",
        lambda score, model, config, at: (replace(config, beam=3, lenpen=1.4), {"beam3_lp1.4": 1.0}),
    )
    run_dir, raw = finished_run(tmp_path, max_steps=20)
    assert raw["decode"]["beam"] != 3
    decode = load_config(run_dir / "config.yaml").decode
    assert (decode.beam, decode.lenpen) == (3, 1.4)
    final = load_checkpoint(run_dir / "final.pt")["config"]["decode"]
    assert (final["beam"], final["lenpen"]) == (3, 1.4)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["decode"]["beam"], summary["decode"]["lenpen"]) == (3, 1.4)


def test_finish_refuses_half_a_test_split_before_searching_and_skips_a_missing_one(tmp_path, capsys):
    """A test split with one side missing, or sides of different lengths, is the one-line error `evaluate` gives,
    before any search and with final.pt and summary.json as they were; only a corpus with no test files at all
    finishes without a test score."""
    from transformer.training.finish import finish

    run_dir, _ = finished_run(tmp_path, max_steps=20)
    corpus = tmp_path / "c"
    kept = {name: (run_dir / name).stat().st_mtime_ns for name in ("final.pt", "summary.json")}
    reference = (corpus / "test.en").read_text()
    (corpus / "test.en").unlink()
    with pytest.raises(UserError, match="no such file: .*test.en"):
        finish(run_dir, torch.device("cpu"))
    (corpus / "test.en").write_text("".join(reference.splitlines(keepends=True)[:-1]))
    with pytest.raises(UserError, match=r"test.de has 12 lines but .*test.en has 11"):
        finish(run_dir, torch.device("cpu"))
    assert {name: (run_dir / name).stat().st_mtime_ns for name in kept} == kept
    (corpus / "test.en").unlink()
    (corpus / "test.de").unlink()
    capsys.readouterr()
    summary = finish(run_dir, torch.device("cpu"))
    assert "test" not in summary and "test" not in json.loads((run_dir / "summary.json").read_text())
    assert "the corpus has no test split 'test'" in capsys.readouterr().err


def test_the_end_of_training_scores_a_second_test_set_of_the_same_pair_on_its_own(tmp_path):
    """A corpus of data.dir's languages with its own test split is a second test set: scored beside data.dir's under
    its corpus's name, not merged into it under the same pair name (which kept one of the two)."""
    from transformer.training.finish import test_sets

    main = write_corpus(tmp_path / "main", n_train=4, n_valid=3, seed=1)
    other = write_corpus(tmp_path / "other", n_train=4, n_valid=5, seed=2)
    for corpus in (main, other):
        for lang in ("de", "en"):
            shutil.copy(corpus / f"valid.{lang}", corpus / f"test.{lang}")
    raw = tiny_config(tmp_path, data_dir=main)
    raw["data"]["corpora"] = [{"name": "flickr2017", "dir": str(other), "test_split": "test"}]
    sets = test_sets(from_dict(raw))
    assert [name for name, *_ in sets] == ["de-en", "flickr2017"]
    for (_, sources, references, token), corpus in zip(sets, (main, other)):
        assert sources == (corpus / "test.de").read_text().splitlines() and token == ""
        assert references == (corpus / "test.en").read_text().splitlines()
