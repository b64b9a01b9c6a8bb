"""What incremental decoding keeps (model/kv_cache.py): decoding step by step with a cache gives the full pass's
outputs; rows are dropped, reordered and grown into beams in place, and a sentence's encoder K/V stay once per
source."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import SMALL_VOCAB, positions_model, random_pairs, small_model
from transformer.config import POSITION_KINDS
from transformer.data.batch import Batch, causal_mask, prepare_sources
from transformer.data.vocab import PAD_ID
from transformer.inference.search import search
from transformer.inference.settings import SearchSettings
from transformer.model.kv_cache import KVCache

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_cached_decoding_matches_full(norm):
    model = small_model(norm=norm)
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 6), (3, 2), (8, 4)], seed=5, vocab=SMALL_VOCAB))
    memory = model.encode(batch.src, batch.src_mask)
    full = model.decode(batch.tgt_in, memory, batch.src_mask, batch.tgt_mask)
    cache = model.new_cache(memory, batch.src_mask)
    # Cross-attention K/V exist before the first step: the cache, not a memory argument, feeds them.
    assert cache.cross_attn[0].k.shape == (3, 2, batch.src.size(1), 16)
    steps = []
    for t in range(batch.tgt_in.size(1)):
        steps.append(model.decode(batch.tgt_in[:, t : t + 1], cache=cache))
        assert cache.length == t + 1
    incremental = torch.cat(steps, dim=1)
    real = batch.tgt_in != PAD_ID  # right padding: real positions never see a pad key in either path
    torch.testing.assert_close(incremental[real], full[real], **TOL)
    assert cache.self_attn[0].k.shape == (3, 2, batch.tgt_in.size(1), 16)  # grew one step at a time


def test_decode_with_a_cache_takes_no_memory():
    model = small_model()
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 3), (4, 3)], vocab=SMALL_VOCAB))
    memory = model.encode(batch.src, batch.src_mask)
    cache = model.new_cache(memory, batch.src_mask)
    with pytest.raises(ValueError, match="takes no memory"):
        model.decode(batch.tgt_in[:, :1], memory, batch.src_mask, None, cache)


def test_cache_keep_rows_selects_rows():
    """Dropping and reordering sentences moves self- and cross-attention K/V and the memory mask together."""
    model = small_model()
    # Different source lengths: the rows' masks differ.
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 3), (2, 3), (6, 3)], seed=6, vocab=SMALL_VOCAB))
    memory = model.encode(batch.src, batch.src_mask)
    cache = model.new_cache(memory, batch.src_mask)
    model.decode(batch.tgt_in[:, :2], None, None, causal_mask(2), cache)
    index = torch.tensor([2, 1])
    cache.keep_rows(index, sources=index)
    assert torch.equal(cache.memory_mask, batch.src_mask[index])
    step = model.decode(batch.tgt_in[index, 2:3], cache=cache)
    full = model.decode(batch.tgt_in[index, :3], memory[index], batch.src_mask[index], causal_mask(3))
    torch.testing.assert_close(step[:, 0], full[:, 2], **TOL)


def test_cache_groups_of_rows_share_their_source():
    """Beams of one sentence read its encoder K/V, held once per source: growing a sentence to several rows,
    reordering rows within sentences and dropping a sentence give what a copy of the memory per row gives."""
    model = small_model()
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 4), (2, 4), (6, 4)], seed=7, vocab=SMALL_VOCAB))
    memory = model.encode(batch.src, batch.src_mask)
    cache = model.new_cache(memory, batch.src_mask)
    model.decode(batch.tgt_in[:, :1], cache=cache)  # one row per source
    rows = torch.tensor([0, 0, 1, 1, 2, 2])  # each sentence grows to two rows (its source, by row)
    cache.keep_rows(rows)
    cross_k, mask = cache.cross_attn[0].k, cache.memory_mask
    tgt = batch.tgt_in[rows].clone()
    tgt[:, 1] = torch.randint(4, SMALL_VOCAB, (6,))  # the two rows of a sentence differ from here on
    model.decode(tgt[:, 1:2], cache=cache)
    assert cache.cross_attn[0].k is cross_k and cache.memory_mask is mask  # per source: never copied per row
    within = torch.tensor([1, 0, 2, 3, 5, 4])  # beams swap inside their sentences
    cache.keep_rows(within)
    tgt, rows = tgt[within], rows[within]
    step = model.decode(tgt[:, 2:3], cache=cache)
    full = model.decode(tgt[:, :3], memory[rows], batch.src_mask[rows], causal_mask(3))
    torch.testing.assert_close(step[:, 0], full[:, 2], **TOL)
    keep = torch.tensor([0, 1, 4, 5])  # sentence 1 is done: its rows and its source leave
    cache.keep_rows(keep, sources=torch.tensor([0, 2]))
    tgt, rows = tgt[keep], rows[keep]
    step = model.decode(tgt[:, 3:4], cache=cache)
    full = model.decode(tgt[:, :4], memory[rows], batch.src_mask[rows], causal_mask(4))
    torch.testing.assert_close(step[:, 0], full[:, 3], **TOL)


def test_kv_cache_reorders_rows_in_place_as_a_gather_would():
    """Rows reordered, duplicated and dropped inside the buffers (only the rows that change are copied) hold what
    index_select of the rows before would; rows beyond the buffers' take new ones; positions still grow."""
    torch.manual_seed(0)
    kv = KVCache()
    kv.append(torch.randn(6, 2, 3, 4), torch.randn(6, 2, 3, 4))
    buffer = kv._buffers[0]
    for index in ([5, 0, 0, 3, 1], [0, 1, 2, 3, 4], [4, 3, 2, 1], [1, 1, 0]):  # within the 6 rows held
        k, v, index = kv.k.clone(), kv.v.clone(), torch.tensor(index)
        kv.keep_rows(index)
        assert torch.equal(kv.k, k[index]) and torch.equal(kv.v, v[index]) and kv._buffers[0] is buffer
    new_k, new_v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    k, v = kv.k.clone(), kv.v.clone()
    kv.append(new_k, new_v)
    assert torch.equal(kv.k, torch.cat([k, new_k], dim=2)) and torch.equal(kv.v, torch.cat([v, new_v], dim=2))
    k, index = kv.k.clone(), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])  # more rows than the buffers hold
    kv.keep_rows(index)
    assert torch.equal(kv.k, k[index]) and kv._buffers[0] is not buffer


