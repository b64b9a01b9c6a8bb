"""train.init_from: a new run that starts from a trained model's exact weights and vocabulary, refuses settings that
are not that model's, records where it started, resumes like any run, and reports how the vocabulary fits."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import (
    WORDS,
    assert_same_training_state,
    read_metrics,
    sentences,
    tiny_config,
    write_config,
    write_corpus,
)
from transformer.config import from_dict, load_config
from transformer.data.loader import eval_batches
from transformer.data.store import Store
from transformer.data.vocab import train_vocab, vocab_from_stored
from transformer.device import pick_precision
from transformer.errors import UserError
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from transformer.model.transformer import Transformer
from transformer.training.init_from import measure
from transformer.training.loop import train
from transformer.training.validation import evaluate_loss


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A trained tiny run (best.pt, last.pt) on one corpus: the model the runs here start from."""
    root = tmp_path_factory.mktemp("base")
    return train(from_dict(tiny_config(root, "run", write_corpus(root / "corpus", seed=0))), quiet=True)


@pytest.fixture(scope="module")
def new_data(tmp_path_factory) -> Path:
    """Another corpus (other sentences, fewer pairs): the new domain."""
    return write_corpus(tmp_path_factory.mktemp("new") / "corpus", n_train=120, n_valid=16, seed=9)


def fine_tune_config(tmp_path: Path, origin: Path, data: Path, run: str = "ft", **train_keys) -> dict:
    return tiny_config(tmp_path, run, data, train={"init_from": str(origin), "max_steps": 8, **train_keys})


def first_validation(run_dir: Path) -> dict:
    return next(m for m in read_metrics(run_dir) if m.get("split") == "valid")


def checkpoint_loss(checkpoint: Path, run_dir: Path) -> float:
    """The checkpoint's validation loss on the validation set of the run in run_dir, computed as training does (in
    the run's own precision)."""
    model, _, cfg = model_from_checkpoint(load_checkpoint(checkpoint))
    batches = eval_batches(Store(run_dir / "store").corpus("valid"), cfg.data.max_tokens)
    precision, _ = pick_precision(load_config(run_dir / "config.yaml").train.precision, torch.device("cpu"))
    return evaluate_loss(model, batches, "cpu", precision, cfg.train.label_smoothing)["loss"]


def test_a_fine_tuning_run_starts_from_the_checkpoints_weights_and_vocabulary(base, new_data, tmp_path):
    # A learning rate of 1e-30: the updates before the first validation leave every weight as it was, so that
    # validation sees the weights the run started with.
    ft = train(from_dict(fine_tune_config(tmp_path, base, new_data, lr=1e-30)), quiet=True)
    origin = base / "best.pt"  # no final.pt (train.finish is off): best.pt is what the directory means
    expected = checkpoint_loss(origin, ft)
    assert first_validation(ft)["loss"] == expected
    scratch = train(
        from_dict(tiny_config(tmp_path, "scratch", new_data, train={"max_steps": 8, "lr": 1e-30})), quiet=True
    )
    assert first_validation(scratch)["loss"] > expected + 0.5  # the same run without init_from: an untrained model

    vocab = load_checkpoint(origin)["vocab"]
    assert (ft / "spm.model").read_bytes() == vocab == load_checkpoint(ft / "last.pt")["vocab"]
    assert Store(ft / "store").manifest["fingerprint"]["vocab_sha256"] == hashlib.sha256(vocab).hexdigest()
    log = (ft / "train.log").read_text()
    assert "vocab: training" not in log and "vocab fit: source (de)" in log
    sha256 = hashlib.sha256(origin.read_bytes()).hexdigest()
    saved = yaml.safe_load((ft / "config.yaml").read_text())["train"]
    assert (saved["init_from"], saved["init_from_sha256"]) == (str(origin), sha256)
    events = [m for m in read_metrics(ft) if m.get("event") == "init_from"]
    assert len(events) == 1 and (events[0]["path"], events[0]["sha256"], events[0]["step"]) == (str(origin), sha256, 0)
    assert events[0]["vocab_fit"]["original"]["src"]["words"] > 0  # the base run's corpus is at hand
    state = load_checkpoint(ft / "last.pt")
    assert state["run"]["step"] == 8  # counted from 0, with a fresh optimizer: its own 8 updates
    assert all(int(s["step"]) == 8 for s in state["optimizer"]["state"].values())


def test_fine_tuning_trains_on_and_the_summary_records_the_origin(base, new_data, tmp_path):
    raw = fine_tune_config(tmp_path, base / "last.pt", new_data, finish=True, max_steps=12)
    ft = train(from_dict(raw), quiet=True)
    before, after = load_checkpoint(base / "last.pt")["model"], load_checkpoint(ft / "last.pt")["model"]
    assert not all(torch.equal(before[k], after[k]) for k in before)  # it trained on
    summary = json.loads((ft / "summary.json").read_text())
    assert summary["init_from"] == {
        "path": str(base / "last.pt"),
        "sha256": hashlib.sha256((base / "last.pt").read_bytes()).hexdigest(),
    }


