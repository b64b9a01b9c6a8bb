"""Text in, text out: a Translator that loads a checkpoint once and runs it on a device, in a dtype
(fp32/bf16/int8), through an engine (ours or CTranslate2), with the SearchSettings its flags and the checkpoint
make (settings.py); batching by length (the command's own input and output: translate_io.py)."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from transformer.data.batch import prepare_sources, source_limit
from transformer.data.batching import pack_by_size
from transformer.data.vocab import AnyVocab
from transformer.device import auto_precision, bounded_onednn_caches, native_bf16, pick_device
from transformer.errors import UserError
from transformer.inference.search import Hypothesis, SearchResult, length_penalty, max_output_lengths, search
from transformer.inference.settings import SearchFlags, SearchSettings, search_settings
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


def search_batches(
    model, src_ids: Sequence[Sequence[int]], settings: SearchSettings, device
) -> Iterator[tuple[list[int], SearchResult]]:
    """search() over the non-empty sources (subword ids, no EOS) in length batches of settings.max_tokens: per
    batch, in order, the indices of its sources and what search() found for them (hypotheses in that order, and
    the decoder steps it took). Sources are cut as batch.prepare_sources says. The model is searched as it is:
    settings.dtype and settings.engine are the Translator's business.

    With settings.workers > 1 on a CPU (search_workers), that many searches run side by side, each on its own
    batches (source_batches). Input that fits one batch is searched in the calling thread on all threads:
    one sentence is not slower for it."""
    workers = search_workers(settings.workers, device)
    batches = source_batches(src_ids, model.cfg.max_positions, settings.max_tokens, workers)

    def run(batch: list[int]) -> SearchResult:
        src, _ = prepare_sources([src_ids[i] for i in batch], model.cfg.max_positions, model.specials)  # (B, S)
        return search(
            model,
            src.to(device),
            settings.beam,
            settings.lenpen,
            settings.max_len_offset,
            settings.nbest,
            settings.stop,
            lenpen_kind=settings.lenpen_kind,
        )

    if workers == 1 or len(batches) == 1:
        for batch in batches:
            yield batch, run(batch)
        return
    # Eval mode set once for all workers: each search() also sets it and puts back what it found, and side by
    # side the first to finish would switch dropout back on under the others (the trainer's validation BLEU).
    with evaluating(model, inference=False), worker_threads(workers) as pool:
        yield from zip(batches, pool.map(run, batches))


def search_ids(model, src_ids: Sequence[Sequence[int]], settings: SearchSettings, device) -> list[list[Hypothesis]]:
    """Per source (subword ids, no EOS), its settings.nbest best hypotheses, input order kept. An empty source
    gives nbest empty hypotheses without running the model. Batches and workers: as for search_batches."""
    nbest = settings.nbest
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0) for _ in range(nbest)] for _ in src_ids]
    for batch, found in search_batches(model, src_ids, settings, device):
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
    """
    nbest = settings.nbest
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0) for _ in range(nbest)] for _ in src_ids]
    limit = source_limit(max_positions)
    workers = translator.num_translators
    tokens_per_batch = max(1, settings.max_tokens // workers)  # as source_batches sizes them
    sources: dict[int, list[str]] = {}  # CTranslate2 appends </s> itself
    own: dict[int, int] = {}  # each sentence's own output-length limit
    calls = []  # per call: its indices and pending results
    for batch in source_batches(src_ids, max_positions, settings.max_tokens, workers):
        for i in batch:
            sources[i] = vocab.pieces(src_ids[i][:limit])
        max_lens = max_output_lengths(
            torch.tensor([len(sources[i]) + 1 for i in batch]),  # + EOS
            settings.max_len_offset,
            max_positions,
        ).tolist()
        own.update(zip(batch, max_lens))
        buckets = [limit_bucket(n, max_positions) for n in max_lens]
        for bucket, rows in same_limit(buckets):  # asynchronous: every worker takes calls from the queue
            indices = [batch[r] for r in rows]
            calls.append(
                (indices, _translate_async(translator, vocab, [sources[i] for i in indices], settings, bucket))
            )
    found: dict[int, list[Hypothesis]] = {}
    again = []  # sentences to search under their own limit
    for indices, pending in calls:
        for i, result in zip(indices, pending):
            hyps = _hypotheses(vocab, result.result(), settings)
            if any(len(h.tokens) >= own[i] - 1 for h in hyps):
                again.append(i)
            else:  # every hypothesis ended with EOS: its score is ours but for the renormalisation
                found[i] = sorted(hyps, key=lambda h: h.score, reverse=True)[:nbest]
    limited = ctranslate2_limited(translator, vocab, {i: sources[i] for i in again}, own, settings)
    if scores:
        found = dict(zip(found, _scored(translator, vocab, sources, found, settings, tokens_per_batch)))
    for i, hyps in (*found.items(), *limited.items()):
        out[i] = sorted(hyps, key=lambda h: h.score, reverse=True)[:nbest]
    return out


def ctranslate2_limited(
    translator, vocab: AnyVocab, sources: dict[int, list[str]], limits: dict[int, int], settings: SearchSettings
) -> dict[int, list[Hypothesis]]:
    """Sources (pieces, by index) searched each under its own length limit (`limits`, by index): one call per
    distinct limit, every returned hypothesis scored again (ours: the EOS that the limit ended added), best
    first."""
    tokens_per_batch = max(1, settings.max_tokens // translator.num_translators)
    calls = []
    by_limit = same_limit([limits[i] for i in sources])
    indices = list(sources)
    for max_len, rows in by_limit:
        batch = [indices[r] for r in rows]
        batch_sources = [sources[i] for i in batch]
        calls.append((batch, _translate_async(translator, vocab, batch_sources, settings, max_len, tokens_per_batch)))
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
    translator, vocab: AnyVocab, sources: list[list[str]], settings: SearchSettings, max_len: int, max_tokens: int = 0
) -> list:
    """One asynchronous translate_batch call under length limit `max_len`, as ours searches: BOS and PAD never
    emitted, EOS allowed at once, the sources as given (cut already), the hypotheses with their EOS (which its
    penalty then counts, as ours does: an empty output would otherwise rank last, divided by 0**lenpen). max_tokens:
    CTranslate2 splits the sources into batches of that many tokens (0: they are one batch)."""
    return translator.translate_batch(
        sources,
        beam_size=settings.beam,
        num_hypotheses=settings.nbest if settings.lenpen == 0 else settings.beam,
        length_penalty=settings.lenpen,
        max_decoding_length=max_len,
        suppress_sequences=[[piece] for piece in vocab.pieces(sorted({vocab.specials.bos, vocab.specials.pad}))],
        min_decoding_length=0,
        return_end_token=True,
        return_scores=True,
        max_input_length=0,
        max_batch_size=max_tokens,
        batch_type="tokens",
        asynchronous=True,
    )


def _hypotheses(vocab: AnyVocab, result, settings: SearchSettings) -> list[Hypothesis]:
    """A TranslationResult's hypotheses as ours, without EOS, scored by our penalty from its normalised score:
    summed log-probability = score * length**lenpen (length counting EOS, as return_end_token makes it). A
    hypothesis the length limit ended has no EOS: neither its tokens nor its score count one."""
    lenpen, hyps = settings.lenpen, []
    for pieces, score in zip(result.hypotheses, result.scores):
        length = len(pieces)
        total = score * length**lenpen if length else score
        ids = _without_eos(vocab.piece_ids(pieces), vocab.specials.eos)
        hyps.append(Hypothesis(ids, total / length_penalty(length, lenpen, settings.lenpen_kind)))
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
                h.tokens, sum(next(pending).result().log_probs) / length_penalty(len(h.tokens) + 1, lenpen, kind)
            )
            for h in hyps
        ]
        for hyps in found.values()
    ]


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


