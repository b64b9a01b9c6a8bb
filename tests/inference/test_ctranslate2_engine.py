"""CTranslate2 as an engine (inference/ctranslate2_engine.py): the search through it (greedy equal to ours, beam
outputs where the rules agree, our scores, length limits in few calls, prefixes, sampling, alignments, workers).
The export and the cached conversion: tests/inference/test_ctranslate2_export.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import LINES, sentences
from transformer.data.vocab import BOS_ID, PAD_ID
from transformer.errors import UserError
from transformer.inference.batched import search_ids
from transformer.inference.ctranslate2_engine import (
    ctranslate2_limited,
    ctranslate2_search,
    limit_bucket,
)
from transformer.inference.search import length_penalty
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.checkpoint import load_model, save_checkpoint

ctranslate2 = pytest.importorskip("ctranslate2")


def test_ctranslate2_engine_greedy_equals_ours(ctranslate2, copy_model, capsys, call):
    ours = Translator(copy_model, "cpu", SearchFlags(beam=1)).translate(LINES + [""])
    theirs = Translator(copy_model, "cpu", SearchFlags(beam=1, engine="ctranslate2"))
    assert theirs.translate(LINES + [""]) == ours
    assert ours[-1] == "" and len(set(ours)) > len(LINES) // 2
    # Through the command, with the conversion reused.
    capsys.readouterr()
    status, out, err = call(
        "translate", copy_model, "--beam", "1", "--engine", "ctranslate2", "--dtype", "fp32", *LINES[:5]
    )
    assert status == 0 and out.splitlines() == ours[:5] and "converting" not in err


def test_ctranslate2_engine_never_emits_bos_or_pad(ctranslate2, untrained_checkpoint, tmp_path):
    """Ours never emits BOS or PAD (search.py); CTranslate2 does unless told not to. A model whose output favours
    them (their rows copy the two tokens it emits most, scaled up) shows it: greedy outputs of both engines are
    then the same token ids, and no hypothesis of either holds BOS or PAD."""
    state = torch.load(untrained_checkpoint, weights_only=True)
    ids = Translator(untrained_checkpoint, "cpu", SearchFlags(beam=1)).encode(LINES)
    greedy = SearchSettings(beam=1, lenpen=0.6, max_len_offset=4, max_tokens=64)
    emitted = [t for h in search_ids(model_of(untrained_checkpoint), ids, greedy, "cpu") for t in h[0].tokens]
    first, second = torch.bincount(torch.tensor(emitted)).topk(2).indices.tolist()
    weight = state["model"]["output.weight"]  # tied: the embeddings change too, for both engines alike
    weight[BOS_ID], weight[PAD_ID] = 1.1 * weight[first], 1.1 * weight[second]
    checkpoint = tmp_path / "model.pt"
    save_checkpoint(state, checkpoint)
    theirs = Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2"))
    raw = theirs.ct2.translate_batch([theirs.vocab.pieces(s) for s in ids], beam_size=1, max_decoding_length=20)
    assert sum("<s>" in r.hypotheses[0] for r in raw) > len(ids) // 2  # unsuppressed, it would emit <s>
    ours = Translator(checkpoint, "cpu", SearchFlags(beam=1)).search(ids)
    assert [h[0].tokens for h in theirs.search(ids)] == [h[0].tokens for h in ours]
    wide = Translator(checkpoint, "cpu", SearchFlags(beam=3, nbest=3, engine="ctranslate2"))
    beam = wide.search(ids)
    assert not any({BOS_ID, PAD_ID} & set(h.tokens) for hyps in beam + ours for h in hyps)


def model_of(checkpoint):
    model, _, _ = load_model(checkpoint)
    return model.eval()


def test_ctranslate2_beam_outputs_are_ours_where_the_rules_agree(ctranslate2, copy_model):
    """With a length penalty CTranslate2 stops as our early rule does, and it returns the beam best by its own
    penalty, which are re-ranked by ours: the best one is ours (our early rule's best is the best of all it
    finishes), unless its penalty ranked ours out of its beam, so it is never better. Without a length penalty
    it stops at the exact bound for the best (the best candidate is EOS): ours under the exact rule. Scores:
    the engines' kernels agree to ~1e-5 a token, hence 1e-3."""
    for beam, lenpen, stop in ((3, 0.6, "early"), (4, 1.0, "early"), (3, 0.0, "exact")):
        ours = Translator(copy_model, "cpu", SearchFlags(beam=beam, lenpen=lenpen, stop=stop)).translate_nbest(LINES)
        theirs = Translator(
            copy_model, "cpu", SearchFlags(beam=beam, lenpen=lenpen, engine="ctranslate2")
        ).translate_nbest(LINES)
        same = sum(a[0][1] == b[0][1] for a, b in zip(ours, theirs))
        assert same >= len(LINES) - 1, (beam, lenpen, same)  # measured: 40, 39 (its penalty) and 40 of 40
        for a, b in zip(ours, theirs):
            if a[0][1] == b[0][1]:
                assert a[0][0] == pytest.approx(b[0][0], abs=1e-3)
            else:
                assert b[0][0] <= a[0][0] + 1e-3


