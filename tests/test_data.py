"""Reading corpora, encoding, filtering, token batching, resumable streams, Batch tensors, vocabulary, hub loading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from transformer.batch import Batch, causal_mask, pad_sequences, padding_mask
from transformer.config import DataConfig
from transformer.corpus import load_split, read_lines, read_parallel, split_paths
from transformer.data import BatchStream, Prefetcher, eval_batches, make_batches, pack_by_size
from transformer.store import Corpus
from transformer.errors import UserError
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab, train_vocab

WORDS = ("der die das ein eine mann frau kind hund katze haus auf dem im spielt läuft sitzt "
         "the a man woman child dog cat house on in plays runs sits red blue green big small").split()


def synthetic_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return train_vocab(synthetic_sentences(400), vocab_size=100)


def random_pairs(n: int, seed: int = 0, max_len: int = 30) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [([rng.randint(4, 99) for _ in range(rng.randint(1, max_len))],
             [rng.randint(4, 99) for _ in range(rng.randint(1, max_len))]) for _ in range(n)]


# --------------------------------------------------------------------------- reading


def test_read_lines_basic(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes("eins\nzwei\n\ndrei\n".encode())
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


def test_load_split_local(tmp_path):
    cfg = DataConfig(dir=str(tmp_path), src_lang="de", tgt_lang="en")
    assert split_paths(cfg, "valid") == (tmp_path / "valid.de", tmp_path / "valid.en")
    (tmp_path / "valid.de").write_text("hallo\nwelt\n", encoding="utf-8")
    (tmp_path / "valid.en").write_text("hello\nworld\n", encoding="utf-8")
    assert load_split(cfg, "valid") == (["hallo", "welt"], ["hello", "world"])
    with pytest.raises(UserError, match="test.de"):
        load_split(cfg, "test")


# --------------------------------------------------------------------------- vocabulary and encoding


def test_vocab_special_ids_and_round_trip(vocab, tmp_path):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert vocab.sp.pad_id() == PAD_ID and vocab.sp.unk_id() == UNK_ID
    assert vocab.sp.bos_id() == BOS_ID and vocab.sp.eos_id() == EOS_ID
    assert 30 <= len(vocab) <= 100
    texts = synthetic_sentences(20, seed=7)
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


# --------------------------------------------------------------------------- batching


def batch_width(pairs, indices, pad_to_multiple=1) -> int:
    b = Batch.from_pairs([pairs[i] for i in indices], pad_to_multiple)
    return len(b) * max(b.src.size(1), b.tgt_in.size(1))


def lengths(pairs):
    return np.array([len(s) for s, _ in pairs]), np.array([len(t) for _, t in pairs])


def as_lists(batches) -> list[list[int]]:
    return [batches[i].tolist() for i in range(len(batches))]


@pytest.mark.parametrize("max_tokens, pad_to_multiple", [(64, 1), (200, 1), (200, 8), (1000, 3)])
def test_make_batches_covers_every_index_within_budget(max_tokens, pad_to_multiple):
    pairs = random_pairs(300, max_len=40 if max_tokens > 64 else 20)
    batches = as_lists(make_batches(*lengths(pairs), max_tokens, seed=1, epoch=0, pad_to_multiple=pad_to_multiple))
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(pairs)))
    for b in batches:
        assert b
        assert batch_width(pairs, b, pad_to_multiple) <= max_tokens
        batch = Batch.from_pairs([pairs[i] for i in b], pad_to_multiple)
        assert batch.src.size(1) % pad_to_multiple == 0
        assert batch.tgt_in.size(1) % pad_to_multiple == 0 and batch.tgt_out.shape == batch.tgt_in.shape
    # Greedy packing over the size-sorted order: each batch is cut exactly where pack_by_size would cut it.
    unshuffled = make_batches(*lengths(pairs), max_tokens, seed=1, epoch=0, shuffle=False,
                              pad_to_multiple=pad_to_multiple)
    sizes = [-(-(max(len(s), len(t)) + 1) // pad_to_multiple) * pad_to_multiple for s, t in pairs]
    assert as_lists(unshuffled) == pack_by_size(unshuffled.order.tolist(), sizes, max_tokens)


def test_make_batches_deterministic_and_epoch_dependent():
    src_len, tgt_len = lengths(random_pairs(200))
    a = as_lists(make_batches(src_len, tgt_len, 256, seed=3, epoch=2))
    assert a == as_lists(make_batches(src_len, tgt_len, 256, seed=3, epoch=2))
    assert a != as_lists(make_batches(src_len, tgt_len, 256, seed=3, epoch=3))
    assert a != as_lists(make_batches(src_len, tgt_len, 256, seed=4, epoch=2))
    # Unshuffled batches do not depend on seed or epoch.
    assert as_lists(make_batches(src_len, tgt_len, 256, 1, 0, shuffle=False)) == \
        as_lists(make_batches(src_len, tgt_len, 256, 9, 5, shuffle=False))


def test_make_batches_buckets_similar_lengths():
    rng = random.Random(0)
    pairs = []
    for _ in range(400):  # a translation's length follows its source's
        n = rng.randint(1, 60)
        pairs.append(([4] * n, [5] * max(1, n + rng.randint(-3, 3))))
    batches = as_lists(make_batches(*lengths(pairs), 600, seed=0, epoch=0))
    real = sum(len(s) + len(t) + 2 for s, t in pairs)
    padded = sum(len(b) * (max(len(pairs[i][0]) for i in b) + max(len(pairs[i][1]) for i in b) + 2) for b in batches)
    assert padded < 1.15 * real  # sorted by length: little padding on either side


def test_make_batches_scales_to_millions_of_pairs():
    rng = np.random.default_rng(0)
    src_len, tgt_len = rng.integers(1, 120, 2_000_000), rng.integers(1, 120, 2_000_000)
    batches = make_batches(src_len, tgt_len, 4096, seed=1, epoch=0)
    assert np.array_equal(np.sort(batches.order), np.arange(2_000_000))  # a permutation: every pair once
    sizes = np.maximum(src_len, tgt_len) + 1
    counts = batches.ends - batches.starts
    biggest = np.maximum.reduceat(sizes[batches.order], np.sort(batches.starts))
    assert (counts[np.argsort(batches.starts)] * biggest <= 4096).all()


def test_eval_batches_cover_all_in_order_of_length():
    pairs = random_pairs(50)
    batches = eval_batches(Corpus.from_pairs(pairs), 128)
    assert sum(len(b) for b in batches) == 50
    assert sum(b.n_tgt_tokens for b in batches) == sum(len(t) + 1 for _, t in pairs)
    widths = [max(b.src.size(1), b.tgt_in.size(1)) for b in batches]
    assert widths == sorted(widths)  # shortest first


def stream_cfg(**kw) -> DataConfig:
    return DataConfig(max_tokens=kw.pop("max_tokens", 128), max_len=kw.pop("max_len", 40), **kw)


def batches_equal(a: Batch, b: Batch) -> bool:
    return torch.equal(a.src, b.src) and torch.equal(a.tgt_in, b.tgt_in) and torch.equal(a.tgt_out, b.tgt_out)


def test_batch_from_corpus_equals_batch_from_pairs():
    pairs = random_pairs(40, max_len=25)
    for dtype in (np.uint16, np.int32):
        corpus = Corpus.from_pairs(pairs, dtype=dtype)
        for indices, multiple in (([3, 1, 4, 1, 5], 1), ([0], 8), (list(range(40)), 3)):
            a = Batch.from_corpus(corpus, np.array(indices), multiple)
            b = Batch.from_pairs([pairs[i] for i in indices], multiple)
            assert batches_equal(a, b) and a.src.dtype == b.src.dtype == torch.long
            assert (a.n_src_tokens, a.n_tgt_tokens) == (b.n_src_tokens, b.n_tgt_tokens)


def test_batch_stream_covers_epoch_then_reshuffles():
    pairs = random_pairs(120, max_len=20)
    cfg = stream_cfg()
    stream = BatchStream(Corpus.from_pairs(pairs), cfg, seed=5)
    n = stream.batches_per_epoch
    assert n == len(make_batches(*lengths(pairs), cfg.max_tokens, 5, 0))
    epoch0 = [next(stream) for _ in range(n)]
    assert sum(len(b) for b in epoch0) == len(pairs)
    epoch1 = [next(stream) for _ in range(n)]
    assert stream.epoch == 1
    assert sum(len(b) for b in epoch1) == len(pairs)
    assert not all(batches_equal(a, b) for a, b in zip(epoch0, epoch1))


@pytest.mark.parametrize("where", ["start", "inside epoch 0", "epoch boundary", "inside epoch 1"])
def test_batch_stream_resumes(where):
    corpus = Corpus.from_pairs(random_pairs(90, max_len=20))
    cfg = stream_cfg(pad_to_multiple=4)
    reference = BatchStream(corpus, cfg, seed=2)
    n = reference.batches_per_epoch
    assert n >= 4
    total = 2 * n + 3  # across two epoch boundaries
    stop = {"start": 0, "inside epoch 0": 2, "epoch boundary": n, "inside epoch 1": n + 3}[where]
    expected = [next(reference) for _ in range(total)]

    first = BatchStream(corpus, cfg, seed=2)
    for _ in range(stop):
        next(first)
    state = dict(first.state())
    resumed = BatchStream(corpus, cfg, seed=2, **state)
    rest = [next(resumed) for _ in range(total - stop)]
    assert all(batches_equal(a, b) for a, b in zip(expected[stop:], rest))
    assert all(b.src.size(1) % 4 == 0 for b in rest)


def test_prefetcher_yields_the_stream_updates_in_order_with_their_positions():
    corpus = Corpus.from_pairs(random_pairs(90, max_len=20))
    cfg = stream_cfg()
    direct = BatchStream(corpus, cfg, seed=4, update_freq=2)
    expected = [direct.next_update() for _ in range(3 * direct.batches_per_epoch // 2)]
    prefetch = Prefetcher(BatchStream(corpus, cfg, seed=4, update_freq=2))
    try:
        for want in expected:
            got = prefetch.next()
            assert all(batches_equal(a, b) for a, b in zip(got.batches, want.batches))
            assert (got.n_tgt_tokens, got.data_state, got.epochs_done) == \
                (want.n_tgt_tokens, want.data_state, want.epochs_done)
            assert prefetch.epochs_done == want.epochs_done
    finally:
        prefetch.close()
    assert prefetch.wait_seconds >= 0.0


def test_prefetcher_raises_the_stream_error_in_the_caller():
    # update_freq 1 cannot resume mid-update of 3: the stream's error surfaces from next(), not in the thread.
    stream = BatchStream(Corpus.from_pairs(random_pairs(30, max_len=5)), stream_cfg(), seed=1)
    stream.position = 1
    stream.update_freq = 2
    prefetch = Prefetcher(stream)
    with pytest.raises(RuntimeError, match="middle of an update"):
        prefetch.next()
    prefetch.close()


def test_batch_stream_rank_sharding_partitions_epoch():
    # Each source starts with two tokens that spell its index, so a batch row names its pair.
    pairs = [([10 + i // 90, 10 + i % 90] + s, t) for i, (s, t) in enumerate(random_pairs(150, max_len=18))]
    cfg = stream_cfg()
    all_batches = as_lists(make_batches(*lengths(pairs), cfg.max_tokens, 7, 0))
    seen = []
    for rank in (0, 1):
        stream = BatchStream(Corpus.from_pairs(pairs), cfg, seed=7, rank=rank, world_size=2)
        assert stream.batches_per_epoch == len(all_batches) // 2
        batches = [next(stream) for _ in range(stream.batches_per_epoch)]
        seen.append([(int(row[0]) - 10) * 90 + int(row[1]) - 10 for b in batches for row in b.src])
        # rank r takes batches r, r + 2, r + 4, ... of the epoch's order
        assert seen[-1] == [i for b in all_batches[rank: 2 * len(batches): 2] for i in b]
    assert not set(seen[0]) & set(seen[1])  # disjoint
    covered = set(seen[0]) | set(seen[1])
    left_out = [b for b in all_batches if not set(b) <= covered]
    assert len(left_out) == len(all_batches) % 2  # at most the batch that cannot be split evenly
    assert len(covered) + sum(len(b) for b in left_out) == len(pairs)


def test_batch_stream_too_few_batches_for_ranks():
    with pytest.raises(UserError):
        BatchStream(Corpus.from_pairs(random_pairs(1, max_len=5)), stream_cfg(), seed=1, rank=0, world_size=2)


# --------------------------------------------------------------------------- Batch


def test_batch_from_pairs_shift_and_counts():
    pairs = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13, 14])]
    b = Batch.from_pairs(pairs)
    assert len(b) == 2
    assert b.src.shape == (2, 4) and b.tgt_in.shape == (2, 5) and b.tgt_out.shape == (2, 5)
    for row, (s, t) in enumerate(pairs):
        n = len(t) + 1
        assert b.src[row, : len(s) + 1].tolist() == s + [EOS_ID]
        assert b.tgt_in[row, 0] == BOS_ID and b.tgt_in[row, :n].tolist() == [BOS_ID] + t
        assert b.tgt_out[row, :n].tolist() == t + [EOS_ID] and b.tgt_out[row, n - 1] == EOS_ID
        assert b.tgt_in[row, 1:n].tolist() == b.tgt_out[row, : n - 1].tolist()  # shifted by one
        assert torch.all(b.tgt_in[row, n:] == PAD_ID) and torch.all(b.tgt_out[row, n:] == PAD_ID)
        assert torch.all(b.src[row, len(s) + 1:] == PAD_ID)
    assert b.n_src_tokens == int((b.src != PAD_ID).sum())
    assert b.n_tgt_tokens == int((b.tgt_out != PAD_ID).sum()) == int((b.tgt_in != PAD_ID).sum())


def test_batch_pad_to_multiple():
    pairs = [([5] * 6, [8] * 2), ([10] * 2, [11] * 9)]
    b = Batch.from_pairs(pairs, pad_to_multiple=8)
    assert b.src.size(1) == 8 and b.tgt_in.size(1) == 16 and b.tgt_out.size(1) == 16
    assert b.n_tgt_tokens == 2 + 1 + 9 + 1


def test_batch_masks():
    pairs = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13, 14])]
    b = Batch.from_pairs(pairs)
    src_mask, tgt_mask = b.src_mask, b.tgt_mask
    assert src_mask.dtype == torch.bool and src_mask.shape == (2, 1, 1, 4)
    assert src_mask[:, 0, 0].tolist() == [[True] * 4, [True, True, False, False]]
    T = b.tgt_in.size(1)
    assert tgt_mask.dtype == torch.bool and tgt_mask.shape == (2, 1, T, T)
    for row in range(2):
        m = tgt_mask[row, 0]
        key_real = b.tgt_in[row] != PAD_ID
        for i in range(T):
            for j in range(T):
                assert bool(m[i, j]) == (j <= i and bool(key_real[j]))
        assert torch.equal(m, m.tril())
    assert torch.equal(causal_mask(3)[0, 0], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.equal(padding_mask(torch.tensor([[4, 0]]))[0, 0, 0], torch.tensor([True, False]))


def test_pad_sequences():
    out = pad_sequences([[4, 5], [6]], pad_to_multiple=4)
    assert out.dtype == torch.long and out.tolist() == [[4, 5, 0, 0], [6, 0, 0, 0]]


def test_batch_to_keeps_counts():
    b = Batch.from_pairs([([5, 6], [7])]).to("cpu")
    assert b.n_src_tokens == 3 and b.n_tgt_tokens == 2


# --------------------------------------------------------------------------- Hugging Face datasets


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    return tmp_path


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


HUB_TRAIN = [("Ein Hund läuft.", "A dog runs."), ("Zwei Männer.", "Two men."), ("Eine Katze.", "A cat.")]
HUB_VALID = [("Ein Kind spielt.", "A child plays."), ("Ein Haus.", "A house.")]


@pytest.mark.parametrize("layout", ["columns", "translation"])
def test_hub_split_from_local_files(offline_hub, layout):
    data = offline_hub / f"hub-{layout}"
    data.mkdir()
    for name, pairs in (("train", HUB_TRAIN), ("validation", HUB_VALID)):
        if layout == "columns":
            rows = [{"de": de, "en": en} for de, en in pairs]
        else:
            rows = [{"translation": {"de": de, "en": en}} for de, en in pairs]
        write_jsonl(data / f"{name}.jsonl", rows)
    cfg = DataConfig(source="hub", hub_name=str(data), hub_config=None, src_lang="de", tgt_lang="en",
                     valid_split="validation")
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
    data = offline_hub / "hub-fr"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"fr": "Un chien.", "en": "A dog."}])
    cfg = DataConfig(source="hub", hub_name=str(data), src_lang="de", tgt_lang="en")
    with pytest.raises(UserError, match="columns"):
        load_split(cfg, "train")
