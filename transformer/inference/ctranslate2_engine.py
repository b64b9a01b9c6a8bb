"""CTranslate2 as an engine: the checkpoint's cached conversion (ctranslate2_export.py) loaded with our dtype as its
compute type and our workers as its threads (`load`), and the search through it (`ctranslate2_search`: our batches,
length limits, scores and settings mapped onto its translate_batch)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from transformer.data.batch import source_limit
from transformer.data.loader import source_batches
from transformer.data.vocab import AnyVocab
from transformer.errors import UserError
from transformer.inference.ctranslate2_export import cached_conversion, require_ctranslate2
from transformer.inference.search import Hypothesis, length_penalty, max_output_lengths
from transformer.inference.settings import (
    SearchSettings,
    ctranslate2_keywords,
    ctranslate2_rescores,
    parse_sample,
)
from transformer.model.checkpoint import resolve_checkpoint
from transformer.run_dir import RunDir

CT2_COMPUTE_TYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}  # our dtype -> its compute_type


def load(checkpoint: str | Path, device, settings: SearchSettings, workers: int, threads: int):
    """A ctranslate2.Translator of the checkpoint's cached conversion on `device` (a torch.device), computing in
    settings.dtype, with `workers` searches side by side (its inter_threads) of `threads` threads each; seeded with
    settings.seed, since its workers seed their random streams when they start."""
    ctranslate2 = require_ctranslate2()
    run_dir = resolve_checkpoint(checkpoint).parent
    if settings.shortlist and not (run_dir / RunDir.SHORTLIST).is_file():
        from transformer.inference.shortlist import no_shortlist  # said before minutes of converting

        raise UserError(no_shortlist(run_dir))
    model_dir = cached_conversion(checkpoint)
    if settings.seed is not None:
        ctranslate2.set_random_seed(settings.seed)
    ours = torch.get_num_threads()
    try:
        return ctranslate2.Translator(
            str(model_dir),
            device=device.type,
            inter_threads=workers,
            intra_threads=threads,
            compute_type=CT2_COMPUTE_TYPES[settings.dtype],
        )
    except (ValueError, RuntimeError) as e:  # e.g. a compute type this machine or build lacks
        raise UserError(
            f"CTranslate2 cannot run {model_dir} on {device.type} in {settings.dtype}: {str(e).splitlines()[0]}"
        ) from None
    finally:  # it sets the calling thread's OpenMP count, torch's too, to intra_threads
        torch.set_num_threads(ours)


def ctranslate2_search(
    translator,
    vocab: AnyVocab,
    src_ids: Sequence[Sequence[int]],
    settings: SearchSettings,
    max_positions: int,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> list[list[Hypothesis]]:
    """batched.search_ids through a ctranslate2.Translator of the same model: the same batches, sources, length
    limits and score definition; like ours, it never emits BOS or PAD. settings.stop, .dtype and .workers do not
    apply here (the translator was made with its compute type and inter_threads).

    Length limits (one per call in CTranslate2): a batch goes as one call, and a sentence one of whose returned
    hypotheses comes within a token of its own limit is searched again under its own limit
    (ctranslate2_limited). With a length penalty the first search stops, as CTranslate2 stops, at the step its
    `beam`-th hypothesis finishes, and it returns its `beam` best finished ones: a search that ran past the step
    where its own limit would have ended it had fewer than `beam` finished by then, so one it returns is longer
    and it is always seen and done again; one that did not is, step for step, the search under its own limit.
    The outcome is the search under its own limit whatever the call's limit, so the call takes the largest of
    its sentences' buckets (limit_bucket: a limit rounded up to a power of two, which bounds what a sentence
    that runs on costs). Without one (lenpen 0: it returns `nbest` and stops once its best candidate is EOS) a
    search can run past that step unseen, when its `nbest` returned finished earlier: those are then the
    outcome, so each sentence is searched under its own bucket, one call per bucket. Either way a sentence's
    output depends on the sentence alone, never on the others in its batch.

    Scores, in one pass: BOS and PAD are not suppressed in the search, so each step's log-probabilities are
    normalised over the whole vocabulary, as ours are, and its search scores are ours (to float rounding, ~1e-5
    a hypothesis): no scoring pass is needed. (Suppressing them, as its suppress_sequences does, renormalises
    over the tokens left, slightly off ours at every token, so every shown score took a scoring pass.) A
    sentence one of whose returned hypotheses holds BOS or PAD (an untrained model) is searched again under
    its own limit with both suppressed, and its hypotheses scored again. Scored again too, by CTranslate2's
    scorer (ours exactly): hypotheses searched again under their own limit (at the limit CTranslate2 does not
    force EOS, so one still unfinished there has none, and the scorer adds the EOS ours would force), those
    with a forced prefix (its search score leaves the prefix's tokens out), and every one under a setting that
    its search renormalises for (settings.ctranslate2_rescores: its logits processors, as no_repeat_ngram_size,
    rule out tokens before its softmax, so its beam ranks by other scores than ours and may keep another).

    Ranking: with a length penalty it returns its `beam` best, ranked by its own penalty (length**lenpen
    rather than GNMT's ((5 + length) / 6)**lenpen; length counting EOS in both, hence return_end_token),
    re-ranked here by ours computed from its scores; without one, its `nbest` best (the two rankings agree,
    and its early exit waits for nbest finished).

    Beam outputs can differ from ours (greedy outputs do not): (1) it stops as our "early" rule does but keeps
    every hypothesis finished at the stopping step, up to 2*beam-1, where ours keeps the first `beam`; (2) only
    the `beam` best by its penalty reach the re-ranking; (3) at the limit its unfinished hypotheses, scored
    without their EOS, can push a shorter finished one out of those `beam`, and a live hypothesis ours ends
    there is missing when an EOS took its place in the beam's top `beam`; (4) a BOS or PAD candidate can hold
    a place in its beam for some steps and drop out again before the end (ours never ranks them), leaving
    another beam than ours (an untrained model; after training label smoothing leaves each ~smoothing /
    vocabulary, far below any beam's candidates). With several workers (the translator's inter_threads) the
    batches are sized and run side by side as search_batches runs ours.

    What else it maps (ctranslate2_options): sampling (its sampling_topk, sampling_topp, sampling_temperature,
    with BOS and PAD suppressed; a random stream per worker, seeded when the Translator is made, so that a run
    repeats itself with the same seed, the same input and one worker, but a sentence's samples depend on its
    batch, on what was drawn before it and, with several workers, on which worker takes its batch), a forced
    prefix (`prefixes`: per source, the target ids of its SentenceOptions.prefix; target_prefix, whose limit
    counts the prefix, as ours does) and alignments (return_attention: the conversion asks for the last
    layer's cross-attention averaged over all heads, alignment.py's default, and the source's EOS is not in
    it). Constraints and ensembles it does not have (the Translator refuses them).
    """
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0) for _ in range(settings.nbest)] for _ in src_ids]
    sources, forced, own, calls = _first_calls(translator, vocab, src_ids, settings, max_positions, prefixes)
    found, rescored, again, suppressed = _outcomes(vocab, calls, forced, own, settings)
    if settings.sample is not None:
        again = list(sources)  # samples searched again would be other samples: each under its own limit
    tokens_per_batch = max(1, settings.max_tokens // (translator.num_translators * settings.rows_per_source))
    found.update(zip(rescored, _scored(translator, vocab, sources, rescored, settings, tokens_per_batch)))
    limited = ctranslate2_limited(
        translator, vocab, sources, forced, again, own, settings, suppress=settings.sample is not None
    )
    suppressed += [i for i, hyps in limited.items() if _unwanted(vocab, hyps)]
    found.update(limited)
    found.update(ctranslate2_limited(translator, vocab, sources, forced, suppressed, own, settings, suppress=True))
    for i, hyps in found.items():
        out[i] = sorted(hyps, key=lambda h: h.score, reverse=True)[: settings.nbest]
    return out


def _first_calls(
    translator,
    vocab: AnyVocab,
    src_ids: Sequence[Sequence[int]],
    settings: SearchSettings,
    max_positions: int,
    prefixes: Sequence[Sequence[int]] | None,
) -> tuple[dict[int, list[str]], dict[int, list[str]], dict[int, int], list]:
    """The sources in our batches as CTranslate2 takes them (pieces; it appends </s> itself), their forced prefixes
    as pieces, each one's own output-length limit, and the first calls (indices, pending results), one per batch
    with a length penalty, one per limit bucket without (ctranslate2_search); with sampling, none."""
    limit, workers, rows = source_limit(max_positions), translator.num_translators, settings.rows_per_source
    sources: dict[int, list[str]] = {}
    forced: dict[int, list[str]] = {}
    own: dict[int, int] = {}
    calls = []
    for batch in source_batches(src_ids, max_positions, settings.max_tokens, workers, rows):
        for i in batch:
            sources[i] = vocab.pieces(src_ids[i][:limit])
            forced[i] = vocab.pieces(list(prefixes[i])) if prefixes is not None else []
        max_lens = max_output_lengths(
            torch.tensor([len(sources[i]) + 1 for i in batch]),  # + EOS
            settings.max_len_offset,
            max_positions,
        )
        # At least the prefix, as search.max_lengths says.
        max_lens = torch.maximum(max_lens, torch.tensor([len(forced[i]) for i in batch]))
        own.update(zip(batch, max_lens.clamp(max=max_positions - 1).tolist()))
        if settings.sample is not None:
            continue
        buckets = [limit_bucket(own[i], max_positions) for i in batch]
        if settings.lenpen > 0:  # the outcome does not depend on the call's limit (above): one call
            buckets = [max(buckets)] * len(batch)
        for bucket, rows_of in same_limit(buckets):  # asynchronous: every worker takes calls from the queue
            indices = [batch[r] for r in rows_of]
            pending = _translate_async(translator, vocab, sources, forced, indices, settings, bucket, suppress=False)
            calls.append((indices, pending))
    return sources, forced, own, calls


def _unwanted(vocab: AnyVocab, hyps: list[Hypothesis]) -> bool:
    """Whether a hypothesis holds BOS or PAD, which ours never emits."""
    never = {vocab.specials.bos, vocab.specials.pad}
    return any(never.intersection(h.tokens) for h in hyps)


def _outcomes(
    vocab: AnyVocab, calls: list, forced: dict[int, list[str]], own: dict[int, int], settings: SearchSettings
) -> tuple[dict[int, list[Hypothesis]], dict[int, list[Hypothesis]], list[int], list[int]]:
    """The first calls' results, by source index: (those whose search scores are ours, those to score again (a
    prefix's tokens left out, or a setting CTranslate2 renormalises for: ctranslate2_rescores), those to search
    again under their own limit, those to search again with BOS and PAD suppressed)."""
    found: dict[int, list[Hypothesis]] = {}
    rescored: dict[int, list[Hypothesis]] = {}
    renormalised = ctranslate2_rescores(settings)
    again: list[int] = []
    suppressed: list[int] = []
    for indices, pending in calls:
        for i, result in zip(indices, pending):
            hyps = _hypotheses(vocab, result.result(), settings)
            if any(len(h.tokens) >= own[i] - 1 for h in hyps):
                again.append(i)
            elif _unwanted(vocab, hyps):
                suppressed.append(i)
            elif forced[i] or renormalised:
                rescored[i] = hyps
            else:  # every hypothesis ended with EOS: its score is ours
                found[i] = hyps
    return found, rescored, again, suppressed


def ctranslate2_limited(
    translator,
    vocab: AnyVocab,
    sources: dict[int, list[str]],
    prefixes: dict[int, list[str]],
    indices: Sequence[int],
    limits: dict[int, int],
    settings: SearchSettings,
    suppress: bool,
) -> dict[int, list[Hypothesis]]:
    """The sources (pieces, by index) of `indices` searched each under its own length limit (`limits`, by index):
    one call per distinct limit, every returned hypothesis scored again (ours: the EOS that the limit ended
    added), best first. suppress: BOS and PAD are never candidates (_translate_async)."""
    tokens_per_batch = max(1, settings.max_tokens // (translator.num_translators * settings.rows_per_source))
    calls = []
    for max_len, rows in same_limit([limits[i] for i in indices]):
        batch = [indices[r] for r in rows]
        pending = _translate_async(
            translator, vocab, sources, prefixes, batch, settings, max_len, suppress, tokens_per_batch
        )
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
    suppress: bool,
    max_tokens: int = 0,
) -> list:
    """One asynchronous translate_batch call for the sources of `indices` under length limit `max_len`, as ours
    searches: EOS allowed at once, the sources as given (cut already), each one's forced prefix, the hypotheses
    with their EOS (which its penalty then counts, as ours does: an empty output would otherwise rank last,
    divided by 0**lenpen). suppress: BOS and PAD are never candidates (its log-probabilities are then normalised
    over the other tokens; unsuppressed, over all of them, as ours). max_tokens: CTranslate2 splits the sources into batches of
    that many tokens (0: they are one batch)."""
    forced = [prefixes[i] for i in indices]
    never = [[piece] for piece in vocab.pieces(sorted({vocab.specials.bos, vocab.specials.pad}))]
    return translator.translate_batch(
        [sources[i] for i in indices],
        target_prefix=forced if any(forced) else None,
        num_hypotheses=settings.nbest if settings.lenpen == 0 or settings.sample is not None else settings.beam,
        max_decoding_length=max_len,
        suppress_sequences=never if suppress else None,
        min_decoding_length=0,
        return_end_token=True,
        return_scores=True,
        max_input_length=0,
        max_batch_size=max_tokens,
        batch_type="tokens",
        asynchronous=True,
        **ctranslate2_options(settings),
    )


def ctranslate2_options(settings: SearchSettings) -> dict:
    """translate_batch's search options for `settings`: those it takes as they are (settings.ctranslate2_keywords:
    the length penalty, alignments...), and beam search or sampling (top-k 0 is its whole vocabulary)."""
    if settings.sample is None:
        return {**ctranslate2_keywords(settings), "beam_size": settings.beam}
    kind, value = parse_sample(settings.sample)
    return {
        **ctranslate2_keywords(settings),
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
