"""Sources searched in length batches: which search a batch gets (run_search: sampling, constrained, beam or greedy)
and what each sentence asks of it beyond the settings (SentenceOptions), the batches searched side by side on a CPU's
threads (search_batches), and each source's n-best in input order (search_ids)."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from transformer.data.batch import prepare_sources
from transformer.data.loader import source_batches
from transformer.inference.constraints import constrained_search
from transformer.inference.sampling import sample_search
from transformer.inference.search import Hypothesis, SearchResult, device_index, search
from transformer.inference.settings import SearchSettings
from transformer.model.transformer import evaluating


def search_workers(workers: int, device) -> int:
    """How many searches run side by side (decode.workers): on a CPU at most one per torch thread; on CUDA one,
    since the GPU runs one search's kernels at a time anyway."""
    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(workers, torch.get_num_threads()))


def threads_per_worker(workers: int) -> int:
    """torch's CPU threads shared out between `workers` searches side by side (ours, or CTranslate2's)."""
    return max(1, torch.get_num_threads() // workers)


@contextlib.contextmanager
def worker_threads(workers: int) -> Iterator[ThreadPoolExecutor]:
    """`workers` threads that share torch's CPU threads between them (each runs its operations on
    threads // workers), and torch's count back for the caller and later threads afterwards."""
    threads = torch.get_num_threads()
    # torch.set_num_threads in a worker sets its own thread's count, and also the count threads started later
    # begin with: hence the reset below.
    pool = ThreadPoolExecutor(
        workers, thread_name_prefix="search", initializer=torch.set_num_threads, initargs=(threads_per_worker(workers),)
    )
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on an error: finish the running batches, start no more
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class SentenceOptions:
    """What one sentence asks of the search beyond the settings: target ids its outputs must start with (search.py's
    forced prefix), target phrases (ids) each of its outputs must contain (constraints.py), and with sampling a
    seed of its own (serve's requests: one search may hold several; None: settings.seed)."""

    prefix: tuple[int, ...] = ()
    constraints: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None


def run_search(
    model, src: torch.Tensor, settings: SearchSettings, options: Sequence[SentenceOptions] | None = None
) -> SearchResult:
    """One batch of sources (B, S) through the search its settings and options call for: sampling
    (settings.sample), else beam or greedy search with the prefixes, and with constraints.py's search for the
    sentences that have constraints. Without options, exactly search(). A sentence whose constraints could not
    all be met gets the unconstrained search's outputs, and its row in SearchResult.unmet."""
    prefixes = None if options is None or not any(o.prefix for o in options) else [o.prefix for o in options]
    if settings.sample is not None:
        return sample_search(model, src, settings, prefixes, None if options is None else [o.seed for o in options])

    def plain(rows: list[int] | None) -> SearchResult:
        """search() over every row (None), or over `rows`."""
        part = src if rows is None else src.index_select(0, device_index(rows, src.device))
        forced = prefixes if rows is None or prefixes is None else [prefixes[r] for r in rows]
        return search(model, part, settings, prefixes=forced)

    constrained = [] if options is None else [r for r, o in enumerate(options) if o.constraints]
    if not constrained:
        return plain(None)
    hypotheses: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]
    sentence_steps, steps = [0] * src.size(0), 0
    free = sorted(set(range(src.size(0))) - set(constrained))
    found = constrained_search(
        model,
        src.index_select(0, device_index(constrained, src.device)),
        [options[r].constraints for r in constrained],
        settings,
        None if prefixes is None else [prefixes[r] for r in constrained],
    )
    unmet = [r for r, hyps in zip(constrained, found.hypotheses) if not hyps]
    parts = [(constrained, found)]
    for rows in (free, unmet):
        if rows:
            parts.append((rows, plain(rows)))
    for rows, part in parts:
        steps += part.steps
        for r, hyps, n in zip(rows, part.hypotheses, part.sentence_steps):
            if hyps:
                # The limit can end a sentence with fewer than nbest constrained hypotheses finished: the n-best
                # list keeps its length with empty ones of score -inf (never an unconstrained one among them).
                hypotheses[r] = hyps + [Hypothesis([], float("-inf")) for _ in range(settings.nbest - len(hyps))]
            sentence_steps[r] += n
    return SearchResult(hypotheses, steps, sentence_steps, unmet)


def search_batches(
    model,
    src_ids: Sequence[Sequence[int]],
    settings: SearchSettings,
    device,
    options: Sequence[SentenceOptions] | None = None,
) -> Iterator[tuple[list[int], SearchResult]]:
    """search() over the non-empty sources (subword ids, no EOS) in length batches of settings.max_tokens: per
    batch, in order, the indices of its sources and what search() found for them (hypotheses in that order, and
    the decoder steps it took). Sources are cut as batch.prepare_sources says. The model is searched as it is:
    settings.dtype and settings.engine are the Translator's business.

    With settings.workers > 1 on a CPU (search_workers), that many searches run side by side, each on its own
    batches (source_batches). Input that fits one batch is searched in the calling thread on all threads:
    one sentence is not slower for it. `options`: per source, what it asks beyond the settings (run_search)."""
    workers = search_workers(settings.workers, device)
    batches = source_batches(src_ids, model.cfg.max_positions, settings.max_tokens, workers, settings.rows_per_source)

    def run(batch: list[int]) -> SearchResult:
        src, _ = prepare_sources([src_ids[i] for i in batch], model.cfg.max_positions, model.specials)  # (B, S)
        return run_search(model, src.to(device), settings, None if options is None else [options[i] for i in batch])

    if workers == 1 or len(batches) == 1:
        for batch in batches:
            yield batch, run(batch)
        return
    # Eval mode set once for all workers: each search() also sets it and puts back what it found, and side by
    # side the first to finish would switch dropout back on under the others (the trainer's validation BLEU).
    with evaluating(model, inference=False), worker_threads(workers) as pool:
        yield from zip(batches, pool.map(run, batches))


def search_ids(
    model,
    src_ids: Sequence[Sequence[int]],
    settings: SearchSettings,
    device,
    options: Sequence[SentenceOptions] | None = None,
    unmet: list[int] | None = None,
) -> list[list[Hypothesis]]:
    """Per source (subword ids, no EOS), its settings.nbest best hypotheses, input order kept. An empty source
    gives nbest empty hypotheses without running the model. Batches and workers: as for search_batches.
    `unmet`, when given, receives the indices of the sources whose constraints could not all be met (their
    outputs are unconstrained)."""
    nbest = settings.nbest
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0) for _ in range(nbest)] for _ in src_ids]
    for batch, found in search_batches(model, src_ids, settings, device, options):
        if unmet is not None:
            unmet.extend(batch[row] for row in found.unmet)
        for i, hyps in zip(batch, found.hypotheses):
            if not hyps or math.isnan(hyps[0].score):
                # One sentence out of a batch (of serve's clients, of a file's lines) must not fail the rest:
                # it gets an empty translation with score -inf, and a warning.
                print(
                    "warning: the model's scores for a sentence are not numbers (NaN), so its translation is "
                    "empty: a reduced precision that overflowed (try --dtype fp32)?",
                    file=sys.stderr,
                )
                hyps = [Hypothesis([], float("-inf")) for _ in range(nbest)]
            out[i] = hyps
    return out
