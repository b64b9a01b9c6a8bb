"""The training loop: it learns, checkpoints round-trip, resume continues exactly, bad states are refused."""

from __future__ import annotations

import gc
import itertools
import math
import os
import re
import shutil
import weakref

import pytest
import torch

from tests.helpers import (
    assert_same_training_state,
    read_metrics,
    shared_data_dir,
    tiny_config,
    write_config,
    write_corpus,
)
from transformer.config import from_dict
from transformer.data.vocab import Vocab
from transformer.distributed import DistInfo
from transformer.errors import UserError
from transformer.files import TEMP_SUFFIX
from transformer.inference import scoring
from transformer.model.checkpoint import load_checkpoint
from transformer.training import loop as train_module
from transformer.training.loop import train


def test_tiny_model_overfits_a_handful_of_pairs(tmp_path):
    corpus = write_corpus(tmp_path / "c", n_train=8, n_valid=8)
    (corpus / "valid.de").write_text((corpus / "train.de").read_text())
    (corpus / "valid.en").write_text((corpus / "train.en").read_text())
    raw = tiny_config(
        tmp_path,
        data_dir=corpus,
        model={"d_model": 64, "d_ff": 128, "n_heads": 4, "n_encoder_layers": 2, "n_decoder_layers": 2, "dropout": 0.0},
        train={
            "max_steps": 200,
            "lr_schedule": "constant",
            "lr": 3e-3,
            "label_smoothing": 0.0,
            "valid_every": 200,
            "log_every": 50,
        },
    )
    run_dir = train(from_dict(raw), quiet=True)
    valid = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert valid[-1]["nll"] < 0.05, valid  # memorised: next-token probability ~1 everywhere
    train_losses = [m["loss"] for m in read_metrics(run_dir) if m.get("split") == "train"]
    assert train_losses[-1] < train_losses[0] / 20


def _state(path):
    return load_checkpoint(path)


def test_resume_continues_at_saved_step_and_matches_uninterrupted_run(tmp_path):
    corpus = write_corpus(tmp_path / "c")
    straight = tiny_config(tmp_path, "straight", corpus)
    train(from_dict(straight), quiet=True)

    split = tiny_config(tmp_path, "split", corpus, train={"max_steps": 6})  # stops between validations
    train(from_dict(split), quiet=True)
    assert _state(tmp_path / "split" / "last.pt")["run"]["step"] == 6
    split["train"]["max_steps"] = 12  # max_steps may change under resume
    train(from_dict(split), resume=True, quiet=True)

    metrics = read_metrics(tmp_path / "split")
    steps = [m["step"] for m in metrics if m.get("split") == "train"]
    assert steps == list(range(1, 13))  # 7..12 follow 1..6, nothing redone or skipped
    assert any(m.get("event") == "resume" and m["step"] == 6 for m in metrics)
    assert_same_training_state(tmp_path / "straight" / "last.pt", tmp_path / "split" / "last.pt")


def test_resume_refuses_model_change_and_applies_lr_change(tmp_path, caplog):
    raw = tiny_config(tmp_path, train={"max_steps": 4})
    train(from_dict(raw), quiet=True)
    changed = tiny_config(tmp_path, data_dir=tmp_path / "corpus", model={"d_model": 48}, train={"max_steps": 8})
    with pytest.raises(UserError, match=r"model\.d_model was 32 in the checkpoint and is 48 now"):
        train(from_dict(changed), resume=True, quiet=True)
    more = tiny_config(tmp_path, data_dir=tmp_path / "corpus", train={"max_steps": 8, "lr": 1.0})
    train(from_dict(more), resume=True, quiet=True)
    log_text = (tmp_path / "run" / "train.log").read_text()
    assert "config change applies: train.lr: 2.0 -> 1.0" in log_text
    lr_step5 = [m["lr"] for m in read_metrics(tmp_path / "run") if m.get("step") == 5 and "lr" in m][0]
    assert lr_step5 == pytest.approx(1.0 * 32**-0.5 * min(5**-0.5, 5 * 10**-1.5))  # the rate update 5 used


