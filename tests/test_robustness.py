"""Property-based: translation never crashes and keeps one output line per input line, whatever the text."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_translate import raw_config, synthetic, write_checkpoint
from transformer.translate import Translator
from transformer.vocab import train_vocab


@pytest.fixture(scope="module")
def translator(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    vocab = train_vocab(synthetic(random.Random(0), 300), vocab_size=80)
    write_checkpoint(root / "model.pt", raw_config(root, root), vocab, seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Translator(root / "model.pt", device="cpu", beam=2)
    torch.set_num_threads(before)


# Any Unicode text a file line can hold: every code point but the line break, surrogates excluded.
line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=60)
odd_lines = st.sampled_from(["", " ", "\t \u00a0", "\u2028", "\x00\x07\x1b[31m", "🙂🐕‍🦺", "日本語のテキスト",
                             "مرحبا بالعالم", "a" * 500, " ".join(["Hund"] * 200)])


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(line_text, odd_lines), min_size=1, max_size=6))
def test_translate_returns_one_line_per_input_line(translator, lines):
    out = translator.translate(lines)
    assert len(out) == len(lines)
    for source, target in zip(lines, out):
        assert isinstance(target, str) and "\n" not in target and "\r" not in target
        if not source.strip():
            assert target == ""  # blank in, blank out


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(line_text, min_size=1, max_size=4), nbest=st.integers(1, 2))
def test_nbest_gives_exactly_n_candidates_per_line(translator, lines, nbest):
    out = translator.translate_nbest(lines, nbest)
    assert [len(c) for c in out] == [nbest] * len(lines)
    for candidates in out:
        scores = [score for score, _ in candidates]
        assert scores == sorted(scores, reverse=True)
