"""Terminology constraints (constraints.py and translator.run_search): every constrained output contains every
phrase, the exact rule gives what running to the length limit gives, no constraints leave the search unchanged
bit for bit, and constraints that cannot be met give the unconstrained output with a warning."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import SENTENCES
from tests.inference.test_search import as_batch, random_model, random_prefixes, random_sources
from transformer.inference import search as search_module
from transformer.inference.batched import SentenceOptions, run_search
from transformer.inference.constraints import Phrases, constrained_search
from transformer.inference.search import search
from transformer.inference.settings import SearchSettings
from transformer.inference.translator import Translator


def contains(tokens: list[int], phrase: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(phrase)]) == phrase for i in range(len(tokens) - len(phrase) + 1))


def random_constraints(seed: int, vocab: int, n: int) -> list[list[tuple[int, ...]]]:
    """Per sentence 0 to 2 phrases of 1 to 3 random pieces."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrases = int(torch.randint(0, 3, (1,), generator=g))
        out.append(
            [
                tuple(torch.randint(4, vocab, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist())
                for _ in range(phrases)
            ]
        )
    return out


# ----------------------------------------------------------------------------- a hypothesis's progress


def run_through(phrases: Phrases, tokens: list[int]):
    progress = phrases.start()
    for token in tokens:
        progress = phrases.advance(progress, token)
    return progress


def test_progress_counts_met_phrases_and_the_longest_partial_match():
    phrases = Phrases([(5, 6, 7), (9,), (5, 6, 7), ()])  # a duplicate and an empty phrase count once, and not
    assert phrases.phrases == ((5, 6, 7), (9,)) and phrases.pieces == 4
    assert run_through(phrases, [5, 6]).bank == 2
    assert run_through(phrases, [5, 6, 8]).bank == 0  # a broken partial match counts nothing
    assert run_through(phrases, [5, 5, 6]).bank == 2  # ... but its end may start another
    done = run_through(phrases, [4, 5, 6, 7, 4, 9])
    assert done.met == {0, 1} and done.bank == 4 and done.complete(phrases)
    assert run_through(phrases, [9, 5]).bank == 2 and not run_through(phrases, [9, 5]).complete(phrases)
    assert phrases.next_tokens(run_through(phrases, [5, 6])) == {5, 7, 9}  # restart, go on, the other phrase
    assert phrases.next_tokens(done) == set()


def test_overlapping_and_contained_phrases_are_each_met_where_they_appear():
    overlapping = Phrases([(1, 2), (2, 3)])
    assert run_through(overlapping, [1, 2, 3]).complete(overlapping)
    contained = Phrases([(2,), (1, 2, 3)])
    assert run_through(contained, [1, 2, 3]).complete(contained)
    repeated = Phrases([(4, 4, 5)])
    assert run_through(repeated, [4, 4, 4, 5]).complete(repeated)


# ----------------------------------------------------------------------------- the search


@pytest.mark.parametrize("stop", ["exact", "early"])
def test_every_constrained_output_contains_every_phrase(random_seed, stop):
    """Random models, beams, n-best sizes, phrases and prefixes: every hypothesis returned holds every phrase of
    its sentence (and starts with its prefix); most sentences are met (the others come back empty)."""
    rng = torch.Generator().manual_seed(random_seed)
    met = total = 0
    for trial in range(6):
        model = random_model(random_seed + trial)
        vocab = model.output.out_features
        beam = int(torch.randint(1, 6, (1,), generator=rng))
        nbest = int(torch.randint(1, beam + 1, (1,), generator=rng))
        sources = random_sources(random_seed + 70 + trial, vocab, n=6)
        phrases = random_constraints(random_seed + trial, vocab, len(sources))
        prefixes = random_prefixes(random_seed + 30 + trial, vocab, len(sources), longest=2) if trial % 2 else None
        found = constrained_search(
            model,
            as_batch(sources),
            phrases,
            SearchSettings(beam=beam, lenpen=0.6, max_len_offset=8, nbest=nbest, stop=stop),
            prefixes=prefixes,
        )
        for row, hyps in enumerate(found.hypotheses):
            total += 1
            if not hyps:
                continue
            met += 1
            assert len(hyps) <= nbest
            assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
            for h in hyps:
                assert all(contains(h.tokens, phrase) for phrase in phrases[row]), (h.tokens, phrases[row])
                assert prefixes is None or h.tokens[: len(prefixes[row])] == prefixes[row]
    assert met >= 0.8 * total


def test_the_exact_rule_gives_what_running_to_the_length_limit_gives(monkeypatch):
    """The exact rule's promise with constraints: no live hypothesis could have reached the n-best list, so
    stopping changes nothing: the n-best lists equal a search that runs every sentence to its length limit."""
    cases = []
    for seed in range(8):
        model = random_model(seed)
        vocab = model.output.out_features
        sources = random_sources(seed + 5, vocab, n=5)
        cases.append((model, sources, random_constraints(seed + 9, vocab, len(sources)), 1 + seed % 2))
    exact = [
        constrained_search(
            m, as_batch(s), c, SearchSettings(beam=3, lenpen=0.0, max_len_offset=6, nbest=n, stop="exact")
        )
        for m, s, c, n in cases
    ]
    real = search_module.still_searching

    def to_the_limit(alive, finished, best_live, *rest):
        return real(alive, finished, [float("inf")] * len(best_live), *rest)  # the bound never settles

    monkeypatch.setattr(search_module, "still_searching", to_the_limit)
    full = [
        constrained_search(
            m, as_batch(s), c, SearchSettings(beam=3, lenpen=0.0, max_len_offset=6, nbest=n, stop="exact")
        )
        for m, s, c, n in cases
    ]
    stopped_sooner = 0
    for a, b in zip(exact, full):
        assert [[h.tokens for h in hyps] for hyps in a.hypotheses] == [
            [h.tokens for h in hyps] for hyps in b.hypotheses
        ]
        stopped_sooner += sum(x < y for x, y in zip(a.sentence_steps, b.sentence_steps))
    assert stopped_sooner >= 5  # the rule did settle sentences early: the comparison was not vacuous


def test_no_constraints_leave_the_search_unchanged_bit_for_bit(random_seed):
    model = random_model(random_seed)
    src = as_batch(random_sources(random_seed, model.output.out_features, n=6))
    for beam in (1, 3):
        settings = SearchSettings(beam=beam, nbest=beam, max_len_offset=6)
        plain = search(
            model,
            src,
            SearchSettings(beam=beam, lenpen=settings.lenpen, max_len_offset=6, nbest=beam, stop=settings.stop),
        )
        none = run_search(model, src, settings, [SentenceOptions() for _ in range(src.size(0))])
        assert [[(h.tokens, h.score) for h in hyps] for hyps in none.hypotheses] == [
            [(h.tokens, h.score) for h in hyps] for hyps in plain.hypotheses
        ]


def test_a_batch_mixing_constrained_and_free_sentences():
    """The free ones get the plain search's outputs; the constrained ones hold their phrases; the n-best lists keep
    their length (what the limit left short is filled with empty hypotheses of score -inf)."""
    model = random_model(3)
    vocab = model.output.out_features
    sources = random_sources(8, vocab, n=6)
    settings = SearchSettings(beam=3, nbest=2, max_len_offset=6)
    phrases = [[(5, 6)], [], [(7,), (8,)], [], [(9,)], []]
    options = [SentenceOptions(constraints=tuple(p)) for p in phrases]
    found = run_search(model, as_batch(sources), settings, options)
    alone = search(
        model, as_batch([sources[i] for i in (1, 3, 5)]), SearchSettings(beam=3, lenpen=0.6, max_len_offset=6, nbest=2)
    ).hypotheses
    assert [[h.tokens for h in found.hypotheses[i]] for i in (1, 3, 5)] == [[h.tokens for h in a] for a in alone]
    for row in (0, 2, 4):
        hyps = found.hypotheses[row]
        assert len(hyps) == 2
        for h in hyps:
            assert h.score == float("-inf") or all(contains(h.tokens, p) for p in phrases[row])


def test_constraints_that_cannot_be_met_give_the_unconstrained_output_and_a_warning(run, capsys):
    """A phrase longer than the length limit (decode.max_len_offset 4 in the fixture) cannot be met."""
    translator = Translator(run, "cpu")
    lines = SENTENCES[:2]
    found = translator.translate_lines(lines, constraints=[["hund " * 30], []])
    err = capsys.readouterr().err
    assert "input line 1: its translations could not contain every constraint" in err and "line 2" not in err
    free = translator.translate_lines(lines)
    assert [t[0].text for t in found] == [t[0].text for t in free]
    assert [t[0].constrained for t in found] == [False, True]


def test_a_constraint_the_search_meets_appears_in_the_text(run):
    translator = Translator(run, "cpu")
    lines = SENTENCES + ["zwei hunde"]
    found = translator.translate_lines(lines, constraints=[["blue"], ["dog", "red"], [], ["the cat"]])
    for hyps, asked in zip(found, [["blue"], ["dog", "red"], [], ["the cat"]]):
        if hyps[0].constrained:
            assert all(word in hyps[0].text for word in asked), (hyps[0].text, asked)
    assert sum(hyps[0].constrained for hyps in found) >= 3


def test_the_search_takes_one_decoder_call_per_step_for_the_whole_batch():
    """Batched, not one search per sentence: the decoder steps equal the longest sentence's."""
    model = random_model(5)
    sources = random_sources(3, model.output.out_features, n=6)
    found = constrained_search(
        model,
        as_batch(sources),
        [[(4,)]] * 6,
        SearchSettings(beam=3, lenpen=0.6, max_len_offset=5, nbest=1, stop="exact"),
    )
    assert found.steps == max(found.sentence_steps)