def test_existing_run_needs_resume_and_resume_without_a_checkpoint_starts_over(tmp_path):
    raw = tiny_config(tmp_path, train={"max_steps": 3})
    train(from_dict(raw), quiet=True)
    with pytest.raises(UserError, match="already holds a run"):
        train(from_dict(raw), quiet=True)
    # What a kill before the first save leaves: the vocabulary, logs, a torn temporary file, no checkpoint.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "run", other)
    for name in ("last.pt", "best.pt"):
        (other / name).unlink()
    (other / f".spm.model.a1b2c3d4{TEMP_SUFFIX}").write_bytes(b"torn")  # named as atomic_write names them
    train(
        from_dict(tiny_config(tmp_path, "other", tmp_path / "corpus", train={"max_steps": 3})), resume=True, quiet=True
    )
    assert "yet (the run stopped before its first save); starting from step 0" in (other / "train.log").read_text()
    assert not list(other.glob(".*" + TEMP_SUFFIX))
    assert _state(other / "last.pt")["run"]["step"] == 3
    assert_same_training_state(tmp_path / "run" / "last.pt", other / "last.pt")


def test_cli_train_writes_the_run_directory(tmp_path, call):
    config = write_config(tmp_path / "tiny.yaml", tiny_config(tmp_path, train={"max_steps": 4, "peak_tflops": 0.0}))
    status, _, err = call("train", config, "--set", "train.valid_every=2")
    assert status == 0, err
    run_dir = tmp_path / "run"
    for name in ("config.yaml", "spm.model", "metrics.jsonl", "train.log", "last.pt", "best.pt"):
        assert (run_dir / name).is_file(), name
    saved = load_checkpoint(run_dir / "last.pt")
    assert saved["run"]["step"] == 4 and saved["config"]["train"]["valid_every"] == 2
    assert Vocab((run_dir / "spm.model").read_bytes()).proto == saved["vocab"]
    # Progress is visible without a terminal: stderr here is not one, so the bar is off and lines are printed.
    assert "step 3: loss" in err and "tokens/s" in err
    assert "MFU below is against" in err and "(measured: the best fp32 matmul rate on cpu of " in err  # no peak set
    assert "step 3: loss" in (run_dir / "train.log").read_text()


def test_lines_the_progress_bar_shows_stay_off_the_console(tmp_path, capsys):
    from transformer.distributed import DistInfo
    from transformer.training.loop import log, setup_logging

    setup_logging(tmp_path, DistInfo())
    log.info("step 7: loss 1.0", extra={"console": False})
    log.info("step 8: valid loss 2.0")
    err = capsys.readouterr().err
    assert "step 7" not in err and "step 8: valid loss" in err
    text = (tmp_path / "train.log").read_text()
    assert "step 7: loss 1.0" in text and "step 8: valid loss" in text


def test_short_run_on_real_multi30k_lowers_validation_loss(tmp_path):
    data = shared_data_dir() / "multi30k"
    if not (data / "train.de").is_file():
        pytest.skip(f"real corpus not found at {data} (set TRANSFORMER_DATA)")
    raw = tiny_config(
        tmp_path,
        data_dir=data,
        model={
            "d_model": 64,
            "d_ff": 256,
            "n_heads": 4,
            "n_encoder_layers": 2,
            "n_decoder_layers": 2,
            "max_positions": 128,
        },
        data={"vocab_size": 1000, "max_len": 60, "max_tokens": 1500, "max_train_pairs": 3000, "max_valid_pairs": 200},
        train={
            "max_steps": 100,
            "lr_schedule": "inverse_sqrt",
            "warmup_steps": 25,
            "lr": 3e-3,
            "valid_every": 25,
            "log_every": 25,
        },
    )
    run_dir = train(from_dict(raw), quiet=True)
    valid = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert [m["step"] for m in valid] == [25, 50, 75, 100]
    assert all(b["loss"] < a["loss"] for a, b in zip(valid, valid[1:])), valid  # measured: 5.66, 5.37, 5.18, 5.03
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3, valid
    assert math.isfinite(valid[-1]["ppl"]) and valid[-1]["ppl"] < 1000 / 2  # well below a uniform guess


