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


# --------------------------------------------------------------------------- one very long line


def test_a_stdin_line_is_kept_only_up_to_its_bound():
    """Of each stdin line only its first line_bytes are kept, whatever the pipe's pieces; the lines around a long one
    are whole. (A 20 MB line used to be held whole, then split into subwords: 1.2 GB at its peak.)"""
    import os
    import random
    import threading

    from transformer.cli import translate_io

    rng = random.Random(0)
    lines = [rng.choice(["", "ein hund\r", "zwei kätzchen", "ä" * rng.randrange(1, 3000)]) for _ in range(60)]
    data = "\n".join(lines).encode("utf-8")
    read_end, write_end = os.pipe()

    def write():
        with os.fdopen(write_end, "wb", buffering=0) as f:
            for at in range(0, len(data), 333):
                f.write(data[at : at + 333])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        got = [line for chunk in translate_io._fd_chunks(read_end, line_bytes=1001) for line in chunk]
    finally:
        writer.join()
        os.close(read_end)
    assert got == [translate_io._decode_line(line.encode("utf-8")[:1001]) for line in lines]
    assert any(len(line.encode("utf-8")) > 1001 for line in lines)  # the bound was exercised
    assert translate_io.LINE_BYTES >= 4 * translate_io.MAX_LINE_CHARS  # a cut line is still over what encode reads


def test_a_line_over_the_bound_is_read_up_to_it_with_a_warning(untrained_checkpoint, monkeypatch, capsys):
    from transformer.inference import translator as translate

    translator = Translator(untrained_checkpoint, "cpu", SearchFlags(beam=2))  # its own: warnings stop after five
    monkeypatch.setattr(translate, "MAX_LINE_CHARS", 100)
    lines = ["ein hund", "der mann " * 30, "zwei katzen"]
    ids = translator.encode(lines)
    assert ids == translator.vocab.encode(["ein hund", ("der mann " * 30)[:100], "zwei katzen"])
    err = capsys.readouterr().err
    assert (
        f"warning: input line {translator.lines_seen - 1} has over 100 characters (only those are read); "
        "truncated to the first"
        in err
        and err.count("warning") == 1
    )


def test_one_long_stdin_line_costs_bounded_memory(untrained_checkpoint, tmp_path):
    """Peak memory of `translate` reading one 8 MB line from stdin, less that of one short line: about 60 times the
    line before (a 20 MB line: 1,197 MB against 247 MB), now what MAX_LINE_CHARS costs (20 MB: 299 MB)."""
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    wrapper = (
        "import atexit, resource, sys\n"
        "atexit.register(lambda: print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
        "file=sys.stderr))\n"
        "from transformer import cli\n"
        "cli.main(sys.argv[1:])\n"
    )

    def peak_kib(line: str) -> int:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                wrapper,
                "translate",
                str(untrained_checkpoint),
                "--dtype",
                "fp32",
                "--device",
                "cpu",
            ],
            input=line + "\n",
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return int(done.stderr.rsplit("maxrss", 1)[1])

    long_line = " ".join(["der hund läuft im haus"] * 360_000)  # 8 MB
    extra_mib = (peak_kib(long_line) - peak_kib("ein hund")) / 1024
    assert extra_mib < 150, f"one 8 MB line took {extra_mib:.0f} MiB more than a short one"
