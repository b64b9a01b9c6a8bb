"""Which ids go into which batch (data/loader.py): token batching on numpy lengths, resumable streams and prefetching,
rank sharding, and length batches for translation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.helpers import batches_equal, random_pairs
from transformer.config import DataConfig
from transformer.data import loader as data_module
from transformer.data.batch import Batch
from transformer.data.loader import BatchStream, Prefetcher, eval_batches, make_batches, pack_by_size
from transformer.data.store import Corpus
from transformer.data.vocab import PAD_ID
from transformer.errors import UserError

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
    unshuffled = make_batches(
        *lengths(pairs), max_tokens, seed=1, epoch=0, shuffle=False, pad_to_multiple=pad_to_multiple
    )
    sizes = [-(-(max(len(s), len(t)) + 1) // pad_to_multiple) * pad_to_multiple for s, t in pairs]
    assert as_lists(unshuffled) == pack_by_size(unshuffled.order.tolist(), sizes, max_tokens)


def test_make_batches_deterministic_and_epoch_dependent():
    src_len, tgt_len = lengths(random_pairs(200))
    a = as_lists(make_batches(src_len, tgt_len, 256, seed=3, epoch=2))
    assert a == as_lists(make_batches(src_len, tgt_len, 256, seed=3, epoch=2))
    assert a != as_lists(make_batches(src_len, tgt_len, 256, seed=3, epoch=3))
    assert a != as_lists(make_batches(src_len, tgt_len, 256, seed=4, epoch=2))
    # Unshuffled batches do not depend on seed or epoch.
    assert as_lists(make_batches(src_len, tgt_len, 256, 1, 0, shuffle=False)) == as_lists(
        make_batches(src_len, tgt_len, 256, 9, 5, shuffle=False)
    )


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
            assert (got.n_tgt_tokens, got.data_state, got.epochs_done) == (
                want.n_tgt_tokens,
                want.data_state,
                want.epochs_done,
            )
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
        assert seen[-1] == [i for b in all_batches[rank : 2 * len(batches) : 2] for i in b]
    assert not set(seen[0]) & set(seen[1])  # disjoint
    covered = set(seen[0]) | set(seen[1])
    left_out = [b for b in all_batches if not set(b) <= covered]
    assert len(left_out) == len(all_batches) % 2  # at most the batch that cannot be split evenly
    assert len(covered) + sum(len(b) for b in left_out) == len(pairs)


def test_batch_stream_too_few_batches_for_ranks():
    with pytest.raises(UserError):
        BatchStream(Corpus.from_pairs(random_pairs(1, max_len=5)), stream_cfg(), seed=1, rank=0, world_size=2)


def test_an_update_counts_the_tokens_of_every_ranks_batches_eos_included():
    # The loss of an update is divided by n_tgt_tokens: it must be the target positions the batches score.
    corpus = Corpus.from_pairs(random_pairs(120, max_len=20))
    ranks = [BatchStream(corpus, stream_cfg(), seed=5, rank=r, world_size=2, update_freq=2) for r in (0, 1)]
    for _ in range(3):
        updates = [stream.next_update() for stream in ranks]
        batches = [b for u in updates for b in u.batches]
        scored = sum(int((b.tgt_out != PAD_ID).sum()) for b in batches)
        read = sum(int((b.src != PAD_ID).sum()) for b in batches)
        assert sum(b.n_tgt_tokens for b in batches) == scored
        for u in updates:
            assert (u.n_tgt_tokens, u.n_src_tokens) == (scored, read)


# ----------------------------------------------------------------------------- what mutation testing found unchecked


def test_an_epochs_batches_come_in_random_order_not_by_length():
    """Batches are cut from a length-sorted order; without the shuffle every epoch would run from the shortest
    batches to the longest."""
    src_len, tgt_len = lengths(random_pairs(400, max_len=40))
    widths = [
        int(np.max(np.maximum(src_len[b], tgt_len[b]))) for b in as_lists(make_batches(src_len, tgt_len, 200, 1, 0))
    ]
    assert widths != sorted(widths) and widths != sorted(widths, reverse=True)
    unshuffled = [
        int(np.max(np.maximum(src_len[b], tgt_len[b])))
        for b in as_lists(make_batches(src_len, tgt_len, 200, 1, 0, shuffle=False))
    ]
    assert unshuffled == sorted(unshuffled)


def test_long_pairs_are_sorted_like_lexsort_and_batched_within_budget():
    """Past 2,047 tokens the packed one-key sort would overlap its fields; lengths up to 4,000 (data.max_len is
    the user's) must sort as the reference does, and every batch stay within max_tokens."""
    rng = np.random.default_rng(0)
    src_len, tgt_len = rng.integers(1, 4000, 3000), rng.integers(1, 4000, 3000)
    src_len[:20], tgt_len[:20] = 2049, 10  # the case of the overlap: size 2050 ...
    src_len[20:40], tgt_len[20:40] = 1, 2050  # ... against size 2051
    size = np.maximum(src_len, tgt_len) + 1
    tie = rng.permutation(len(size))
    assert np.array_equal(
        data_module._length_sorted(size, src_len, tgt_len, tie),
        tie[np.lexsort((tgt_len[tie], src_len[tie], size[tie]))],
    )
    batches = make_batches(src_len, tgt_len, 8192, seed=0, epoch=0)
    for b in as_lists(batches):
        assert len(b) * int(size[b].max()) <= 8192 or len(b) == 1


def test_source_batches_count_each_sources_rows():
    """A source searched as `rows` rows (its samples) counts rows x (length + EOS) tokens against max_tokens."""
    from transformer.data.loader import source_batches

    src_ids = [[5] * n for n in (3, 9, 4, 0, 7, 2, 8, 5)]
    for rows in (1, 4):
        batches = source_batches(src_ids, 64, 80, rows=rows)
        assert sorted(i for b in batches for i in b) == [0, 1, 2, 4, 5, 6, 7]  # the empty source is never searched
        assert all(len(b) * rows * max(len(src_ids[i]) + 1 for i in b) <= 80 for b in batches)
    assert len(source_batches(src_ids, 64, 80, rows=4)) > len(source_batches(src_ids, 64, 80))