def test_ctranslate2_engine_nbest_scores_are_ours(ctranslate2, copy_model):
    ours = Translator(copy_model, "cpu", SearchFlags(beam=3, lenpen=0.6)).translate_nbest(LINES[:15], 3)
    theirs = Translator(copy_model, "cpu", SearchFlags(beam=3, lenpen=0.6, engine="ctranslate2"))
    theirs = theirs.translate_nbest(LINES[:15], 3)
    shared = 0
    for mine, other in zip(ours, theirs):
        assert len(other) == 3 and [s for s, _ in other] == sorted((s for s, _ in other), reverse=True)
        texts = [text for _, text in mine]
        scores = {text: score for score, text in mine if texts.count(text) == 1}  # two hypotheses may read the same
        for score, text in other:
            if text in scores:  # the same hypothesis found by both: the same score definition
                assert score == pytest.approx(scores[text], abs=1e-3)
                shared += 1
    assert shared >= 30  # most hypotheses are found by both, so the score check was not vacuous


def test_ctranslate2_engine_at_the_length_limit(ctranslate2, run):
    """An untrained model runs to its length limits, which differ per sentence but are one per CTranslate2
    call: outputs are cut to each sentence's own limit and rescored, so they still equal ours."""
    lines = sentences(6, 12)
    ours = Translator(run, "cpu", SearchFlags(beam=1))
    theirs = Translator(run, "cpu", SearchFlags(beam=1, engine="ctranslate2"))
    ids = ours.encode(lines)
    mine, other = ours.search(ids), theirs.search(ids)
    limits = [len(s) + 1 + ours.settings.max_len_offset for s in ids]
    assert sum(len(h[0].tokens) == n for h, n in zip(mine, limits)) >= 3  # the limit case is exercised
    assert len(set(limits)) > 1
    for a, b in zip(mine, other):
        assert a[0].tokens == b[0].tokens and a[0].score == pytest.approx(b[0].score, abs=1e-3)


def own_limits(translator: Translator, ids) -> dict[int, int]:
    cap = translator.cfg.model.max_positions - 1
    return {i: min(len(s) + 1 + translator.settings.max_len_offset, cap) for i, s in enumerate(ids) if s}


@pytest.mark.parametrize("lenpen", [0.6, 0.0])
@pytest.mark.parametrize("checkpoint", ["run", "copy_model"])
def test_ctranslate2_engine_in_few_calls_is_the_search_under_each_sentences_own_limit(
    request, ctranslate2, checkpoint, lenpen
):
    """With a length penalty a batch goes as one call, under the largest of its sentences' limit buckets; without
    one, as one call per bucket. Either way the outcome is each sentence's own: with a length penalty its search
    under its own limit (one call per limit, as ctranslate2_limited searches; with BOS and PAD suppressed where a
    hypothesis holds one), also for an untrained model whose sentences run to their limits and are searched again;
    without one, its search alone."""
    path = request.getfixturevalue(checkpoint)
    flags = SearchFlags(beam=3, nbest=3, lenpen=lenpen, engine="ctranslate2", max_tokens=100_000)  # one batch
    translator = Translator(path, "cpu", flags)
    ids = translator.encode(sentences(3, 24, lo=1, hi=9))
    limits = own_limits(translator, ids)
    buckets = {limit_bucket(n, 40) for n in limits.values()}
    assert len(set(limits.values())) > 4 and len(buckets) > 1  # the calls could be several
    counting = CountingCalls(translator.ct2)
    settings, vocab, max_positions = translator.settings, translator.vocab, translator.cfg.model.max_positions
    found = ctranslate2_search(counting, vocab, ids, settings, max_positions)
    if lenpen:
        sources, none = {i: vocab.pieces(s) for i, s in enumerate(ids)}, {i: [] for i in range(len(ids))}
        own = ctranslate2_limited(translator.ct2, vocab, sources, none, list(sources), limits, settings, False)
        never = {vocab.specials.bos, vocab.specials.pad}
        unwanted = [i for i, hyps in own.items() if any(never.intersection(h.tokens) for h in hyps)]
        own.update(ctranslate2_limited(translator.ct2, vocab, sources, none, unwanted, limits, settings, True))
    else:
        own = {i: ctranslate2_search(translator.ct2, vocab, [s], settings, max_positions)[0] for i, s in enumerate(ids)}
    for i, hyps in enumerate(found):
        assert [h.tokens for h in hyps] == [h.tokens for h in own[i]], i
        assert [h.score for h in hyps] == pytest.approx([h.score for h in own[i]], abs=1e-4)
    first = counting.calls[: 1 if lenpen else len(buckets)]
    assert sorted(limit for _, limit in first) == ([max(buckets)] if lenpen else sorted(buckets))
    assert sum(n for n, _ in first) == len(ids)
    searched_again = sum(n for n, _ in counting.calls[len(first) :])
    at_limit = sum(len(hyps[0].tokens) == limits[i] for i, hyps in enumerate(found))
    if checkpoint == "run" and lenpen:  # untrained: runs to its limits, so those sentences are searched again
        assert at_limit >= 3 and searched_again >= at_limit
    elif checkpoint == "copy_model":  # copies by construction: every hypothesis ends at its EOS
        assert searched_again == 0 and counting.scored == 0


