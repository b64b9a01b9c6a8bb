"""Sampling (sampling.py): top-k 1 is greedy search, a seeded run repeats itself and does not depend on its batch
mates, and on a toy model the first token's sampled frequencies match the distribution it is drawn from."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import sampling_settings
from tests.inference.test_search import CFG, VOCAB, as_batch, make_sources, peaky_model
from transformer.data.batch import padding_mask
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID
from transformer.inference.batched import SentenceOptions, search_ids
from transformer.inference.sampling import Sampler, draw, sample_search, uniforms
from transformer.inference.search import search
from transformer.inference.settings import MAX_SAMPLES, SearchSettings
from transformer.model.transformer import Transformer

SAMPLES = 4000  # draws for the frequency test


@pytest.fixture(scope="module")
def flat():
    """Random weights as initialised: a first-token distribution spread over many tokens."""
    torch.manual_seed(7)
    return Transformer(CFG, VOCAB).eval()


@pytest.fixture(scope="module")
def peaky():
    return peaky_model()


def first_token_probs(model, source: list[int]) -> np.ndarray:
    """The model's distribution of the first output token, computed here from decode() (PAD and BOS never)."""
    src = torch.tensor([source])
    with torch.no_grad():
        memory = model.encode(src, padding_mask(src))
        logits = model.decode(torch.tensor([[BOS_ID]]), memory, padding_mask(src))[0, -1]
    lprobs = F.log_softmax(logits.double(), dim=-1)
    lprobs[[PAD_ID, BOS_ID]] = float("-inf")
    return lprobs.exp().numpy()


def expected(p: np.ndarray, sampler: Sampler) -> np.ndarray:
    """What sampler draws from, written plainly: p^(1/T) renormalised, then its top K, or its nucleus P."""
    q = p ** (1 / sampler.temperature)
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    keep = np.zeros_like(q, dtype=bool)
    if sampler.kind == "topk":
        keep[order[: int(sampler.value)]] = True
    else:
        before = np.cumsum(q[order]) - q[order]
        keep[order[before < sampler.value]] = True
    q = np.where(keep, q, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    "sampler",
    [
        Sampler("topk", VOCAB, 1.0, seed=1),  # the whole distribution
        Sampler("topk", VOCAB, 0.5, seed=2),
        Sampler("topk", 4, 1.0, seed=3),
        Sampler("topp", 0.8, 1.5, seed=4),
    ],
    ids=["all", "t0.5", "top4", "p0.8-t1.5"],
)
def test_first_token_frequencies_match_the_distribution_drawn_from(flat, sampler):
    """SAMPLES draws of one source's first token: each token's frequency within 5 standard deviations of the
    probability it should have (plus one count), and none outside the top K or the nucleus. Fixed seeds: the
    counts are the same every run, so the test cannot flake, and a sampler off by a token, a temperature or a
    cut fails it by far more."""
    source = [5, 9, 13, EOS_ID]
    q = expected(first_token_probs(flat, source), sampler)
    assert (q > 0.01).sum() >= 3  # a distribution worth testing
    # MAX_SAMPLES samples per row at most: the source in as many rows as that takes, each with a seed of its own.
    rows = SAMPLES // MAX_SAMPLES
    settings = sampling_settings(sampler, max_len_offset=1, nbest=MAX_SAMPLES)
    seeds = [sampler.seed * 10_000 + row for row in range(rows)]
    found = sample_search(flat, torch.tensor([source] * rows), settings, seeds=seeds)
    first = [h.tokens[0] if h.tokens else EOS_ID for hyps in found.hypotheses for h in hyps]
    freq = np.bincount(first, minlength=VOCAB) / SAMPLES
    bound = 5 * np.sqrt(q * (1 - q) / SAMPLES) + 1 / SAMPLES
    assert np.all(np.abs(freq - q) <= bound), np.abs(freq - q) / np.maximum(bound, 1e-12)
    assert np.all(freq[q == 0] == 0)
    plain = first_token_probs(flat, source)  # and the test can tell a wrong distribution apart
    if sampler.temperature != 1 or sampler.value != VOCAB:
        assert np.any(np.abs(freq - plain) > 5 * np.sqrt(plain * (1 - plain) / SAMPLES) + 1 / SAMPLES)


