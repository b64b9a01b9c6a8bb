"""Text in, text out: a Translator that loads a checkpoint (or an ensemble of several) once and runs it on a
device, in a dtype (fp32/bf16/int8), through an engine (ours or CTranslate2), with the SearchSettings its flags
and the checkpoint make (settings.py); batching by length; which search a batch gets (beam or greedy, sampling,
constraints) and what each sentence asks of it (SentenceOptions: a forced prefix, constraints); word alignments
with the outputs (the command's own input and output: translate_io.py)."""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from transformer.data.batch import prepare_sources, source_limit
from transformer.data.batching import pack_by_size
from transformer.data.vocab import AnyVocab
from transformer.device import auto_precision, bounded_onednn_caches, native_bf16, pick_device
from transformer.errors import UserError
from transformer.inference.alignment import default_layer, pharaoh, piece_alignments, word_alignments
from transformer.inference.constraints import constrained_search
from transformer.inference.ensemble import Ensemble, check_vocabularies
from transformer.inference.sampling import Sampler, sample_search
from transformer.inference.search import (
    Hypothesis,
    SearchResult,
    device_index,
    length_penalty,
    max_output_lengths,
    search,
)
from transformer.inference.settings import SearchFlags, SearchSettings, parse_sample, search_settings
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from transformer.model.transformer import count_parameters, evaluating

TRUNCATION_WARNINGS = 5  # lines named one by one before the rest are only counted
# A line is cut to this many characters before SentencePiece splits it: splitting costs about 60 bytes of memory per
# character (a 20 MB line peaked at 1.2 GB), while the model reads only max_positions - 2 subwords of a line, a few
# thousand characters. A warning names each line cut; a stream goes on (one line must not stop it).
MAX_LINE_CHARS = 1 << 20
CT2_COMPUTE_TYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}


def pick_dtype(name: str, device: torch.device, engine: str = "ours") -> tuple[str, str]:
    """-> (fp32|bf16|int8, why). "auto" takes the fastest that keeps BLEU: bf16 on a CUDA device that supports
    it and on a CPU with native bf16, else fp32 (int8 is never chosen for you: it changes more outputs). For
    CTranslate2, bf16 only where CTranslate2 itself computes it on the device (its CPU builds do not). `name` is
    one of settings.DTYPES (SearchFlags checked it)."""
    if name != "auto":
        return name, "asked for"
    if engine == "ctranslate2":
        from transformer.inference.ctranslate2_engine import require_ctranslate2

        if CT2_COMPUTE_TYPES["bf16"] in require_ctranslate2().get_supported_compute_types(device.type):
            return "bf16", f"auto: CTranslate2 computes bf16 on this {device.type}"
        return "fp32", f"auto: CTranslate2 has no bf16 on this {device.type}"
    return auto_precision(device)


def length_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that batch size x longest (length + EOS) <= max_tokens; longest first, so
    an out-of-memory error shows on the first batch rather than the last."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return pack_by_size(order, [n + 1 for n in lengths], max_tokens)