def test_ctranslate2_engine_search_scores_are_ours_without_a_scoring_pass(ctranslate2, copy_model):
    """BOS and PAD are not suppressed in its search, so each step is normalised over the whole vocabulary, as ours:
    the scores it searched with are those its scorer gives (ours), and no hypothesis is scored again. Suppressed,
    this model's scores would differ (it gives BOS some probability), so the check is not vacuous."""
    translator = Translator(copy_model, "cpu", SearchFlags(beam=4, nbest=4, lenpen=1.0, engine="ctranslate2"))
    ids, vocab, settings = translator.encode(LINES), translator.vocab, translator.settings
    counting = CountingCalls(translator.ct2)
    found = ctranslate2_search(counting, vocab, ids, settings, translator.cfg.model.max_positions)
    assert counting.scored == 0  # every sentence settled in the first calls: no scoring pass
    sources = {i: vocab.pieces(s) for i, s in enumerate(ids)}
    pairs = [(sources[i], vocab.pieces(h.tokens), h) for i, hyps in enumerate(found) for h in hyps]
    scored = translator.ct2.score_batch([p[0] for p in pairs], [p[1] for p in pairs])
    penalty = [length_penalty(len(h.tokens) + 1, settings.lenpen, settings.lenpen_kind) for _, _, h in pairs]
    assert [h.score for _, _, h in pairs] == pytest.approx(
        [sum(r.log_probs) / lp for r, lp in zip(scored, penalty)], abs=1e-4
    )
    # Suppressed, its search scores are renormalised: above the scorer's wherever BOS and PAD had some.
    raw = translator.ct2.translate_batch(
        list(sources.values()),
        beam_size=4,
        length_penalty=0.0,
        return_scores=True,
        return_end_token=True,
        suppress_sequences=[[piece] for piece in vocab.pieces([BOS_ID, PAD_ID])],
    )
    rescored = translator.ct2.score_batch(list(sources.values()), [r.hypotheses[0][:-1] for r in raw])  # no </s>
    assert all(r.hypotheses[0][-1] == "</s>" for r in raw)
    assert any(r.scores[0] > sum(x.log_probs) + 1e-4 for r, x in zip(raw, rescored))
    assert translator.translate(LINES) == [hyps[0][1] for hyps in translator.translate_nbest(LINES, 1)]


def test_limit_buckets_hold_their_limits():
    for max_positions in (8, 40, 256, 1024):
        for max_len in range(1, max_positions):
            bucket = limit_bucket(max_len, max_positions)
            assert max_len <= bucket <= max_positions - 1
            assert bucket == max_positions - 1 or (bucket & (bucket - 1) == 0 and bucket < 2 * max_len)
    assert len({limit_bucket(n, 256) for n in range(56, 92)}) == 2  # Multi30k's test limits: two buckets