class Translator:
    """A model, its vocabulary and search settings, loaded once; translate() maps lines to lines.

    flags: what the caller asked for (SearchFlags; None = the checkpoint's decode section), made into
    `settings` (SearchSettings, search_settings) once the checkpoint is read, with the dtype picked for the
    device. dtype: fp32, bf16 (weights cast; log-probabilities still in fp32), int8 (CPU: dynamic quantization
    of the linear layers) or auto (pick_dtype; `note` says what it picked; a library caller's default is fp32).
    engine: ours (PyTorch search) or ctranslate2 (the checkpoint converted once, cached beside it:
    ctranslate2_engine.cached_conversion). workers: searches side by side on a CPU (search_batches);
    CTranslate2 gets them as its inter_threads. keep_model: with CTranslate2, keep the PyTorch model too (fp32,
    on the CPU), for what only it can show (serve's attention maps and beam traces); otherwise it is dropped
    once converted.
    """

    def __init__(
        self, checkpoint: str | Path, device: str = "auto", flags: SearchFlags = SearchFlags(), keep_model: bool = False
    ):
        bounded_onednn_caches()  # a library caller's first CPU work may be ours
        self.device = pick_device(device)
        engine = flags.engine or SearchSettings.engine
        dtype, why = pick_dtype(flags.dtype or SearchSettings.dtype, self.device, engine)
        state = load_checkpoint(resolve_checkpoint(checkpoint))
        self.model, self.vocab, self.cfg = model_from_checkpoint(state, self.device if engine == "ours" else "cpu")
        self.run: dict = state.get("run") or {}  # the training state it was saved at (step, best), for serve's /info
        self.parameters = count_parameters(self.model)  # as trained: the dtypes and layouts below hide some
        del state
        self.settings = search_settings(self.cfg.decode, replace(flags, dtype=dtype), len(self.vocab))
        # For the commands to print once their own checks have passed (a library caller may ignore it).
        self.note = f"dtype: {dtype} ({why})" if flags.dtype == "auto" else None
        if dtype == "bf16" and self.device.type == "cpu" and not native_bf16(self.device)[0]:
            self.note = (
                "warning: this CPU has no native bf16 (no avx512_bf16 or amx_bf16): bf16 runs emulated, "
                "much slower than fp32"
            )
        if engine == "ctranslate2" and flags.stop == "exact":  # asked for, not the checkpoint's default
            warning = "warning: --stop exact does not apply to --engine ctranslate2, which stops like --stop early"
            self.note = f"{self.note}\n{warning}" if self.note else warning
        self.ct2 = None
        if engine == "ctranslate2":
            self.ct2 = self._load_ctranslate2(checkpoint)
            if not keep_model:
                self.model = None  # converted: the PyTorch copy is not needed any more
        elif dtype == "bf16" and self.device.type == "cpu":
            from transformer.inference.weight_formats import pack_bf16

            self.model = pack_bf16(self.model)
        elif dtype == "bf16":
            self.model = self.model.to(torch.bfloat16)
        elif dtype == "int8":
            from transformer.inference.weight_formats import quantize_int8

            self.model = quantize_int8(self.model)
        elif self.device.type == "cpu":
            from transformer.inference.weight_formats import input_major

            self.model = input_major(self.model)
        self.lines_seen = 0  # numbers the lines in truncation warnings across streamed chunks
        self.lines_truncated = 0

    def _load_ctranslate2(self, checkpoint):
        from transformer.inference.ctranslate2_engine import cached_conversion, require_ctranslate2

        ctranslate2 = require_ctranslate2()
        model_dir = cached_conversion(checkpoint)
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
        self, src_ids: Sequence[Sequence[int]], settings: SearchSettings | None = None, scores: bool = True
    ) -> list[list[Hypothesis]]:
        """Per source (subword ids), its settings.nbest best hypotheses, through this translator's engine.
        settings: this translator's, or a variant of them (serve's request beam and n-best: dataclasses.replace
        of these; their dtype and engine are this translator's whatever they say). scores=False: the caller uses
        only the tokens, which spares CTranslate2 a scoring pass (ctranslate2_search); ours scores either way."""
        settings = self.settings if settings is None else settings
        if self.ct2 is not None:
            return ctranslate2_search(self.ct2, self.vocab, src_ids, settings, self.cfg.model.max_positions, scores)
        return search_ids(self.model, src_ids, settings, self.device)

    def translate_nbest(
        self, lines: Sequence[str], nbest: int | None = None, scores: bool = True
    ) -> list[list[tuple[float, str]]]:
        """Per line, up to `nbest` (default settings.nbest) (score, translation) pairs, best first. scores=False:
        the caller shows no score (search())."""
        settings = None if nbest is None else replace(self.settings, nbest=nbest)
        return self.texts(self.search(self.encode(lines), settings, scores))

    def texts(self, found: Sequence[Sequence[Hypothesis]]) -> list[list[tuple[float, str]]]:
        """search()'s hypotheses as (score, translation) pairs, one line each."""
        return [
            [(h.score, _one_line(text)) for h, text in zip(hyps, self.vocab.decode([h.tokens for h in hyps]))]
            for hyps in found
        ]

    def translate(self, lines: Sequence[str]) -> list[str]:
        return [hyps[0][1] for hyps in self.translate_nbest(lines, 1, scores=False)]
