"""The SentencePiece vocabulary: special ids, encode/decode round trip, save and load, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.helpers import sentences, subprocess_env, tiny_config
from transformer.config import from_dict
from transformer.data.vocab import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    POOL_FROM,
    UNK_ID,
    Vocab,
    sample_sentences,
    split_texts,
    train_vocab,
)
from transformer.errors import UserError
from transformer.model.checkpoint import load_checkpoint
from transformer.training.loop import train


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return train_vocab(sentences(0, 400, hi=12), vocab_size=100)


def test_vocab_special_ids_and_round_trip(vocab, tmp_path):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert vocab.sp.pad_id() == PAD_ID and vocab.sp.unk_id() == UNK_ID
    assert vocab.sp.bos_id() == BOS_ID and vocab.sp.eos_id() == EOS_ID
    assert 30 <= len(vocab) <= 100
    texts = sentences(7, 20, hi=12)
    ids = vocab.encode(texts)
    assert all(len(seq) > 0 for seq in ids)
    assert all(4 <= i < len(vocab) for seq in ids for i in seq)  # no specials inside text
    assert vocab.decode(ids) == texts
    # Special ids are dropped when decoding.
    assert vocab.decode([[BOS_ID] + ids[0] + [EOS_ID, PAD_ID, PAD_ID]]) == [texts[0]]
    # Save / load gives the same model.
    vocab.save(tmp_path / "spm.model")
    again = Vocab.load(tmp_path / "spm.model")
    assert again.encode(texts) == ids and len(again) == len(vocab)


def test_text_that_is_not_unicode_encodes_as_the_replacement_character(vocab):
    """A command-line byte that is not UTF-8 reaches Python as a lone surrogate ("M\\xe4dchen" in Latin-1 is
    "M\\udce4dchen"), as does a JSON "\\ud800": each encodes like U+FFFD, what a stream's bad byte becomes."""
    texts = sentences(3, 4, hi=12)
    bad = [texts[0][:3] + "\udce4" + texts[0][3:], "\ud800" + texts[1], texts[2]]
    assert vocab.encode(bad) == vocab.encode([t.replace("\udce4", "\ufffd").replace("\ud800", "\ufffd") for t in bad])
    assert vocab.encode(texts[:1]) != vocab.encode(bad[:1])  # the bad character is kept as one (unknown) piece
    with pytest.raises(TypeError):  # not text at all stays an error
        vocab.encode([texts[0], 5])


def test_few_sentences_split_in_this_thread_as_many_do_on_the_pool(vocab):
    """Below POOL_FROM sentences are split one by one in the calling thread (SentencePiece's pool costs
    0.08 to 4 ms to start, a serve request's sentence 12 us), from it on one call on every core: the same ids,
    bad text included."""
    texts = sentences(5, POOL_FROM + 8, hi=12)
    texts[7] = texts[7][:2] + "\udce4" + texts[7][2:]
    many = vocab.encode(texts)
    assert many == [vocab.encode([t])[0] for t in texts] == vocab.encode(texts[:50]) + vocab.encode(texts[50:])

    class Calls:
        def __init__(self):
            self.calls = []

        def encode(self, texts, **options):
            self.calls.append((texts, options))
            return [[1]] * len(texts) if isinstance(texts, list) else [1]

    few, pooled = Calls(), Calls()
    split_texts(few, texts[: POOL_FROM - 1], int)
    split_texts(pooled, texts[:POOL_FROM], int)
    assert len(few.calls) == POOL_FROM - 1 and all(
        isinstance(t, str) and not o.get("num_threads") for t, o in few.calls
    )
    assert len(pooled.calls) == 1 and pooled.calls[0][1]["num_threads"] >= 1


def test_vocab_errors(tmp_path):
    with pytest.raises(UserError, match="no SentencePiece model"):
        Vocab.load(tmp_path / "missing.model")
    with pytest.raises(UserError, match="SentencePiece"):
        Vocab(b"definitely not a model")


def test_sample_sentences_is_uniform_reproducible_and_keeps_a_small_corpus_whole():
    items = [f"s{i}" for i in range(10)]
    assert sample_sentences(iter(items), 10, seed=1) == items
    assert sample_sentences(iter(items), 20, seed=1) == items
    picks = sample_sentences(iter(items), 5, seed=3)
    assert len(picks) == 5 == len(set(picks)) and set(picks) <= set(items)
    assert picks == sample_sentences(iter(items), 5, seed=3)
    counts = dict.fromkeys(items, 0)
    for seed in range(2000):
        for s in sample_sentences(iter(items), 5, seed):
            counts[s] += 1
    assert all(850 <= c <= 1150 for c in counts.values()), counts  # each kept half the time, the last ones too


def test_a_sampled_vocabulary_is_the_same_in_every_process(tmp_path):
    """SentencePiece's own sample (input_sentence_size) changed from one process to the next whatever its seed;
    the same corpus, size and seed must give the same vocabulary in two runs of a config."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences(5, 3000, hi=12)) + "\n", encoding="utf-8")
    script = (
        "import hashlib, sys\nfrom transformer.data.vocab import train_vocab\n"
        f"lines = open({str(corpus)!r}, encoding='utf-8').read().splitlines()\n"
        "print(hashlib.sha256(train_vocab(lines, 150, max_sentences=1000, seed=7).proto).hexdigest())\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=subprocess_env()
        ).stdout
        for _ in range(3)
    }
    assert len(digests) == 1


def test_a_vocabulary_smaller_than_asked_is_logged_and_noted_in_config_yaml(capsys, tmp_path):
    cfg = tiny_config(
        tmp_path,
        "run",
        data={"vocab_size": 3000},
        train={"max_steps": 1, "valid_every": 1, "finish": True},
        decode={"max_len_offset": 2},
    )
    run_dir = train(from_dict(cfg), quiet=True)  # the end of training writes config.yaml again: the note stays
    pieces = len(Vocab.load(run_dir / "spm.model"))
    assert pieces < 3000
    assert f"the training data gives only {pieces} pieces, fewer than data.vocab_size 3000" in capsys.readouterr().err
    text = (run_dir / "config.yaml").read_text()
    assert (run_dir / "final.pt").is_file()
    assert f"# The vocabulary has {pieces} pieces (data.vocab_size 3000 is an upper bound" in text
    assert yaml.safe_load(text)["data"]["vocab_size"] == 3000  # the setting as asked: resume compares it
    assert load_checkpoint(run_dir / "last.pt")["config"]["data"]["vocab_size"] == 3000


def test_a_reused_smaller_spm_model_is_a_warning(tmp_path, caplog):
    path = tmp_path / "spm.model"
    path.write_bytes(train_vocab(sentences(0, 300), vocab_size=64).proto)
    with caplog.at_level("WARNING", logger="transformer"):
        Vocab.load(path).check_reuse(path, 100)
    assert f"{path} has 64 pieces, fewer than data.vocab_size 100" in caplog.text