def test_validation_bleu_picks_best_and_early_stopping_follows_patience(tmp_path, monkeypatch):
    # The real BLEU of each validation is computed, then replaced by a scripted score: best at the second
    # validation, then a worse one and a tie (no improvement either), so patience 2 stops the run at step 8.
    real, scripted = scoring.corpus_scores, itertools.chain([10.0, 12.0, 11.0, 12.0], itertools.count(13.0))

    def scripted_bleu(hypotheses, references, names=scoring.NAMES):
        scores = real(hypotheses, references, names)
        assert 0 <= scores["bleu"] <= 100 and len(hypotheses) == len(references) > 0
        return {**scores, "bleu": next(scripted)}

    monkeypatch.setattr(scoring, "corpus_scores", scripted_bleu)
    raw = tiny_config(
        tmp_path, train={"max_steps": 40, "valid_every": 2, "valid_bleu": True, "patience": 2, "log_every": 2}
    )
    run_dir = train(from_dict(raw), quiet=True)
    valid = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert [(m["step"], m["bleu"]) for m in valid] == [(2, 10.0), (4, 12.0), (6, 11.0), (8, 12.0)]
    assert load_checkpoint(run_dir / "best.pt")["run"]["step"] == 4
    assert load_checkpoint(run_dir / "last.pt")["run"]["step"] == 8
    # Saved as chosen by BLEU: a resume that read "loss" here used to forget the best score and the patience count.
    assert load_checkpoint(run_dir / "last.pt")["run"]["best_metric"] == "bleu"
    assert "early stopping: 2 validations without improvement" in (run_dir / "train.log").read_text()

    # Resumed, a run that stopped early stays stopped: no update, and last.pt is left as it was.
    before = (run_dir / "last.pt").read_bytes()
    train(from_dict(raw), resume=True, quiet=True)
    assert max(m["step"] for m in read_metrics(run_dir) if m.get("split") == "train") == 8
    assert (run_dir / "last.pt").read_bytes() == before
    assert "this run stopped at step 8 after 2 validations" in (run_dir / "train.log").read_text()
    # With more patience it trains on from step 8 (the next scripted BLEU, 13, is an improvement).
    raw["train"]["patience"] = 3
    train(from_dict(raw), resume=True, quiet=True)
    valid = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert len(valid) > 4 and valid[4]["step"] == 10


def test_resume_with_other_update_freq_and_adam_settings(tmp_path):
    raw = tiny_config(tmp_path, train={"max_steps": 5, "valid_every": 5})
    train(from_dict(raw), quiet=True)
    assert _state(tmp_path / "run" / "last.pt")["run"]["data"] == {"epoch": 0, "batches_done": 5}
    more = tiny_config(
        tmp_path,
        data_dir=tmp_path / "corpus",
        train={"max_steps": 8, "valid_every": 4, "update_freq": 2, "adam_eps": 1e-6, "adam_betas": [0.9, 0.99]},
    )
    train(from_dict(more), resume=True, quiet=True)  # 5 batches done do not split into updates of 2
    state = _state(tmp_path / "run" / "last.pt")
    assert state["run"]["step"] == 8
    group = state["optimizer"]["param_groups"][0]
    assert group["eps"] == 1e-6 and tuple(group["betas"]) == (0.9, 0.99)
    assert "epoch 0 restarts from its first batch" in (tmp_path / "run" / "train.log").read_text()


def test_best_pt_is_the_validation_with_the_lowest_loss(tmp_path):
    run_dir = train(from_dict(tiny_config(tmp_path, train={"max_steps": 12, "valid_every": 2})), quiet=True)
    valid = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    lowest = min(valid, key=lambda m: m["loss"])
    best = load_checkpoint(run_dir / "best.pt")["run"]
    assert len(valid) == 6 and best["best_metric"] == "loss"
    assert best["step"] == lowest["step"] and best["best"] == pytest.approx(lowest["loss"])
    assert load_checkpoint(run_dir / "last.pt")["run"]["best"] == pytest.approx(lowest["loss"])


@pytest.mark.parametrize("edit", ["grown", "touched"])
def test_resume_restarts_the_epoch_when_the_training_corpus_changed(tmp_path, edit):
    """A grown corpus gives other batches: the saved position inside the old ones no longer means anything.
    A touched file (the store is rebuilt from the same text) keeps the position."""
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 4, "valid_every": 4})), quiet=True)
    assert _state(tmp_path / "run" / "last.pt")["run"]["data"] == {"epoch": 0, "batches_done": 4}
    corpus = tmp_path / "corpus"
    for side in ("de", "en"):
        path = corpus / f"train.{side}"
        if edit == "grown":
            lines = path.read_text(encoding="utf-8").splitlines()
            path.write_text("\n".join(lines + lines[:40]) + "\n", encoding="utf-8")
        else:
            os.utime(path)
    more = tiny_config(tmp_path, data_dir=corpus, train={"max_steps": 6, "valid_every": 6})
    train(from_dict(more), resume=True, quiet=True)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "store: rebuilding" in log
    restarts = edit == "grown"
    assert ("resume: the training corpus changed; epoch 0 restarts from its first batch" in log) == restarts
    assert _state(tmp_path / "run" / "last.pt")["run"]["data"]["batches_done"] == (2 if restarts else 6)


