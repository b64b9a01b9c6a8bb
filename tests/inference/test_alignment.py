"""Word alignments (alignment.py): on a model that copies by construction they are the diagonal; pieces map to
whitespace words; the command line prints them after each translation."""

from __future__ import annotations

import re

import torch

from tests.helpers import LINES, copying_model
from tests.inference.test_search import VOCAB, make_sources
from transformer.inference.alignment import default_layer, pharaoh, piece_alignments, word_alignments, word_index
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator
from transformer.model.transformer import Transformer


def test_a_copy_models_alignments_are_the_diagonal():
    """Each piece of a copied sentence aligns to the source piece it copies (the model copies by construction,
    attending to the source position of its own index; sources without a repeated piece, where the diagonal is the
    only right answer); an untrained model of the same shape is nowhere near it."""
    copier = copying_model(VOCAB, 16, n_decoder_layers=1)
    sources = [s[:-1] for s in make_sources(11, n=80) if len(set(s)) == len(s)]
    pairs = [(s, s) for s in sources]
    pieces = sum(len(s) for s in sources)

    def on_diagonal(model):
        links = piece_alignments(model, pairs, layer=1)
        return sum(link == i for row in links for i, link in enumerate(row))

    assert len(sources) >= 40 and on_diagonal(copier) == pieces
    torch.manual_seed(0)
    assert on_diagonal(Transformer(copier.cfg, VOCAB).eval()) < 0.6 * pieces


def test_pieces_map_to_whitespace_words():
    source = ["▁Ein", "▁Hund", "▁läuf", "t", "."]  # Ein Hund läuft.
    target = ["▁A", "▁dog", "▁run", "s", "."]  # A dog runs.
    assert word_index(source) == [0, 1, 2, 2, 2] and word_index(["x", "▁y"]) == [0, 1]
    links = [0, 1, 2, 3, 4]  # each target piece to a source piece
    assert word_alignments(source, target, links) == [(0, 0), (1, 1), (2, 2)]
    assert word_alignments(source, target, [1, 0, 2, 2, 4]) == [(0, 1), (1, 0), (2, 2)]
    assert pharaoh([(0, 0), (2, 1)]) == "0-0 2-1" and pharaoh([]) == ""
    assert default_layer(6) == 6


def test_the_translator_gives_each_translation_its_alignment(copy_model):
    translator = Translator(copy_model, "cpu", SearchFlags(alignments=True, beam=2, nbest=2, dtype="fp32"))
    for line, hyps in zip(LINES[:10], translator.translate_lines(LINES[:10])):
        for t in hyps:
            words, outputs = len(line.split()), len(t.text.split())
            assert all(0 <= i < words and 0 <= j < outputs for i, j in t.alignment)
            assert {j for _, j in t.alignment} == set(range(outputs))  # every output word comes from somewhere
    plain = Translator(copy_model, "cpu", SearchFlags(beam=2, nbest=2, dtype="fp32")).translate_lines(LINES[:10])
    assert [[t.text for t in h] for h in plain] == [
        [t.text for t in h] for h in translator.translate_lines(LINES[:10])
    ]  # alignments change no output
    assert all(t.alignment is None for h in plain for t in h)


def test_the_command_line_prints_alignments_after_a_tab(copy_model, call, tmp_path):
    status, out, err = call("translate", copy_model, *LINES[:3], "--alignments", "--dtype", "fp32")
    assert status == 0, err
    for line in out.splitlines():
        text, pairs = line.split("\t")
        assert re.fullmatch(r"(\d+-\d+( \d+-\d+)*)?", pairs), pairs
    status, out, err = call("translate", copy_model, LINES[0], "--alignments", "--nbest", "2", "--beam", "2")
    assert status == 0 and all(len(line.split("\t")) == 3 for line in out.splitlines()), err
    status, out, err = call("translate", copy_model, LINES[0], "--alignments", "--alignment-layer", "3")
    assert (status, err) == (2, "error: --alignment-layer must be at most the model's decoder layers (2), got 3\n")
    status, out, err = call("translate", copy_model, LINES[0], "--alignment-layer", "1")
    assert (status, err) == (2, "error: --alignment-layer goes with --alignments\n")
