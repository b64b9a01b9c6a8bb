"""Raw parallel corpora (data/corpus.py): reading lines and pairs, what a file that is not a corpus says, split names
and aliases, hub datasets, the sentences the vocabulary is trained on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import tiny_config, write_config, write_corpus, write_hub_folder
from transformer.config import DataConfig
from transformer.data.corpus import chain_lines, load_split, read_lines, read_parallel, resolve_split, split_paths
from transformer.errors import UserError


def test_read_lines_basic(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"eins\nzwei\n\ndrei\n")
    assert read_lines(path) == ["eins", "zwei", "", "drei"]
    path.write_bytes(b"no final newline")
    assert read_lines(path) == ["no final newline"]


def test_read_lines_does_not_split_on_unicode_separators(tmp_path):
    lines = ["a\u2028b", "form\x0cfeed", "vt\x0bx", "nel\x85y", "ps\u2029z", "gs\x1dw", "lone\rcr"]
    path = tmp_path / "a.txt"
    path.write_bytes(("\n".join(lines) + "\n").encode())
    assert read_lines(path) == lines


def test_read_lines_crlf_and_bom(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes("\ufeffeins\r\nzwei\r\n\r\ndrei\r\n".encode())
    assert read_lines(path) == ["eins", "zwei", "", "drei"]


def test_read_lines_missing_file(tmp_path):
    path = tmp_path / "missing.de"
    with pytest.raises(UserError) as e:
        read_lines(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("bad_line", [1, 3, 5])
def test_read_lines_non_utf8_names_file_and_line(tmp_path, bad_line):
    lines = [f"line {i} ok".encode() for i in range(1, 6)]
    lines[bad_line - 1] = b"caf\xe9 au lait"  # Latin-1 byte
    path = tmp_path / "latin1.en"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(UserError) as e:
        read_lines(path)
    message = str(e.value)
    assert str(path) in message
    assert f"line {bad_line}" in message
    assert "UTF-8" in message


def test_read_parallel(tmp_path):
    (tmp_path / "s").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "t").write_text("x\ny\nz\n", encoding="utf-8")
    assert read_parallel(tmp_path / "s", tmp_path / "t") == (["a", "b", "c"], ["x", "y", "z"])


def test_read_parallel_different_line_counts(tmp_path):
    (tmp_path / "s.de").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "t.en").write_text("x\ny\nz\nw\nv\n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        read_parallel(tmp_path / "s.de", tmp_path / "t.en")
    message = str(e.value)
    assert "3" in message and "5" in message
    assert "s.de" in message and "t.en" in message


def test_read_parallel_empty(tmp_path):
    (tmp_path / "s").write_bytes(b"")
    (tmp_path / "t").write_bytes(b"")
    with pytest.raises(UserError, match="empty"):
        read_parallel(tmp_path / "s", tmp_path / "t")


def test_read_parallel_missing_side(tmp_path):
    (tmp_path / "s").write_text("a\n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        read_parallel(tmp_path / "s", tmp_path / "nope")
    assert "nope" in str(e.value)


def test_read_parallel_from_pipes_and_count_lines_refuses_them(tmp_path):
    from transformer.data.corpus import count_lines

    ends = []
    for text in ("a\nb\n", "x\ny\n", "a\n"):
        read_end, write_end = os.pipe()
        os.write(write_end, text.encode())
        os.close(write_end)
        ends.append(read_end)
    try:
        src, tgt, third = (f"/dev/fd/{fd}" for fd in ends)
        assert read_parallel(src, tgt) == (["a", "b"], ["x", "y"])  # each read once: counting would empty them
        with pytest.raises(UserError, match=f"^data: {third} is not a regular file .*it is read twice"):
            count_lines(third)
    finally:
        for fd in ends:
            os.close(fd)
    with pytest.raises(UserError, match=f"^data: {tmp_path} is a directory, not a file$"):
        read_parallel(tmp_path, tmp_path)


def test_load_split_local(tmp_path):
    cfg = DataConfig(dir=str(tmp_path), src_lang="de", tgt_lang="en")
    assert split_paths(cfg, "valid") == (tmp_path / "valid.de", tmp_path / "valid.en")
    (tmp_path / "valid.de").write_text("hallo\nwelt\n", encoding="utf-8")
    (tmp_path / "valid.en").write_text("hello\nworld\n", encoding="utf-8")
    assert load_split(cfg, "valid") == (["hallo", "welt"], ["hello", "world"])
    with pytest.raises(UserError, match="test.de"):
        load_split(cfg, "test")


def test_load_split_refuses_sides_of_different_lengths(tmp_path):
    """A test set whose sides disagree is an error, as for training data, not silently cut to the shorter side."""
    cfg = DataConfig(dir=str(tmp_path), src_lang="de", tgt_lang="en")
    (tmp_path / "test.de").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "test.en").write_text("x\ny\n", encoding="utf-8")
    with pytest.raises(UserError, match="has 3 lines but .* has 2"):
        load_split(cfg, "test")


HUB_TRAIN = [("Ein Hund läuft.", "A dog runs."), ("Zwei Männer.", "Two men."), ("Eine Katze.", "A cat.")]


HUB_VALID = [("Ein Kind spielt.", "A child plays."), ("Ein Haus.", "A house.")]


@pytest.mark.parametrize("layout", ["columns", "translation"])
def test_hub_split_from_local_files(offline_hub, layout):
    data = write_hub_folder(offline_hub / f"hub-{layout}", layout, {"train": HUB_TRAIN, "validation": HUB_VALID})
    cfg = DataConfig(
        source="hub", hub_name=str(data), hub_config=None, src_lang="de", tgt_lang="en", valid_split="validation"
    )
    src, tgt = load_split(cfg, "train")
    assert list(src) == [de for de, _ in HUB_TRAIN] and list(tgt) == [en for _, en in HUB_TRAIN]
    src, tgt = load_split(cfg, cfg.valid_split)
    assert list(src) == [de for de, _ in HUB_VALID] and list(tgt) == [en for _, en in HUB_VALID]
    # The direction follows src_lang / tgt_lang.
    reverse = DataConfig(source="hub", hub_name=str(data), src_lang="en", tgt_lang="de")
    src, tgt = load_split(reverse, "train")
    assert list(src) == [en for _, en in HUB_TRAIN] and list(tgt) == [de for de, _ in HUB_TRAIN]
    # An unknown split is a one-line user error naming it.
    with pytest.raises(UserError) as e:
        load_split(cfg, "test")
    assert "'test'" in str(e.value) and "\n" not in str(e.value)


def test_hub_split_wrong_columns(offline_hub):
    data = write_hub_folder(
        offline_hub / "hub-fr", "columns", {"train": [("Un chien.", "A dog.")]}, languages=("fr", "en")
    )
    cfg = DataConfig(source="hub", hub_name=str(data), src_lang="de", tgt_lang="en")
    with pytest.raises(UserError, match="columns"):
        load_split(cfg, "train")


def test_dev_files_are_the_valid_split(tmp_path):
    """WMT and IWSLT ship their validation set as dev.*"""
    for split in ("train", "dev"):
        for side in ("de", "en"):
            (tmp_path / f"{split}.{side}").write_text("ein hund\n", encoding="utf-8")
    cfg = DataConfig(dir=str(tmp_path), src_lang="de", tgt_lang="en")
    assert resolve_split(cfg, "valid") == "dev"
    assert split_paths(cfg, resolve_split(cfg, "valid")) == (tmp_path / "dev.de", tmp_path / "dev.en")


def test_the_vocabulary_is_trained_on_both_sides_in_turn():
    chunks = iter([(["s1", "s2"], ["t1", "t2"]), (["s3"], ["t3"])])
    assert list(chain_lines(chunks)) == ["s1", "t1", "s2", "t2", "s3", "t3"]


def _utf16(corpus: Path) -> None:
    text = (corpus / "train.de").read_text(encoding="utf-8").replace("a", "\u010a")  # U+010A holds byte 0x0a
    (corpus / "train.de").write_text(text, encoding="utf-16")


def _fifo(corpus: Path) -> None:
    (corpus / "train.de").unlink()
    os.mkfifo(corpus / "train.de")


def _directory(corpus: Path) -> None:
    (corpus / "train.de").unlink()
    (corpus / "train.de").mkdir()


def _blank(corpus: Path) -> None:
    for side in ("de", "en"):
        (corpus / f"train.{side}").write_text(" \n\n  \n", encoding="utf-8")


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            _utf16,
            "data: {corpus}/train.de is not UTF-8: it holds UTF-16 text (it starts with a UTF-16 byte-order mark); "
            "convert it, e.g. iconv -f UTF-16 -t UTF-8 {corpus}/train.de > train.de.utf8, and use that",
        ),
        (
            _fifo,
            "data: {corpus}/train.de is not a regular file (a pipe or a device); a corpus is read more than once "
            "(counted, then encoded), so give a file",
        ),
        (_directory, "data: {corpus}/train.de is a directory, not a file (split 'train' in data.dir '{corpus}')"),
        (
            _blank,
            "vocab: every training sentence is blank (or only spaces): there is no text to train a SentencePiece "
            "model on; check the training split's files (data.dir, data.train_split)",
        ),
    ],
    ids=["utf-16", "fifo", "directory", "blank"],
)
def test_a_corpus_that_is_not_what_it_should_be_is_named_for_what_it_is(tmp_path, call, damage, message):
    """Were: a line-count mismatch (UTF-16), "no such file" (a directory or a FIFO that is there), SentencePiece's
    INTERNAL error (blank-only sides)."""
    corpus = write_corpus(tmp_path / "corpus")
    damage(corpus)
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, data_dir=corpus))
    status, _, err = call("prepare", config)
    assert (status, err.splitlines()[-1]) == (2, "error: " + message.format(corpus=corpus)), err