@pytest.mark.parametrize("temperature", [1.0, 0.3, 3.0])
def test_top_k_1_is_greedy_search(peaky, flat, temperature):
    """The same tokens and scores, bit for bit, with or without a forced prefix; at any temperature."""
    for model in (peaky, flat):
        sources = make_sources(11)
        src = as_batch(sources)
        greedy = search(model, src, SearchSettings(beam=1, lenpen=0.6, max_len_offset=10))
        sampled = sample_search(
            model,
            src,
            sampling_settings(Sampler("topk", 1, temperature, seed=5), lenpen=0.6, max_len_offset=10, nbest=1),
        )
        assert [h.tokens for h in sampled.best()] == [h.tokens for h in greedy.best()]
        assert [h.score for h in sampled.best()] == [h.score for h in greedy.best()]
        prefixes = [s[:2] for s in sources]
        greedy = search(model, src, SearchSettings(beam=1, lenpen=0.6, max_len_offset=10), prefixes=prefixes)
        sampled = sample_search(
            model,
            src,
            sampling_settings(Sampler("topk", 1, temperature), lenpen=0.6, max_len_offset=10, nbest=1),
            prefixes=prefixes,
        )
        assert [h.tokens for h in sampled.best()] == [h.tokens for h in greedy.best()]


def test_a_seeded_run_repeats_itself_and_another_seed_draws_other_samples(flat):
    src = as_batch(make_sources(11))
    runs = [
        sample_search(
            flat, src, sampling_settings(Sampler("topp", 0.95, 1.0, seed), lenpen=0.6, max_len_offset=8, nbest=3)
        )
        for seed in (4, 4, 5)
    ]
    tokens = [[[h.tokens for h in hyps] for hyps in run.hypotheses] for run in runs]
    assert tokens[0] == tokens[1]
    assert [[h.score for h in hyps] for hyps in runs[0].hypotheses] == [
        [h.score for h in hyps] for hyps in runs[1].hypotheses
    ]
    assert tokens[0] != tokens[2]
    for hyps in runs[0].hypotheses:  # a source's samples, best first
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_a_sentences_samples_do_not_depend_on_its_batch_mates(flat):
    """The same sentence alone, among others, in another order, in batches of another size and with
    searches side by side: the same samples (fp32; the scores agree to float rounding)."""
    sources = [s[:-1] for s in make_sources(21, n=9)]
    settings = SearchSettings(beam=1, sample="topk:8", temperature=1.2, seed=9, nbest=2, max_len_offset=6, workers=1)

    def samples(ids, **changes):
        from dataclasses import replace

        return [[h.tokens for h in hyps] for hyps in search_ids(flat, ids, replace(settings, **changes), "cpu")]

    together = samples(sources)
    assert samples([sources[4]]) == [together[4]]
    assert samples(sources[::-1]) == together[::-1]
    assert samples(sources, max_tokens=12) == together  # several batches
    assert samples(sources, max_tokens=12, workers=2) == together  # side by side
    assert samples([sources[2], sources[2]]) == [together[2], together[2]]  # the same line, the same samples


def test_a_prefix_is_kept_and_only_what_follows_is_drawn(flat):
    sources = make_sources(13, n=5)
    prefixes = [[7, 8], [], [9], [10, 11, 12], [4]]
    found = sample_search(
        flat,
        as_batch(sources),
        sampling_settings(Sampler("topk", 10, seed=2), lenpen=0.6, max_len_offset=6, nbest=3),
        prefixes=prefixes,
    )
    for hyps, prefix in zip(found.hypotheses, prefixes):
        assert all(h.tokens[: len(prefix)] == prefix for h in hyps)
    settings = SearchSettings(beam=1, sample="topk:10", seed=2, nbest=3, max_len_offset=6)
    options = [SentenceOptions(tuple(p)) for p in prefixes]
    via_translator = search_ids(flat, [s[:-1] for s in sources], settings, "cpu", options)
    assert [[h.tokens for h in hyps] for hyps in via_translator] == [
        [h.tokens for h in hyps] for hyps in found.hypotheses
    ]


