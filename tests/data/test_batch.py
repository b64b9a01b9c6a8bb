"""Batch tensors (padding, the teacher-forcing shift, counts), every mask, and source preparation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import batches_equal, random_pairs
from transformer.config import from_dict, round_up
from transformer.data.batch import (
    CAUSAL,
    Batch,
    attention_bias,
    causal_mask,
    pad_sequences,
    padding_mask,
    prepare_sources,
    source_limit,
    target_mask,
)
from transformer.data.store import Corpus
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID
from transformer.errors import UserError


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
        assert torch.all(b.src[row, len(s) + 1 :] == PAD_ID)
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
    src_mask, tgt_mask = b.src_mask, target_mask(b.tgt_in)
    assert b.tgt_mask is CAUSAL  # what training passes: right-padded targets need no key-padding mask (test_model)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1, 5, 8, 13])
def test_attention_bias_is_the_boolean_mask_additive_in_the_dtype_with_rows_aligned_to_8(dtype, length):
    tokens = torch.tensor([[4] * length, [4] * (length - 1) + [PAD_ID]])
    for mask in (padding_mask(tokens), target_mask(tokens), causal_mask(length)):
        bias = attention_bias(mask, dtype)
        assert bias.dtype == dtype and bias.shape == mask.shape
        assert torch.equal(bias == 0, mask) and torch.equal(bias == float("-inf"), ~mask)
        # every stride but the last a multiple of 8 elements: CUDA's memory-efficient kernel takes it uncopied
        assert bias.stride(-1) == 1 and all(stride % 8 == 0 for stride in bias.stride()[:-1])
        assert attention_bias(bias, dtype) is bias  # already additive: as it is


def test_pad_sequences():
    out = pad_sequences([[4, 5], [6]], pad_to_multiple=4)
    assert out.dtype == torch.long and out.tolist() == [[4, 5, 0, 0], [6, 0, 0, 0]]


def test_batch_to_keeps_counts():
    b = Batch.from_pairs([([5, 6], [7])]).to("cpu")
    assert b.n_src_tokens == 3 and b.n_tgt_tokens == 2


def test_batch_from_corpus_equals_batch_from_pairs():
    pairs = random_pairs(40, max_len=25)
    for dtype in (np.uint16, np.int32):
        corpus = Corpus.from_pairs(pairs, dtype=dtype)
        for indices, multiple in (([3, 1, 4, 1, 5], 1), ([0], 8), (list(range(40)), 3)):
            a = Batch.from_corpus(corpus, np.array(indices), multiple)
            b = Batch.from_pairs([pairs[i] for i in indices], multiple)
            assert batches_equal(a, b) and a.src.dtype == b.src.dtype == torch.long
            assert (a.n_src_tokens, a.n_tgt_tokens) == (b.n_src_tokens, b.n_tgt_tokens)


def test_round_up():
    assert [round_up(n, 8) for n in (0, 1, 8, 9)] == [0, 8, 8, 16]
    assert round_up(np.array([1, 4, 5]), 4).tolist() == [4, 4, 8]
    assert round_up(7, 1) == 7


def test_prepare_sources_cuts_to_the_limit_training_enforces_appends_eos_and_pads():
    limit = source_limit(max_positions=8)
    src, truncated = prepare_sources([[5] * 9, [6, 7], [8] * limit], max_positions=8)
    assert truncated == [True, False, False]
    assert src.tolist() == [[5] * limit + [EOS_ID], [6, 7, EOS_ID] + [PAD_ID] * (limit - 2), [8] * limit + [EOS_ID]]
    # The limit is the longest source a model of max_positions 8 can have been trained on.
    from_dict({"model": {"max_positions": 8}, "data": {"max_len": limit}})
    with pytest.raises(UserError, match="max_len"):
        from_dict({"model": {"max_positions": 8}, "data": {"max_len": limit + 1}})