def test_cache_refuses_rows_that_do_not_group_by_source():
    model = small_model()
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 3), (2, 3)], seed=8, vocab=SMALL_VOCAB))
    cache = model.new_cache(model.encode(batch.src, batch.src_mask), batch.src_mask)
    cache.keep_rows(torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="do not split into groups"):
        model.decode(batch.tgt_in[[0, 0, 1], :1], cache=cache)


@pytest.mark.parametrize("kind", POSITION_KINDS)
def test_cached_decoding_equals_uncached_for_every_kind(kind):
    """The decoding offset reaches each kind: a step at position t adds row t (or turns by angle t), and rotary's
    keys are turned once as the cache keeps them."""
    model = positions_model(kind)
    src, _ = prepare_sources([[5, 9, 13, 7], [21, 4, 8], [33, 6, 11, 12, 30, 31]], 40)
    with torch.no_grad():
        for beam in (1, 3):
            cached = search(model, src, SearchSettings(beam=beam, max_len_offset=6), use_cache=True).best()
            full = search(model, src, SearchSettings(beam=beam, max_len_offset=6), use_cache=False).best()
            assert [h.tokens for h in cached] == [h.tokens for h in full], (kind, beam)
            for a, b in zip(cached, full):
                assert a.score == pytest.approx(b.score, abs=1e-4)