def test_model_and_vocabulary_settings_must_be_the_checkpoints(base, new_data, tmp_path, call):
    raw = tiny_config(tmp_path, "ft", new_data, model={"d_ff": 48, "n_heads": 4}, data={"vocab_size": 50})
    status, _, err = call("train", write_config(tmp_path / "ft.yaml", raw), "--set", f"train.init_from={base}")
    assert status == 2
    for named in (
        "model.d_ff is 48 here but 64 there",
        "model.n_heads is 4 here but 2 there",
        "data.vocab_size is 50 here but 64 there",
    ):
        assert named in err
    assert not (tmp_path / "ft" / "last.pt").exists()


def test_training_time_settings_may_change_and_are_logged(base, new_data, tmp_path):
    raw = fine_tune_config(tmp_path, base, new_data, max_steps=4, label_smoothing=0.0)
    raw["model"]["dropout"] = 0.3
    ft = train(from_dict(raw), quiet=True)
    log = (ft / "train.log").read_text()
    assert "model.dropout: 0.1 -> 0.3" in log and "train.label_smoothing: 0.1 -> 0.0" in log


def test_a_changed_checkpoint_is_refused_by_its_recorded_sha256(base, new_data, tmp_path):
    origin = tmp_path / "origin.pt"
    shutil.copy(base / "best.pt", origin)
    raw = fine_tune_config(tmp_path, origin, new_data, init_from_sha256="0" * 64)
    with pytest.raises(UserError, match=r"has sha256 [0-9a-f]{64}, not 0{64}"):
        train(from_dict(raw), quiet=True)


def test_resuming_a_fine_tuning_run_continues_it_and_never_starts_over(base, new_data, tmp_path):
    origin = tmp_path / "origin.pt"
    shutil.copy(base / "best.pt", origin)
    straight = train(from_dict(fine_tune_config(tmp_path, origin, new_data, "straight")), quiet=True)
    split = fine_tune_config(tmp_path, origin, new_data, "split", max_steps=4)  # a validation step: no extra one
    train(from_dict(split), quiet=True)
    origin.unlink()  # a resume reads the run's own last.pt: the model it started from may be gone
    split["train"]["max_steps"] = 8
    train(from_dict(split), resume=True, quiet=True)
    assert_same_training_state(straight / "last.pt", tmp_path / "split" / "last.pt")
    metrics = read_metrics(tmp_path / "split")
    assert [m["event"] for m in metrics if m.get("event") in ("init_from", "resume")] == ["init_from", "resume"]
    saved = yaml.safe_load((tmp_path / "split" / "config.yaml").read_text())["train"]
    assert saved["init_from"] == str(origin) and len(saved["init_from_sha256"]) == 64


def test_prepare_encodes_with_the_checkpoints_vocabulary_and_reports_the_fit(base, tmp_path, call):
    """A corpus of words the base model never saw: more pieces per word than on its own data, and unknown pieces."""
    rng = random.Random(4)
    novel = ["".join(rng.choice("qxzjwyäöü") for _ in range(rng.randint(5, 9))) for _ in range(40)]
    corpus = tmp_path / "novel"
    corpus.mkdir()
    for split, n in (("train", 60), ("valid", 10)):
        lines = [" ".join(rng.choice(novel) for _ in range(3)) for _ in range(n)]
        (corpus / f"{split}.de").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        (corpus / f"{split}.en").write_text("".join(line.upper() + "\n" for line in lines), encoding="utf-8")
    raw = fine_tune_config(tmp_path, base, corpus)
    raw["data"]["max_len"] = 60  # such words take many pieces
    config = write_config(tmp_path / "ft.yaml", raw)
    status, out, err = call("prepare", config)
    assert status == 0 and out.strip() == str(tmp_path / "ft" / "store"), err
    assert "vocab fit: source (de)" in err and "vocab fit: target (en)" in err and "its own data:" in err
    assert "unknown pieces are characters the vocabulary lacks" in err
    vocab = load_checkpoint(base / "best.pt")["vocab"]
    assert (tmp_path / "ft" / "spm.model").read_bytes() == vocab
    assert Store(tmp_path / "ft" / "store").manifest["fingerprint"]["vocab_sha256"] == hashlib.sha256(vocab).hexdigest()


def test_measure_counts_pieces_per_word_unknown_pieces_and_long_words():
    vocab = train_vocab(sentences(0, 300), vocab_size=80)
    known = measure(vocab, sentences(1, 50))
    assert known["unknown_pieces_pct"] == 0 and known["words"] > 100
    novel = measure(vocab, ["Quixotisch jazzy Żubrówka", "quizzical jinx"])
    assert novel["words"] == 5 and novel["pieces_per_word"] > known["pieces_per_word"]
    assert novel["unknown_pieces_pct"] > 0 and novel["long_words_pct"] > known["long_words_pct"]
    one = measure(vocab, [WORDS[0]])
    assert math.isclose(one["pieces_per_word"], len(vocab.encode([WORDS[0]])[0]))


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"init_from_sha256": "abc"}, "64 lowercase hexadecimal digits"),
        ({"init_from": "", "init_from_sha256": "0" * 64}, "train.init_from is empty"),
    ],
)
def test_the_sha256_key_is_checked(tmp_path, keys, message):
    with pytest.raises(UserError, match=message):
        from_dict(tiny_config(tmp_path, train={"init_from": "x", **keys}))


