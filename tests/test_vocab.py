"""The SentencePiece vocabulary: special ids, encode/decode round trip, save and load, errors."""

from __future__ import annotations

import pytest

from tests.conftest import sentences
from transformer.errors import UserError
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab, train_vocab


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


def test_vocab_errors(tmp_path):
    with pytest.raises(UserError, match="no SentencePiece model"):
        Vocab.load(tmp_path / "missing.model")
    with pytest.raises(UserError, match="SentencePiece"):
        Vocab(b"definitely not a model")