@pytest.mark.parametrize(
    "change, restarts",
    [({"train": {"seed": 4}}, True), ({"data": {"max_tokens": 150}}, True), ({"train": {"lr": 1.0}}, False)],
)
def test_resume_restarts_the_epoch_when_the_data_order_changes(tmp_path, change, restarts):
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 4, "valid_every": 4})), quiet=True)
    assert _state(tmp_path / "run" / "last.pt")["run"]["data"] == {"epoch": 0, "batches_done": 4}
    more = tiny_config(tmp_path, data_dir=tmp_path / "corpus", train={"max_steps": 6, "valid_every": 6})
    for section, values in change.items():
        more[section].update(values)
    train(from_dict(more), resume=True, quiet=True)
    log = (tmp_path / "run" / "train.log").read_text()
    assert ("resume: the data order changed; epoch 0 restarts from its first batch" in log) == restarts
    done = _state(tmp_path / "run" / "last.pt")["run"]["data"]["batches_done"]
    assert done == (2 if restarts else 6)


def test_training_time_adds_up_across_resumes(tmp_path):
    """summary.json's training seconds, tokens/s and time to best, and the time axes of the plots, count every
    segment of a resumed run; a resume must not start the clock again."""
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 2})), quiet=True)
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    state["run"]["elapsed"] = 10_000.0  # as if the first segment had taken hours
    torch.save(state, tmp_path / "run" / "last.pt")
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 4, "valid_every": 2})), resume=True, quiet=True)
    assert _state(tmp_path / "run" / "last.pt")["run"]["elapsed"] > 10_000.0
    after = [r for r in read_metrics(tmp_path / "run") if r["step"] > 2 and "elapsed" in r]
    assert after and all(r["elapsed"] > 10_000.0 for r in after)


def test_a_run_resumes_from_its_store_when_the_corpus_is_gone(tmp_path):
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 2})), quiet=True)
    (tmp_path / "corpus").rename(tmp_path / "moved")
    train(
        from_dict(tiny_config(tmp_path, data_dir=tmp_path / "corpus", train={"max_steps": 4, "valid_every": 2})),
        resume=True,
        quiet=True,
    )
    assert _state(tmp_path / "run" / "last.pt")["run"]["step"] == 4
    assert "using the prepared store" in (tmp_path / "run" / "train.log").read_text()


def test_a_resumed_run_lets_go_of_the_checkpoint_it_loaded(tmp_path, monkeypatch):
    """The loaded checkpoint's tensors are not kept alive through the update loop (host memory of ~3x the model)."""
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 2})), quiet=True)
    loaded, alive = [], []
    real_load, real_loop = train_module.load_resumable, train_module.update_loop

    def load(path):
        saved = real_load(path)
        loaded.extend(weakref.ref(t) for t in saved["model"].values())
        return saved

    def loop(run, quiet):
        gc.collect()
        alive.append(sum(ref() is not None for ref in loaded))
        return real_loop(run, quiet)

    monkeypatch.setattr(train_module, "load_resumable", load)
    monkeypatch.setattr(train_module, "update_loop", loop)
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 4, "valid_every": 2})), resume=True, quiet=True)
    assert loaded and alive == [0]
    assert _state(tmp_path / "run" / "last.pt")["run"]["step"] == 4


@pytest.mark.slow  # 40 s with Inductor's caches warm, over 2 minutes cold on 2 loaded cores: `pytest -m slow`
@pytest.mark.timeout(900)  # more than the suite's 300 s per test, for a cold compilation
def test_a_compiled_training_step_runs_on_a_cpu(tmp_path):
    # train.compile: the model and its loss compiled together (train.TrainingLoss), dynamic shapes, as one graph
    # (no token packing inside it); the tiniest model, since Inductor compiles C++ on a CPU. Lengths padded to 8, as
    # CUDA needs, so that one compilation serves every batch. tests/integration/test_cuda.py compiles one on a GPU.
    raw = tiny_config(
        tmp_path,
        data={"pad_to_multiple": 8},
        train={"compile": True, "max_steps": 2, "valid_every": 2, "precision": "fp32"},
    )
    run_dir = train(from_dict(raw), quiet=True)
    state = _state(run_dir / "last.pt")
    assert state["run"]["step"] == 2
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert [m["step"] for m in read_metrics(run_dir) if m.get("split") == "train"] == [1, 2]