def source_batches(
    src_ids: Sequence[Sequence[int]], max_positions: int, max_tokens: int, workers: int = 1
) -> list[list[int]]:
    """Indices of the non-empty sources (empty ones are never searched) in length batches, as both engines
    take them: of max_tokens / workers source tokens each, so that with `workers` searches side by side the
    tokens in flight stay max_tokens."""
    todo = [i for i, ids in enumerate(src_ids) if len(ids) > 0]
    lengths = [min(len(src_ids[i]), source_limit(max_positions)) for i in todo]
    return [[todo[j] for j in batch] for batch in length_batches(lengths, max(1, max_tokens // workers))]


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
        kind, value = parse_sample(settings.sample)
        sampler = Sampler(kind, value, settings.temperature, settings.seed or 0)
        seeds = None if options is None else [o.seed for o in options]
        d = settings
        return sample_search(model, src, sampler, d.nbest, d.lenpen, d.max_len_offset, prefixes, seeds, d.lenpen_kind)

    def plain(rows: list[int] | None) -> SearchResult:
        """search() over every row (None), or over `rows`."""
        part = src if rows is None else src.index_select(0, device_index(rows, src.device))
        forced = prefixes if rows is None or prefixes is None else [prefixes[r] for r in rows]
        d = settings
        return search(
            model, part, d.beam, d.lenpen, d.max_len_offset, d.nbest, d.stop, prefixes=forced, lenpen_kind=d.lenpen_kind
        )

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
        settings.beam,
        settings.lenpen,
        settings.max_len_offset,
        settings.nbest,
        settings.stop,
        None if prefixes is None else [prefixes[r] for r in constrained],
        settings.lenpen_kind,
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
    batches = source_batches(src_ids, model.cfg.max_positions, settings.max_tokens, workers)

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


def translate_ids(model, src_ids: list[list[int]], settings: SearchSettings, device) -> list[list[int]]:
    """Best output ids (no BOS/EOS) per source, in input order (settings.nbest aside: one is kept): the
    trainer's validation-BLEU entry point."""
    return [hyps[0].tokens for hyps in search_ids(model, src_ids, replace(settings, nbest=1), device)]


def ctranslate2_search(
    translator,
    vocab: AnyVocab,
    src_ids: Sequence[Sequence[int]],
    settings: SearchSettings,
    max_positions: int,
    options: Sequence[SentenceOptions] | None = None,
    scores: bool = True,
) -> list[list[Hypothesis]]:
    """search_ids through a ctranslate2.Translator of the same model: the same batches, sources, length
    limits and score definition; like ours, it never emits BOS or PAD (suppressed). settings.stop, .dtype and
    .workers do not apply here (the translator was made with its compute type and inter_threads).

    Length limits (one per call in CTranslate2): each sentence is searched under the limit of its bucket
    (limit_bucket: its own limit rounded up to a power of two), so that a batch goes as one or two calls
    rather than one per distinct limit; a sentence one of whose returned hypotheses comes within a token of
    its own limit is searched again under its own limit (ctranslate2_limited). Both depend on the sentence
    alone, so its output never depends on the others in its batch. With a length penalty the first search
    stops, as CTranslate2 stops, at the step its `beam`-th hypothesis finishes, which is among the `beam` it
    returns: a search that ran past the step where its own limit would have ended it is always seen and done
    again, and the outcome is the search under its own limit. Without one (lenpen 0: it returns `nbest` and
    stops once its best candidate is EOS) a search can run past that step unseen, when its `nbest` returned
    finished earlier: those are then the outcome.

    Ranking: with a length penalty it returns its `beam` best, ranked by its own penalty (length**lenpen
    rather than GNMT's ((5 + length) / 6)**lenpen; length counting EOS in both, hence return_end_token),
    re-ranked here by ours computed from its scores; without one, its `nbest` best (the two rankings agree,
    and its early exit waits for nbest finished). Its log-probabilities are renormalised over the tokens it
    may emit (ours drops BOS's and PAD's probability instead), so the score it gives differs from ours by
    the log of what BOS and PAD would have had at each step (about 1e-5 a token after training).
    scores=True: the kept `nbest` hypotheses are scored again by its scorer (one teacher-forced pass, in one
    call), which gives ours exactly, and ordered by it; scores=False (only the tokens are used: translate
    without --nbest, evaluate) leaves the scores from the search, ours but for that renormalisation.
    Sentences searched again under their own limit have every returned hypothesis scored again and ranked
    by it, whatever `scores` says: at the limit CTranslate2 does not force EOS, so one still unfinished there
    has none, and the scorer adds the EOS ours would force.

    Beam outputs can differ from ours (greedy outputs do not): (1) it stops as our "early" rule does but keeps
    every hypothesis finished at the stopping step, up to 2*beam-1, where ours keeps the first `beam`; (2) only
    the `beam` best by its penalty reach the re-ranking; (3) at the limit its unfinished hypotheses, scored
    without their EOS, can push a shorter finished one out of those `beam`, and a live hypothesis ours ends
    there is missing when an EOS took its place in the beam's top `beam`; (4) the renormalisation can reorder
    candidates of rows that give BOS and PAD different probabilities (an untrained model; after training
    label smoothing leaves each ~smoothing / vocabulary). With several workers (the translator's
    inter_threads) the batches are sized and run side by side as search_batches runs ours.

    What else it maps (ctranslate2_options): sampling (its sampling_topk, sampling_topp, sampling_temperature; a
    random stream per worker, seeded when the Translator is made, so that a run repeats itself with the same seed,
    the same input and one worker, but a sentence's samples depend on its batch, on what was drawn before it and,
    with several workers, on which worker takes its batch), a forced prefix (target_prefix; its limit counts the prefix, as ours does)
    and alignments (return_attention: the conversion asks for the last layer's cross-attention averaged over all
    heads, alignment.py's default, and the source's EOS is not in it). Constraints and ensembles it does not have
    (the Translator refuses them).
    """
    nbest = settings.nbest
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0) for _ in range(nbest)] for _ in src_ids]
    limit = source_limit(max_positions)
    workers = translator.num_translators
    tokens_per_batch = max(1, settings.max_tokens // workers)  # as source_batches sizes them
    sources: dict[int, list[str]] = {}  # CTranslate2 appends </s> itself
    prefixes: dict[int, list[str]] = {}  # forced target prefixes, as pieces
    own: dict[int, int] = {}  # each sentence's own output-length limit
    calls = []  # per call: its indices and pending results
    for batch in source_batches(src_ids, max_positions, settings.max_tokens, workers):
        for i in batch:
            sources[i] = vocab.pieces(src_ids[i][:limit])
            prefixes[i] = vocab.pieces(list(options[i].prefix)) if options is not None else []
        max_lens = max_output_lengths(
            torch.tensor([len(sources[i]) + 1 for i in batch]),  # + EOS
            settings.max_len_offset,
            max_positions,
        )
        # At least the prefix, as search.max_lengths says.
        max_lens = torch.maximum(max_lens, torch.tensor([len(prefixes[i]) for i in batch]))
        own.update(zip(batch, max_lens.clamp(max=max_positions - 1).tolist()))
        if settings.sample is not None:  # samples searched again would be other samples: each under its own limit
            continue
        buckets = [limit_bucket(own[i], max_positions) for i in batch]
        for bucket, rows in same_limit(buckets):  # asynchronous: every worker takes calls from the queue
            indices = [batch[r] for r in rows]
            calls.append((indices, _translate_async(translator, vocab, sources, prefixes, indices, settings, bucket)))
    found: dict[int, list[Hypothesis]] = {}
    again = list(sources) if settings.sample is not None else []  # sentences to search under their own limit
    for indices, pending in calls:
        for i, result in zip(indices, pending):
            hyps = _hypotheses(vocab, result.result(), settings)
            if any(len(h.tokens) >= own[i] - 1 for h in hyps):
                again.append(i)
            else:  # every hypothesis ended with EOS: its score is ours but for the renormalisation
                found[i] = sorted(hyps, key=lambda h: h.score, reverse=True)[:nbest]
    limited = ctranslate2_limited(translator, vocab, sources, prefixes, again, own, settings)
    if scores:
        found = dict(zip(found, _scored(translator, vocab, sources, found, settings, tokens_per_batch)))
    for i, hyps in (*found.items(), *limited.items()):
        out[i] = sorted(hyps, key=lambda h: h.score, reverse=True)[:nbest]
    return out


def ctranslate2_limited(
    translator,
    vocab: AnyVocab,
    sources: dict[int, list[str]],
    prefixes: dict[int, list[str]],
    indices: Sequence[int],
    limits: dict[int, int],
    settings: SearchSettings,
) -> dict[int, list[Hypothesis]]:
    """The sources (pieces, by index) of `indices` searched each under its own length limit (`limits`, by index):
    one call per distinct limit, every returned hypothesis scored again (ours: the EOS that the limit ended
    added), best first."""
    tokens_per_batch = max(1, settings.max_tokens // translator.num_translators)
    calls = []
    for max_len, rows in same_limit([limits[i] for i in indices]):
        batch = [indices[r] for r in rows]
        pending = _translate_async(translator, vocab, sources, prefixes, batch, settings, max_len, tokens_per_batch)
        calls.append((batch, pending))
    found = {}
    for batch, pending in calls:
        for i, result in zip(batch, pending):
            found[i] = _hypotheses(vocab, result.result(), settings)
    scored = _scored(translator, vocab, sources, found, settings, tokens_per_batch)
    return {i: sorted(hyps, key=lambda h: h.score, reverse=True) for i, hyps in zip(found, scored)}


def limit_bucket(max_len: int, max_positions: int) -> int:
    """The length limit a sentence whose own limit is `max_len` is first searched under by CTranslate2: the power
    of two at or above it, capped at the longest output a model can make (max_positions - 1, as every limit is).
    A sentence that runs on past its own limit costs at most twice its steps more."""
    return min(1 << max(0, max_len - 1).bit_length(), max_positions - 1)


def _translate_async(
    translator,
    vocab: AnyVocab,
    sources: dict[int, list[str]],
    prefixes: dict[int, list[str]],
    indices: Sequence[int],
    settings: SearchSettings,
    max_len: int,
    max_tokens: int = 0,
) -> list:
    """One asynchronous translate_batch call for the sources of `indices` under length limit `max_len`, as ours
    searches: BOS and PAD never emitted, EOS allowed at once, the sources as given (cut already), each one's
    forced prefix, the hypotheses with their EOS (which its penalty then counts, as ours does: an empty output
    would otherwise rank last, divided by 0**lenpen). max_tokens: CTranslate2 splits the sources into batches of
    that many tokens (0: they are one batch)."""
    forced = [prefixes[i] for i in indices]
    return translator.translate_batch(
        [sources[i] for i in indices],
        target_prefix=forced if any(forced) else None,
        num_hypotheses=settings.nbest if settings.lenpen == 0 or settings.sample is not None else settings.beam,
        length_penalty=settings.lenpen,
        max_decoding_length=max_len,
        suppress_sequences=[[piece] for piece in vocab.pieces(sorted({vocab.specials.bos, vocab.specials.pad}))],
        min_decoding_length=0,
        return_end_token=True,
        return_scores=True,
        return_attention=settings.alignments,
        max_input_length=0,
        max_batch_size=max_tokens,
        batch_type="tokens",
        asynchronous=True,
        **ctranslate2_options(settings),
    )


def ctranslate2_options(settings: SearchSettings) -> dict:
    """translate_batch's search options for `settings`: beam search, or sampling (top-k 0 is its whole vocabulary)."""
    if settings.sample is None:
        return {"beam_size": settings.beam}
    kind, value = parse_sample(settings.sample)
    return {
        "beam_size": 1,
        "sampling_topk": int(value) if kind == "topk" else 0,
        "sampling_topp": value if kind == "topp" else 1.0,
        "sampling_temperature": settings.temperature,
    }


def _hypotheses(vocab: AnyVocab, result, settings: SearchSettings) -> list[Hypothesis]:
    """A TranslationResult's hypotheses as ours, without EOS, scored by our penalty from its normalised score:
    summed log-probability = score * length**lenpen (length counting EOS, as return_end_token makes it). A
    hypothesis the length limit ended has no EOS: neither its tokens nor its score count one. With alignments,
    each hypothesis's per output piece the source piece it attends to most."""
    lenpen, hyps = settings.lenpen, []
    attention = result.attention if settings.alignments else [None] * len(result.hypotheses)
    for pieces, score, weights in zip(result.hypotheses, result.scores, attention):
        length = len(pieces)
        total = score * length**lenpen if length else score
        ids = _without_eos(vocab.piece_ids(pieces), vocab.specials.eos)
        alignment = None if weights is None else _attended(weights, len(ids))
        hyps.append(Hypothesis(ids, total / length_penalty(length, lenpen, settings.lenpen_kind), alignment))
    return hyps


def _scored(
    translator,
    vocab: AnyVocab,
    sources: dict[int, list[str]],
    found: dict[int, list[Hypothesis]],
    settings: SearchSettings,
    tokens_per_batch: int,
) -> list[list[Hypothesis]]:
    """found's hypotheses (by source index) scored again by CTranslate2's scorer in one asynchronous call split
    into batches of about tokens_per_batch: ours, each token's and EOS's log-probability normalised over the
    whole vocabulary, divided by our length penalty."""
    lenpen, kind = settings.lenpen, settings.lenpen_kind
    pairs = [(sources[i], h.tokens) for i, hyps in found.items() for h in hyps]
    if not pairs:
        return []
    pending = iter(
        translator.score_batch(
            [source for source, _ in pairs],
            [vocab.pieces(tokens) for _, tokens in pairs],
            max_batch_size=tokens_per_batch,
            batch_type="tokens",
            max_input_length=0,
            asynchronous=True,
        )
    )
    return [
        [
            Hypothesis(
                h.tokens,
                sum(next(pending).result().log_probs) / length_penalty(len(h.tokens) + 1, lenpen, kind),
                h.alignment,
            )
            for h in hyps
        ]
        for hyps in found.values()
    ]


def _attended(weights: Sequence[Sequence[float]], length: int) -> list[int]:
    """CTranslate2's attention of one hypothesis (a row per output piece, a column per source piece, EOS's
    dropped) -> per output piece the source piece it attends to most."""
    return [max(range(len(row)), key=row.__getitem__) if len(row) else 0 for row in list(weights)[:length]]


def _without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def same_limit(max_lens: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(limit, positions) for each distinct value in `max_lens`, the largest first: what one CTranslate2 call
    with that max_decoding_length may take."""
    groups: dict[int, list[int]] = {}
    for position, max_len in enumerate(max_lens):
        groups.setdefault(max_len, []).append(position)
    return sorted(groups.items(), reverse=True)


def _one_line(text: str) -> str:
    # A subword may hold a line break (the vocabulary saw any character but '\n'): keep one line per input.
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


@dataclass
class Translation:
    """One translation of a line: its score (search.py's), its text on one line, and with alignments asked for,
    (source word, output word) pairs (alignment.py)."""

    score: float
    text: str
    alignment: list[tuple[int, int]] | None = None
    constrained: bool = True  # False: the line's constraints could not all be met, and this is unconstrained

    def alignment_text(self) -> str:
        return pharaoh(self.alignment or [])


class Translator:
    """A model (or an ensemble), its vocabulary and search settings, loaded once; translate() maps lines to lines.

    checkpoint: a run directory or checkpoint file, or several: an ensemble (ensemble.py; one vocabulary, checked
    here; the first one's config, decode section and run state; ours only). flags: what the caller asked for
    (SearchFlags; None = the checkpoint's decode section), made into `settings` (SearchSettings, search_settings)
    once the checkpoint is read, with the dtype picked for the device, and with sampling a seed (drawn here when
    none is given, and said in `note`). dtype: fp32, bf16 (weights cast; log-probabilities still in fp32), int8
    (CPU: dynamic quantization of the linear layers) or auto (pick_dtype; `note` says what it picked; a library
    caller's default is fp32). engine: ours (PyTorch search) or ctranslate2 (the checkpoint converted once,
    cached beside it: ctranslate2_engine.cached_conversion). workers: searches side by side on a CPU
    (search_batches); CTranslate2 gets them as its inter_threads. keep_model: with CTranslate2, keep the PyTorch
    model too (fp32, on the CPU), for what only it can show (serve's attention maps and beam traces); otherwise
    it is dropped once converted.
    """

    def __init__(
        self,
        checkpoint: str | Path | Sequence[str | Path],
        device: str = "auto",
        flags: SearchFlags = SearchFlags(),
        keep_model: bool = False,
    ):
        bounded_onednn_caches()  # a library caller's first CPU work may be ours
        checkpoints = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
        self.device = pick_device(device)
        engine = flags.engine or SearchSettings.engine
        if engine == "ctranslate2" and len(checkpoints) > 1:
            raise UserError("an ensemble runs on --engine ours only: CTranslate2 searches one model at a time")
        dtype, why = pick_dtype(flags.dtype or SearchSettings.dtype, self.device, engine)
        models, vocabs = [], []
        for path in checkpoints:
            state = load_checkpoint(resolve_checkpoint(path))
            model, vocab, cfg = model_from_checkpoint(state, self.device if engine == "ours" else "cpu")
            if not models:  # the first: its config, decode section and run state are the translator's
                self.vocab, self.cfg = vocab, cfg
                self.run: dict = state.get("run") or {}  # the training state it was saved at, for serve's /info
            del state
            vocabs.append(vocab)
            check_vocabularies(vocabs, [str(c) for c in checkpoints])  # before the next one loads
            models.append(model)
        if len(models) > 1:  # a source or an output must fit every member
            shortest = min(m.cfg.max_positions for m in models)
            self.cfg = replace(self.cfg, model=replace(self.cfg.model, max_positions=shortest))
        self.parameters = sum(map(count_parameters, models))  # as trained: the dtypes and layouts below hide some
        self.settings = search_settings(
            self.cfg.decode, replace(flags, dtype=dtype), len(self.vocab), self.cfg.model.n_decoder_layers
        )
        # For the commands to print once their own checks have passed (a library caller may ignore it).
        notes = [f"dtype: {dtype} ({why})"] if flags.dtype == "auto" else []
        if dtype == "bf16" and self.device.type == "cpu" and not native_bf16(self.device)[0]:
            notes = [
                "warning: this CPU has no native bf16 (no avx512_bf16 or amx_bf16): bf16 runs emulated, "
                "much slower than fp32"
            ]
        if engine == "ctranslate2" and flags.stop == "exact":  # asked for, not the checkpoint's default
            notes.append("warning: --stop exact does not apply to --engine ctranslate2, which stops like --stop early")
        if self.settings.sample is not None and self.settings.seed is None:
            self.settings = replace(self.settings, seed=random.SystemRandom().randrange(2**32))
            notes.append(f"sampling with seed {self.settings.seed} (--seed {self.settings.seed} draws these again)")
        last = self.cfg.model.n_decoder_layers
        if engine == "ctranslate2" and self.settings.alignments and self.settings.alignment_layer not in (None, last):
            raise UserError(
                f"--engine ctranslate2 returns the attention of the last decoder layer ({last}) only; "
                "drop --alignment-layer, or use --engine ours"
            )
        self.note = "\n".join(notes) if notes else None
        self.ct2 = None
        if engine == "ctranslate2":
            self.ct2 = self._load_ctranslate2(checkpoints[0])
            models = models if keep_model else []  # converted: the PyTorch copy is not needed any more
        else:
            models = [self._in_format(m, dtype) for m in models]
        self.model = (models[0] if len(models) == 1 else Ensemble(models)) if models else None
        self.lines_seen = 0  # numbers the lines in warnings across streamed chunks
        self.lines_truncated = 0

    def _in_format(self, model, dtype: str):
        """The model with its weights as `dtype` and the device want them (weight_formats.py)."""
        if dtype == "bf16" and self.device.type == "cpu":
            from transformer.inference.weight_formats import pack_bf16

            return pack_bf16(model)
        if dtype == "bf16":
            return model.to(torch.bfloat16)
        if dtype == "int8":
            from transformer.inference.weight_formats import quantize_int8

            return quantize_int8(model)
        if self.device.type == "cpu":
            from transformer.inference.weight_formats import input_major

            return input_major(model)
        return model

    def _load_ctranslate2(self, checkpoint):
        from transformer.inference.ctranslate2_engine import cached_conversion, require_ctranslate2

        ctranslate2 = require_ctranslate2()
        model_dir = cached_conversion(checkpoint)
        if self.settings.seed is not None:  # its workers seed their random streams when they start
            ctranslate2.set_random_seed(self.settings.seed)
        workers = search_workers(self.settings.workers, self.device)  # laid out over the CPU's threads as ours
        ours = torch.get_num_threads()
        threads = threads_per_worker(workers) if self.device.type == "cpu" else 1
        try:
            return ctranslate2.Translator(
                str(model_dir),
                device=self.device.type,
                inter_threads=workers,
                intra_threads=threads,
                compute_type=CT2_COMPUTE_TYPES[self.settings.dtype],
            )
        except (ValueError, RuntimeError) as e:  # e.g. a compute type this machine or build lacks
            raise UserError(
                f"CTranslate2 cannot run {model_dir} on {self.device.type} in {self.settings.dtype}: "
                f"{str(e).splitlines()[0]}"
            ) from None
        finally:  # it sets the calling thread's OpenMP count, torch's too, to intra_threads
            torch.set_num_threads(ours)

    def encode(self, lines: Sequence[str], warn: bool = True) -> list[list[int]]:
        """Subword ids per line; a line longer than the model takes is truncated by the search, and one longer than
        MAX_LINE_CHARS is cut before it is split; both are said on stderr (warn=False: the caller tells its own
        way, as serve does in its answer)."""
        lengths = [len(line) for line in lines]
        cut = [line[:MAX_LINE_CHARS] for line in lines]
        ids = self.vocab.encode([line if line.strip() else "" for line in cut])
        limit = source_limit(self.cfg.model.max_positions)
        for i, seq in enumerate(ids):
            if warn and (len(seq) > limit or lengths[i] > MAX_LINE_CHARS):
                self.lines_truncated += 1
                # A file of long lines would bury everything else on stderr: the first few, then a count at the end.
                if self.lines_truncated <= TRUNCATION_WARNINGS:
                    more = (
                        "; further ones are counted at the end" if self.lines_truncated == TRUNCATION_WARNINGS else ""
                    )
                    has = (
                        f"{len(seq)} subwords"
                        if lengths[i] <= MAX_LINE_CHARS
                        else f"over {MAX_LINE_CHARS:,} characters (only those are read)"
                    )
                    print(
                        f"warning: input line {self.lines_seen + i + 1} has {has}; truncated to the first {limit} "
                        f"subwords (model.max_positions - 2){more}",
                        file=sys.stderr,
                    )
        self.lines_seen += len(lines)
        return ids

    def report_truncation(self) -> None:
        """At the end of the input: how many lines were truncated in all, once the warnings stopped naming them."""
        if self.lines_truncated >= TRUNCATION_WARNINGS:  # at 5, the fifth warning promised a count
            print(
                f"warning: {self.lines_truncated} of {self.lines_seen} input lines were longer than "
                f"{source_limit(self.cfg.model.max_positions)} subwords and were truncated",
                file=sys.stderr,
            )

    def search(
        self,
        src_ids: Sequence[Sequence[int]],
        settings: SearchSettings | None = None,
        options: Sequence[SentenceOptions] | None = None,
        unmet: list[int] | None = None,
        scores: bool = True,
    ) -> list[list[Hypothesis]]:
        """Per source (subword ids), its settings.nbest best hypotheses, through this translator's engine, each
        with its alignment when settings.alignments. settings: this translator's, or a variant of them (serve's
        request settings: dataclasses.replace of these; their dtype and engine are this translator's whatever
        they say). options and unmet: as for search_ids. scores=False: the caller uses only the tokens, which spares
        CTranslate2 a scoring pass (ctranslate2_search); ours scores either way."""
        settings = self.settings if settings is None else settings
        if self.ct2 is not None:
            if options is not None and any(o.constraints for o in options):
                raise UserError("--engine ctranslate2 has no terminology constraints; use --engine ours")
            max_positions = self.cfg.model.max_positions
            return ctranslate2_search(self.ct2, self.vocab, src_ids, settings, max_positions, options, scores)
        found = search_ids(self.model, src_ids, settings, self.device, options, unmet)
        if settings.alignments:
            limit = source_limit(self.cfg.model.max_positions)
            pairs = [(src_ids[i][:limit], h.tokens) for i, hyps in enumerate(found) for h in hyps]
            layer = settings.alignment_layer or default_layer(self.cfg.model.n_decoder_layers)
            links = iter(piece_alignments(self.model, pairs, layer, settings.max_tokens))
            for hyps in found:
                for h in hyps:
                    h.alignment = next(links)
        return found

    def sentence_options(
        self,
        count: int,
        prefixes: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        first_line: int = 0,
    ) -> list[SentenceOptions] | None:
        """What `count` sentences ask beyond the settings, from text: per sentence a target prefix ("" = none) and
        target phrases, encoded into pieces (None: no sentence asks anything). A prefix longer than
        model.max_positions - 2 pieces is cut there, with a warning naming its line (first_line + 1 onwards)."""
        if not prefixes and not constraints:
            return None
        limit = source_limit(self.cfg.model.max_positions)
        prefix_ids = self.vocab.encode([p if p.strip() else "" for p in prefixes]) if prefixes else [[]] * count
        for i, ids in enumerate(prefix_ids):
            if len(ids) > limit:
                print(
                    f"warning: the prefix of input line {first_line + i + 1} has {len(ids)} pieces; only the first "
                    f"{limit} are forced (model.max_positions - 2)",
                    file=sys.stderr,
                )
        phrases = []
        for line in constraints or [[]] * count:
            texts = [p for p in line if p.strip()]
            phrases.append(tuple(tuple(ids) for ids in self.vocab.encode(texts) if ids) if texts else ())
        return [SentenceOptions(tuple(p[:limit]), c) for p, c in zip(prefix_ids, phrases)]

    def translations(
        self, src_ids: Sequence[Sequence[int]], found: Sequence[Sequence[Hypothesis]], unmet: Sequence[int] = ()
    ) -> list[list[Translation]]:
        """search()'s hypotheses as Translations: text on one line, word alignments where the hypotheses have them."""
        limit = source_limit(self.cfg.model.max_positions)
        out = []
        for i, (ids, hyps) in enumerate(zip(src_ids, found)):
            texts = self.vocab.decode([h.tokens for h in hyps])
            source_pieces = self.vocab.pieces(list(ids[:limit]))
            out.append(
                [
                    Translation(
                        h.score,
                        _one_line(text),
                        None
                        if h.alignment is None
                        else word_alignments(source_pieces, self.vocab.pieces(h.tokens), h.alignment),
                        i not in unmet,
                    )
                    for h, text in zip(hyps, texts)
                ]
            )
        return out

    def translate_lines(
        self,
        lines: Sequence[str],
        prefixes: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        settings: SearchSettings | None = None,
        scores: bool = True,
    ) -> list[list[Translation]]:
        """Per line, its settings.nbest Translations, best first; per line optionally a forced target prefix and
        target phrases its translations must contain. A line whose phrases cannot all be met gets its best
        unconstrained translations and a warning on stderr. scores=False: the caller shows no score (search())."""
        first = self.lines_seen
        ids = self.encode(lines)
        options = self.sentence_options(len(lines), prefixes, constraints, first)
        unmet: list[int] = []
        found = self.search(ids, settings, options, unmet, scores)
        for i in sorted(unmet):
            print(
                f"warning: input line {first + i + 1}: its translations could not contain every constraint "
                "within the length limit; it has the unconstrained ones",
                file=sys.stderr,
            )
        return self.translations(ids, found, unmet)

    def translate_nbest(
        self, lines: Sequence[str], nbest: int | None = None, scores: bool = True
    ) -> list[list[tuple[float, str]]]:
        """Per line, up to `nbest` (default settings.nbest) (score, translation) pairs, best first. scores=False:
        the caller shows no score (search())."""
        settings = None if nbest is None else replace(self.settings, nbest=nbest)
        return self.texts(self.search(self.encode(lines), settings, scores=scores))

    def texts(self, found: Sequence[Sequence[Hypothesis]]) -> list[list[tuple[float, str]]]:
        """search()'s hypotheses as (score, translation) pairs, one line each."""
        return [
            [(h.score, _one_line(text)) for h, text in zip(hyps, self.vocab.decode([h.tokens for h in hyps]))]
            for hyps in found
        ]

    def translate(self, lines: Sequence[str]) -> list[str]:
        return [hyps[0][1] for hyps in self.translate_nbest(lines, 1, scores=False)]