def test_the_random_numbers_and_the_draw():
    keys = Sampler("topk", 1, seed=3).keys([[5, 6, EOS_ID], [5, 6, EOS_ID], [7, EOS_ID]], 2)
    assert keys[0] == keys[2] and len({keys[0], keys[1], keys[4], keys[5]}) == 4  # by (source, sample) alone
    u = np.concatenate([uniforms(keys, step) for step in range(2000)])
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and len(np.unique(u)) == 4 * 2000
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.8, 0.0]])
    assert draw(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 0]
    assert draw(probs, torch.tensor([0.49, 0.99])).tolist() == [1, 2]
    assert draw(probs, torch.tensor([0.5, 0.2])).tolist() == [3, 2]
    assert draw(probs, torch.tensor([math.nextafter(1.0, 0.0)] * 2, dtype=torch.float64)).tolist() == [3, 2]


@pytest.mark.parametrize(
    "sampler",
    [
        Sampler("topk", 8, 1e-39, seed=1),  # log p / T overflowed to -inf: every row NaN
        Sampler("topk", VOCAB, 1e-300, seed=2),  # below float32's smallest: 0 there
        Sampler("topp", 1e-46, 1.0, seed=3),  # 0 in float32: the nucleus was empty
        Sampler("topp", 0.9, 1e-45, seed=4),
    ],
    ids=["t1e-39", "t1e-300", "p1e-46", "p0.9-t1e-45"],
)
def test_a_tiny_temperature_or_nucleus_samples_as_its_limit_greedy_search(peaky, flat, sampler):
    """T -> 0 and P -> 0 leave the most probable token alone: greedy search's tokens and scores (fp32, no ties
    in these models), never a NaN distribution that never draws the forced EOS and runs past max_positions."""
    for model in (peaky, flat):
        src = as_batch(make_sources(11))
        greedy = search(model, src, SearchSettings(beam=1, lenpen=0.6, max_len_offset=100))
        sampled = sample_search(model, src, sampling_settings(sampler, lenpen=0.6, max_len_offset=100, nbest=2))
        for hyps, best in zip(sampled.hypotheses, greedy.best()):
            assert [(h.tokens, h.score) for h in hyps] == [(best.tokens, best.score)] * 2
        probs = sampler.distribution(torch.log_softmax(torch.randn(5, VOCAB, dtype=torch.float64) * 3, 1).float())
        assert torch.isfinite(probs).all() and probs.max(dim=1).values.eq(1).all()


def test_top_k_1_takes_greedy_searchs_token_among_exact_ties(peaky):
    """Two tokens with the same output row tie at every step (as bf16's few bits make ties common): top-k 1 is
    greedy search itself, which takes the first, whatever the seed; drawing among the ties took either."""
    model = copy.deepcopy(peaky)
    src = as_batch(make_sources(11))
    firsts = [h.tokens[0] for h in search(model, src, SearchSettings(beam=1, lenpen=0.6, max_len_offset=10)).best()]
    with torch.no_grad():
        twins = iter(t for t in range(4, VOCAB) if t not in firsts)
        for token in set(firsts):  # each token a sentence starts with gets a twin with the same logit
            twin = next(twins)
            model.output.weight[twin] = model.output.weight[token]
            if model.output.bias is not None:
                model.output.bias[twin] = model.output.bias[token]
    greedy = search(model, src, SearchSettings(beam=1, lenpen=0.6, max_len_offset=10)).best()
    for seed in range(8):
        sampled = sample_search(
            model, src, sampling_settings(Sampler("topk", 1, 1.0, seed), lenpen=0.6, max_len_offset=10, nbest=2)
        )
        assert [[h.tokens for h in hyps] for hyps in sampled.hypotheses] == [[h.tokens] * 2 for h in greedy]