@pytest.mark.parametrize("fails", [False, True])
def test_the_process_group_is_left_only_after_a_normal_end(monkeypatch, tmp_path, fails):
    # On NCCL destroy_process_group waits for the peers' collectives: after an error (a dead peer) it could
    # hang where the error should come out.
    from transformer.training import loop as train_module

    left = []
    monkeypatch.setattr(train_module, "init_distributed", lambda device: (DistInfo(rank=0, world_size=2), "cpu"))
    monkeypatch.setattr(train_module, "shutdown_distributed", lambda: left.append(True))

    def fake_train(*args):
        if fails:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
        return tmp_path

    monkeypatch.setattr(train_module, "_train", fake_train)
    cfg = from_dict(tiny_config(tmp_path))
    if fails:
        with pytest.raises(UserError, match="rank 0: distributed training stopped"):
            train_module.train(cfg)
    else:
        assert train_module.train(cfg) == tmp_path
    assert left == ([] if fails else [True])


def test_a_node_whose_machine_resolves_precision_auto_otherwise_is_refused(monkeypatch, tmp_path):
    """Under torchrun, `auto` is resolved on each node: a node without native bf16 must not join a bf16 run."""
    cfg = from_dict(tiny_config(tmp_path, train={"precision": "auto"}))
    seen = {}

    def gather(mine, info):
        seen["mine"] = mine
        return [mine, ("node-b", {**mine[1], "precision": "fp32"})]

    monkeypatch.setattr(train_module, "gather_objects", gather)
    with pytest.raises(UserError, match=r"train.precision auto is fp32 on rank 1 \(on node-b\) but bf16 on rank 0"):
        train_module.same_on_every_rank(cfg, False, DistInfo(0, 0, 2), "bf16")
    assert seen["mine"][1]["precision"] == "bf16"
    monkeypatch.setattr(train_module, "gather_objects", lambda mine, info: [mine, mine])
    train_module.same_on_every_rank(cfg, False, DistInfo(0, 0, 2), "bf16")  # one precision: no error


def test_a_run_on_two_weighted_corpora_and_a_tag_resumes_as_the_uninterrupted_one(tmp_path):
    """Two more corpora, one drawn twice an epoch, one half of it an epoch with <bt> before each source: stopped at
    a validation and resumed, the run holds what the uninterrupted one holds, bit for bit; the log says each
    corpus's pairs and share."""
    corpus = write_corpus(tmp_path / "c", n_train=80, n_valid=10)
    twice, half = write_corpus(tmp_path / "twice", n_train=40, seed=5), write_corpus(tmp_path / "half", seed=6)
    corpora = [
        {"name": "twice", "dir": str(twice), "weight": 2.0},
        {"name": "half", "dir": str(half), "weight": 0.5, "tag": "<bt>"},
    ]
    settings = {"data": {"corpora": corpora}, "train": {"max_steps": 12, "valid_every": 4}}
    train(from_dict(tiny_config(tmp_path, "straight", corpus, **settings)), quiet=True)
    said = re.search(
        r"data: corpus half: (\d+) pairs, [\d,]+ tokens, weight 0.5: (\d+) pairs an epoch \(([\d.]+)%",
        (tmp_path / "straight" / "train.log").read_text(),
    )
    assert said and int(said[2]) == round(int(said[1]) / 2) and 0 < float(said[3]) < 100, said
    split = tiny_config(tmp_path, "split", corpus, **settings)
    split["train"]["max_steps"] = 4
    train(from_dict(split), quiet=True)
    split["train"]["max_steps"] = 12
    train(from_dict(split), resume=True, quiet=True)
    assert_same_training_state(tmp_path / "straight" / "last.pt", tmp_path / "split" / "last.pt")
    assert len(list((tmp_path / "stores").iterdir())) == 2  # both runs used the same two stores
