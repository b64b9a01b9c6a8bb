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


def test_text_that_is_not_unicode_encodes_as_the_replacement_character(vocab):
    """A command-line byte that is not UTF-8 reaches Python as a lone surrogate ("M\\xe4dchen" in Latin-1 is
    "M\\udce4dchen"), as does a JSON "\\ud800": each encodes like U+FFFD, what a stream's bad byte becomes."""
    texts = sentences(3, 4, hi=12)
    bad = [texts[0][:3] + "\udce4" + texts[0][3:], "\ud800" + texts[1], texts[2]]
    assert vocab.encode(bad) == vocab.encode([t.replace("\udce4", "\ufffd").replace("\ud800", "\ufffd")
                                             for t in bad])
    assert vocab.encode(texts[:1]) != vocab.encode(bad[:1])  # the bad character is kept as one (unknown) piece
    with pytest.raises(TypeError):  # not text at all stays an error
        vocab.encode([texts[0], 5])


def test_vocab_errors(tmp_path):
    with pytest.raises(UserError, match="no SentencePiece model"):
        Vocab.load(tmp_path / "missing.model")
    with pytest.raises(UserError, match="SentencePiece"):
        Vocab(b"definitely not a model")
