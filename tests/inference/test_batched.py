"""Sources searched in batches (inference/batched.py): searches side by side on a CPU's threads (decode.workers)
find what one search finds, in input order; a sampling batch stays within max_tokens; threads given back; an error in
a worker reaches the caller; a model in training is searched in eval mode."""

import threading
from dataclasses import replace

import pytest
import torch

from tests.helpers import LINES, sentences
from transformer.data.loader import source_batches
from transformer.inference import batched
from transformer.inference.batched import search_ids, search_workers
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.checkpoint import load_model

# --------------------------------------------------------------------------- searches side by side (decode.workers)

MAX_TOKENS = 64  # several batches for LINES with one worker, more with two


def greedy(**changes) -> SearchSettings:
    return SearchSettings(**{"beam": 1, "lenpen": 0.6, "max_len_offset": 4, "max_tokens": MAX_TOKENS, **changes})


@pytest.fixture
def calls(monkeypatch):
    """Each search() call's thread name, torch thread count and batch size, recorded on the way through."""
    seen: list[tuple[str, int, int]] = []
    real = batched.search

    def recording(model, src, *args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads(), src.size(0)))
        return real(model, src, *args, **kwargs)

    monkeypatch.setattr(batched, "search", recording)
    return seen


@pytest.mark.parametrize("beam, nbest", [(1, 1), (3, 2)])
def test_two_workers_find_what_one_search_finds_in_input_order(run, two_threads, calls, beam, nbest):
    model, vocab, _ = load_model(run)
    src_ids = vocab.encode(LINES + [""])
    settings = SearchSettings(beam=beam, lenpen=0.6, max_len_offset=4, max_tokens=MAX_TOKENS, nbest=nbest, workers=1)
    one = search_ids(model, src_ids, settings, "cpu")
    assert {name for name, _, _ in calls} == {threading.current_thread().name}
    assert {threads for _, threads, _ in calls} == {2}
    calls.clear()
    two = search_ids(model, src_ids, replace(settings, workers=2), "cpu")
    assert all(name.startswith("search") for name, _, _ in calls)  # every batch ran on a worker
    assert {threads for _, threads, _ in calls} == {1}  # each on half of the two threads
    assert len(calls) == len(source_batches(src_ids, model.cfg.max_positions, MAX_TOKENS // 2)) > 2
    assert [[h.tokens for h in hyps] for hyps in two] == [[h.tokens for h in hyps] for hyps in one]
    for hyps_two, hyps_one in zip(two, one):
        assert [h.score for h in hyps_two] == pytest.approx([h.score for h in hyps_one], abs=1e-4)
    assert len({tuple(hyps[0].tokens) for hyps in two}) > 5  # different outputs: a mix-up of order would show


def test_a_batch_of_sources_times_their_samples_stays_within_max_tokens(run, monkeypatch):
    """Sampling searches each source as N rows: a batch's sources x N x its longest (with EOS) is within
    --max-tokens, whatever N (a source alone aside)."""
    model, vocab, _ = load_model(run)
    src_ids = vocab.encode(sentences(4, 40))
    seen = []
    real = batched.sample_search

    def recording(model, src, settings, *args, **kwargs):
        seen.append((src.size(0), src.size(0) * settings.nbest * src.size(1)))
        return real(model, src, settings, *args, **kwargs)

    monkeypatch.setattr(batched, "sample_search", recording)
    for nbest in (1, 4, 16):
        seen.clear()
        settings = SearchSettings(beam=1, sample="topk:5", seed=1, nbest=nbest, max_tokens=160, workers=1)
        found = search_ids(model, src_ids, settings, "cpu")
        assert len(seen) > 1 and all(tokens <= 160 or rows == 1 for rows, tokens in seen)
        assert all(len(hyps) == nbest for hyps in found)
    assert max(rows for rows, _ in seen) > 1  # a test of several sources a batch even at 16 samples


def test_thread_count_is_given_back_to_the_caller_and_to_later_threads(run, two_threads):
    model, vocab, _ = load_model(run)
    search_ids(model, vocab.encode(LINES), greedy(workers=2), "cpu")
    assert torch.get_num_threads() == 2
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [2]  # a worker's set_num_threads(1) would otherwise be every new thread's start


def test_one_batch_is_searched_in_the_calling_thread_on_all_threads(run, two_threads, calls):
    model, vocab, _ = load_model(run)
    search_ids(model, vocab.encode(LINES[:2]), greedy(workers=2, max_tokens=256), "cpu")  # one batch of 128 tokens
    assert calls == [(threading.current_thread().name, 2, 2)]


def test_an_error_in_a_worker_reaches_the_caller(run, two_threads, monkeypatch):
    model, vocab, _ = load_model(run)
    real, searched = batched.search, []

    def failing(model, src, *args, **kwargs):
        searched.append(src.size(0))
        if len(searched) == 2:
            raise RuntimeError("out of memory in a worker")
        return real(model, src, *args, **kwargs)

    monkeypatch.setattr(batched, "search", failing)
    with pytest.raises(RuntimeError, match="out of memory in a worker"):
        search_ids(model, vocab.encode(LINES), greedy(workers=2), "cpu")
    assert torch.get_num_threads() == 2


def test_a_model_in_training_is_searched_in_eval_mode_and_handed_back_in_training(run, two_threads, monkeypatch):
    """The trainer's validation BLEU: the mode is set before any worker starts, not by each search (the first to
    finish would switch dropout back on under the others, and the last would leave training without it)."""
    model, vocab, _ = load_model(run)
    src_ids = vocab.encode(LINES)
    expected = search_ids(model, src_ids, greedy(workers=1), "cpu")
    model.train()
    real, modes = batched.search, []

    def recording(model, src, *args, **kwargs):
        modes.append(model.training)
        return real(model, src, *args, **kwargs)

    monkeypatch.setattr(batched, "search", recording)
    found = search_ids(model, src_ids, greedy(workers=2), "cpu")
    assert len(modes) > 2 and not any(modes)
    assert model.training
    assert [hyps[0].tokens for hyps in found] == [hyps[0].tokens for hyps in expected]


def test_workers_are_capped_by_threads_and_one_off_the_cpu(two_threads):
    assert search_workers(4, "cpu") == 2
    assert search_workers(2, "cpu") == 2
    assert search_workers(2, "cuda") == 1  # only the device type is read: no GPU needed
    torch.set_num_threads(1)
    assert search_workers(2, "cpu") == 1


def test_translator_takes_workers_from_the_checkpoint_or_the_caller(run, two_threads, calls):
    assert Translator(run, "cpu").settings.workers == 2  # decode.workers' default
    translator = Translator(run, "cpu", SearchFlags(beam=1, max_tokens=MAX_TOKENS, workers=1))
    assert translator.settings.workers == 1
    translator.translate(LINES)
    assert {name for name, _, _ in calls} == {threading.current_thread().name}