@contextlib.contextmanager
def at_most(seconds: int):
    """Fail, instead of hanging the suite, when the block takes longer than `seconds` (a read that never ends)."""

    def too_long(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("origin", ["/dev/zero", "fifo"])
@pytest.mark.parametrize("command", ["train", "prepare"])
def test_an_origin_that_is_not_a_regular_file_is_refused_at_once(new_data, tmp_path, call, origin, command):
    """/dev/zero reads for ever and a FIFO waits for a writer: hashing either (for the record) used to hang the start
    with nothing printed. Never opened, refused in one line (as translate refuses it)."""
    if origin == "fifo":
        origin = tmp_path / "fifo.pt"
        os.mkfifo(origin)
    config = write_config(tmp_path / "ft.yaml", fine_tune_config(tmp_path, Path(origin), new_data))
    with at_most(60):
        status, _, err = call(command, config)
    assert status == 2 and err.splitlines()[-1] == (
        f"error: train.init_from: checkpoint: {origin} is not a regular file (nor a run directory); give a .pt file"
    )
    assert not (tmp_path / "ft" / "store").exists()


def test_an_origin_holding_nan_is_refused_before_anything_is_built(base, new_data, tmp_path, call):
    """It used to build the store, skip 20 updates and stop blaming divergence: the weights are checked up front,
    as translate checks them."""
    state = load_checkpoint(base / "best.pt")
    state["model"]["encoder_layers.0.ffn.fc1.weight"][0, 0] = float("inf")
    save_checkpoint(state, tmp_path / "nan.pt")
    for command in ("train", "prepare"):
        status, _, err = call(
            command, write_config(tmp_path / "ft.yaml", fine_tune_config(tmp_path, tmp_path / "nan.pt", new_data))
        )
        assert status == 2 and err.splitlines()[-1] == (
            f"error: train.init_from: {tmp_path / 'nan.pt'}: 1 weight tensor(s) hold NaN or infinite values "
            "(encoder_layers.0.ffn.fc1.weight): the file is corrupt or its run diverged; use another checkpoint "
            "(step_*.pt, last.pt)"
        ), err
        assert not (tmp_path / "ft" / "store").exists() and not (tmp_path / "ft" / "spm.model").exists()


def test_a_learned_table_keeps_its_size(base, new_data, tmp_path):
    """model.max_positions may change under init_from while positions are a function of it; a learned table is
    weights of the checkpoint's size: refused before anything is built, naming the weight and the setting."""
    state = load_checkpoint(base / "best.pt")
    state["config"]["model"]["positions"] = "learned"
    model = Transformer(from_dict(state["config"]).model, len(vocab_from_stored(state["vocab"])))
    save_checkpoint({**state, "model": model.state_dict()}, tmp_path / "learned.pt")
    raw = fine_tune_config(tmp_path, tmp_path / "learned.pt", new_data)
    raw["model"].update(positions="learned", max_positions=80)
    with pytest.raises(
        UserError,
        match=r"position_encoding.source.weight is \(64, 32\), this model's would be "
        r"\(80, 32\): set model.max_positions as it was there",
    ):
        train(from_dict(raw), quiet=True)
    assert not (tmp_path / "ft" / "last.pt").exists()


def test_a_run_from_a_model_whose_vocabulary_lacks_its_tag_grows_the_vocabulary_by_it(base, new_data, tmp_path):
    """Back-translation warm-started from the model it improves: <bt> is appended to the vocabulary with an
    embedding row of its own; every other piece and weight starts as it was."""
    corpora = [{"name": "bt", "dir": str(new_data), "tag": "<bt>", "weight": 0.5}]
    raw = fine_tune_config(tmp_path, base, base.parent / "corpus", lr=1e-30)
    raw["data"]["corpora"] = corpora
    ft = train(from_dict(raw), quiet=True)
    old = load_checkpoint(base / "best.pt")
    new = load_checkpoint(ft / "last.pt")
    before, after = vocab_from_stored(old["vocab"]), vocab_from_stored(new["vocab"])
    assert len(after) == len(before) + 1 and after.piece_ids(["<bt>"]) == [len(before)]
    assert after.encode(["der hund läuft"]) == before.encode(["der hund läuft"])
    rows = new["model"]["src_embed.weight"]
    torch.testing.assert_close(rows[: len(before)], old["model"]["src_embed.weight"], atol=1e-6, rtol=0)
    assert rows[len(before)].abs().sum() > 0  # a row of its own, not zeros
    assert (ft / "spm.model").read_bytes() == after.stored