def test_ctranslate2_engine_forces_a_prefix_as_ours_does(ctranslate2, copy_model):
    flags = SearchFlags(beam=1, dtype="fp32")
    ours, theirs = (
        Translator(copy_model, "cpu", flags),
        Translator(copy_model, "cpu", replace(flags, engine="ctranslate2")),
    )
    prefixes = ["der", "", "ein rot", *[line.split()[0] for line in LINES[3:12]]]
    ours_found = ours.translate_lines(LINES[:12], prefixes)
    theirs_found = theirs.translate_lines(LINES[:12], prefixes)
    assert [h[0].text for h in theirs_found] == [h[0].text for h in ours_found]
    assert all(h[0].text.startswith(p) for h, p in zip(ours_found, prefixes))
    assert [h[0].score for h in theirs_found] == pytest.approx([h[0].score for h in ours_found], abs=1e-3)


def test_ctranslate2_engine_samples_and_top_k_1_is_greedy(ctranslate2, copy_model):
    greedy = Translator(copy_model, "cpu", SearchFlags(beam=1, dtype="fp32")).translate(LINES[:10])
    flags = SearchFlags(sample="topk:1", seed=3, dtype="fp32", engine="ctranslate2", workers=1)
    assert Translator(copy_model, "cpu", flags).translate(LINES[:10]) == greedy
    sampler = Translator(copy_model, "cpu", replace(flags, sample="topp:0.95", temperature=2.0, nbest=3))
    drawn = [[t.text for t in hyps] for hyps in sampler.translate_lines(LINES[:10])]
    assert all(len(hyps) == 3 for hyps in drawn) and drawn != [[g] * 3 for g in greedy]
    # A seed repeats a run (the same input, one worker): CTranslate2 seeds a worker's stream when it starts.
    again = Translator(copy_model, "cpu", replace(flags, sample="topp:0.95", temperature=2.0, nbest=3))
    assert [[t.text for t in hyps] for hyps in again.translate_lines(LINES[:10])] == drawn


def test_ctranslate2_engine_gives_our_alignments(ctranslate2, copy_model):
    """return_attention of the conversion is the last layer's cross-attention averaged over all heads, without
    the source's EOS: the same alignments as ours."""
    flags = SearchFlags(beam=1, dtype="fp32", alignments=True)
    ours = Translator(copy_model, "cpu", flags).translate_lines(LINES[:12])
    theirs = Translator(copy_model, "cpu", replace(flags, engine="ctranslate2")).translate_lines(LINES[:12])
    assert [h[0].alignment for h in theirs] == [h[0].alignment for h in ours]
    with pytest.raises(UserError, match=r"^--engine ctranslate2 returns the attention of the last decoder layer \(2\)"):
        Translator(copy_model, "cpu", replace(flags, engine="ctranslate2", alignment_layer=1))
    with pytest.raises(UserError, match="^--engine ctranslate2 has no terminology constraints"):
        Translator(copy_model, "cpu", replace(flags, engine="ctranslate2")).translate_lines(
            ["ein hund"], None, [["dog"]]
        )


class CountingCalls:
    """A ctranslate2.Translator that records each translate_batch call: its sentence count and length limit."""

    def __init__(self, ct2):
        self.ct2, self.calls, self.scored = ct2, [], 0  # scored: hypotheses scored again
        self.num_translators = ct2.num_translators

    def translate_batch(self, sources, **options):
        self.calls.append((len(sources), options["max_decoding_length"]))
        return self.ct2.translate_batch(sources, **options)

    def score_batch(self, sources, *args, **options):
        self.scored += len(sources)
        return self.ct2.score_batch(sources, *args, **options)


def test_ctranslate2_workers_translate_as_one(ctranslate2, copy_model, two_threads):
    one = Translator(copy_model, "cpu", SearchFlags(beam=2, max_tokens=64, engine="ctranslate2", workers=1))
    two = Translator(copy_model, "cpu", SearchFlags(beam=2, max_tokens=64, engine="ctranslate2", workers=2))
    assert (one.ct2.num_translators, two.ct2.num_translators) == (1, 2)
    assert torch.get_num_threads() == 2  # CTranslate2 set the caller's count to its intra_threads, 1
    found_one, found_two = one.translate_nbest(LINES, 2), two.translate_nbest(LINES, 2)
    assert [[text for _, text in hyps] for hyps in found_two] == [[text for _, text in hyps] for hyps in found_one]
    for hyps_two, hyps_one in zip(found_two, found_one):  # other batches: float sums in another order
        assert [score for score, _ in hyps_two] == pytest.approx([score for score, _ in hyps_one], abs=1e-4)
