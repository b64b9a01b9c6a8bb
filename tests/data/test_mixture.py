"""Several corpora as one run's training pairs (mixture.py): what an epoch draws of each by its weight, a pure
function of (seed, epoch); batches across corpora; the order a resume compares; each corpus's share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import batches_equal, random_pairs
from transformer.config import DataConfig
from transformer.data.batch import Batch
from transformer.data.loader import BatchStream
from transformer.data.mixture import Mixture, Part
from transformer.data.store import Corpus


def corpus(n: int, seed: int) -> Corpus:
    return Corpus.from_pairs(random_pairs(n, seed=seed, max_len=12))


def drawn_counts(mixture: Mixture, seed: int, epoch: int) -> np.ndarray:
    """How often each mixture index is drawn in the epoch."""
    drawn = mixture.drawn(seed, epoch)
    return np.ones(len(mixture), dtype=np.int64) if drawn is None else np.bincount(drawn, minlength=len(mixture))


def test_weights_say_how_often_each_corpus_is_drawn_and_the_draw_is_the_epochs_own():
    a, b, c = corpus(40, 1), corpus(30, 2), corpus(20, 3)
    mixture = Mixture([Part("a", a, 1.0), Part("b", b, 2.0), Part("c", c, 0.5)])
    counts = drawn_counts(mixture, seed=7, epoch=0)
    assert (counts[:40] == 1).all() and (counts[40:70] == 2).all()  # all of a once, all of b twice
    assert counts[70:].sum() == 10 and set(counts[70:]) <= {0, 1}  # half of c, none twice
    again = drawn_counts(mixture, seed=7, epoch=0)
    other_epoch = drawn_counts(mixture, seed=7, epoch=1)
    assert (again == counts).all()  # a pure function of (seed, epoch): a resume draws the same
    assert not (other_epoch[70:] == counts[70:]).all()  # another half of c next epoch
    assert (drawn_counts(Mixture([Part("x", a, 1.5)]), 0, 0) >= 1).all()  # 1.5: every pair, half of them twice
    assert drawn_counts(Mixture([Part("x", a, 1.5)]), 0, 0).sum() == 60


def test_one_corpus_of_weight_one_is_the_epoch_training_always_had():
    pairs = corpus(60, 4)
    assert Mixture.of(pairs).drawn(3, 0) is None and Mixture.of(pairs).every_pair_once
    cfg = DataConfig(max_tokens=64, max_len=12)
    plain, mixed = BatchStream(pairs, cfg, seed=3), BatchStream(Mixture.of(pairs), cfg, seed=3)
    for _ in range(2 * plain.batches_per_epoch):
        assert batches_equal(next(plain), next(mixed))
    assert Mixture.of(pairs).train_order == ""  # a corpus alone: its store's order, as runs recorded it
    assert Mixture([Part("main", pairs, 1.0, order="abc")]).train_order == "abc"


def test_a_batch_across_corpora_holds_each_corpuss_pairs():
    a, b = random_pairs(5, seed=1), random_pairs(4, seed=2)
    mixture = Mixture([Part("a", Corpus.from_pairs(a)), Part("b", Corpus.from_pairs(b))])
    batch = mixture.batch(np.array([6, 1, 8, 3]))  # b's 1, a's 1, b's 3, a's 3: grouped by corpus
    expected = Batch.from_pairs([a[1], a[3], b[1], b[3]])
    assert batches_equal(batch, expected)
    assert (batch.n_src_tokens, batch.n_tgt_tokens) == (expected.n_src_tokens, expected.n_tgt_tokens)


def test_a_stream_over_weighted_corpora_draws_them_by_weight_and_resumes_where_it_stopped():
    a, b = corpus(50, 5), corpus(100, 6)
    mixture = Mixture([Part("a", a, 2.0), Part("b", b, 0.5)])
    cfg = DataConfig(max_tokens=80, max_len=12)
    stream = BatchStream(mixture, cfg, seed=1)
    seen = []
    for _ in range(stream.batches_per_epoch):
        batch = next(stream)
        seen.append(int((batch.src != 0).sum()) - len(batch))  # source tokens without EOS
    drawn_tokens = int(a.src_lengths.sum()) * 2 + int(b.src_lengths[np.unique(mixture.drawn(1, 0)[100:] - 100)].sum())
    assert sum(seen) <= drawn_tokens  # some batches that do not fill an update are left out, as always
    resumed = BatchStream(mixture, cfg, seed=1, epoch=0, batches_done=7)
    straight = BatchStream(mixture, cfg, seed=1)
    for _ in range(7):
        next(straight)
    for _ in range(stream.batches_per_epoch):
        assert batches_equal(next(straight), next(resumed))


def test_the_order_a_resume_compares_changes_with_a_weight_or_a_corpus():
    a, b = corpus(10, 1), corpus(10, 2)
    base = Mixture([Part("a", a, 1.0, "x"), Part("b", b, 1.0, "y")]).train_order
    assert base == Mixture([Part("a", a, 1.0, "x"), Part("b", b, 1.0, "y")]).train_order
    assert base != Mixture([Part("a", a, 1.0, "x"), Part("b", b, 2.0, "y")]).train_order
    assert base != Mixture([Part("a", a, 1.0, "x"), Part("b", b, 1.0, "z")]).train_order


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 0.2), (3.0, 0.5)])
def test_each_corpuss_share_is_its_weighted_part_of_the_epoch(weights):
    a, b = corpus(40, 1), corpus(160, 2)
    shares = Mixture([Part("a", a, weights[0]), Part("b", b, weights[1])]).shares()
    assert [s["name"] for s in shares] == ["a", "b"] and [s["pairs"] for s in shares] == [40, 160]
    total = 40 * weights[0] + 160 * weights[1]
    assert [s["share"] for s in shares] == pytest.approx([40 * weights[0] / total, 160 * weights[1] / total])
    assert sum(s["tgt_share"] for s in shares) == pytest.approx(1.0)
    assert torch.tensor([s["tokens"] for s in shares]).sum() == int(a.src_lengths.sum() + a.tgt_lengths.sum()) + int(
        b.src_lengths.sum() + b.tgt_lengths.sum()
    )
