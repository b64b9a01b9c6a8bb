"""Property-based: translation never crashes and keeps one output line per input line, whatever the text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator


@pytest.fixture(scope="module")
def translator(untrained_checkpoint):
    return Translator(untrained_checkpoint, "cpu", SearchFlags(beam=2))


# Any Unicode text a file line can hold: every code point but the line break, surrogates excluded.
line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=60)
odd_lines = st.sampled_from(
    [
        "",
        " ",
        "\t \u00a0",
        "\u2028",
        "\x00\x07\x1b[31m",
        "🙂🐕‍🦺",
        "日本語のテキスト",
        "مرحبا بالعالم",
        "a" * 500,
        " ".join(["Hund"] * 200),
    ]
)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=st.lists(st.one_of(line_text, odd_lines), min_size=1, max_size=6))
def test_translate_returns_one_line_per_input_line(translator, lines):
    out = translator.translate(lines)
    assert len(out) == len(lines)
    for source, target in zip(lines, out):
        assert isinstance(target, str) and "\n" not in target and "\r" not in target
        if not source.strip():
            assert target == ""  # blank in, blank out


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=st.lists(line_text, min_size=1, max_size=4), nbest=st.integers(1, 2))
def test_nbest_gives_exactly_n_candidates_per_line(translator, lines, nbest):
    out = translator.translate_nbest(lines, nbest)
    assert [len(c) for c in out] == [nbest] * len(lines)
    for candidates in out:
        scores = [score for score, _ in candidates]
        assert scores == sorted(scores, reverse=True)
