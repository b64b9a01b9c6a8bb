"""translate's decoding features on the command line: --sample with its seed, --prefix-file and
--constraints-file read line for line beside the input (arguments, --input, stdin), and their one-line refusals."""

from __future__ import annotations

import re

import pytest

from tests.helpers import SENTENCES, sentences

FP32 = ("--dtype", "fp32")


def test_sampling_top_k_1_prints_greedy_search_and_a_seed_repeats_a_run(run, call):
    status, greedy, err = call("translate", run, *SENTENCES, "--beam", "1", *FP32)
    assert status == 0, err
    status, sampled, err = call("translate", run, *SENTENCES, "--sample", "topk:1", *FP32)
    assert status == 0 and sampled == greedy, err
    assert "sampling with seed " in err  # none given: a new one, said so that the run can be repeated
    seed = err.split("sampling with seed ")[1].split()[0]
    runs = [
        call("translate", run, *SENTENCES, "--sample", "topp:0.9", "--nbest", "3", "--seed", s, *FP32)
        for s in (seed, seed)
    ]
    assert runs[0][0] == 0 and runs[0][1] == runs[1][1] and len(runs[0][1].splitlines()) == 9
    assert "sampling with seed" not in runs[0][2]


@pytest.mark.parametrize("dtype", [FP32, ()], ids=["fp32", "auto"])
def test_a_seeded_sentences_samples_do_not_depend_on_the_batching(
    run, call, tmp_path, two_threads, cpu_with_bf16_flags, dtype
):
    """Other --max-tokens and --workers, the same samples, in fp32 and in auto on a CPU that seems to have native
    bf16 (auto is fp32 when sampling: bf16's draws depend on the batch's shape)."""
    cpu_with_bf16_flags(["amx_bf16"])
    source = tmp_path / "in.txt"
    source.write_text("".join(s + "\n" for s in sentences(3, 40)), encoding="utf-8")
    sampled = [
        call("translate", run, "--input", source, "--sample", "topp:0.9", "--seed", "7", "--nbest", "2", *dtype, *more)
        for more in ((), ("--max-tokens", "40", "--workers", "1"), ("--max-tokens", "40", "--workers", "2"))
    ]
    assert all(status == 0 for status, _, _ in sampled), sampled[0][2]
    lines = [[line.split("\t") for line in out.splitlines()] for _, out, _ in sampled]
    assert len(lines[0]) == 80
    for other in lines[1:]:  # the same samples; their scores to float rounding (a sum's order follows the batch)
        assert [text for _, text in other] == [text for _, text in lines[0]]
        assert all(abs(float(a) - float(b)) < 1e-3 for (a, _), (b, _) in zip(other, lines[0]))
    if not dtype:
        assert "dtype: fp32 (auto: fp32 when sampling" in sampled[0][2]


def test_top_k_1_prints_greedy_search_in_bf16_too(run, call):
    status, greedy, err = call("translate", run, *SENTENCES, "--beam", "1", "--dtype", "bf16")
    assert status == 0, err
    status, sampled, err = call("translate", run, *SENTENCES, "--sample", "topk:1", "--dtype", "bf16")
    assert (status, sampled) == (0, greedy), err
    assert "warning: sampling in bf16" in err


@pytest.mark.parametrize(
    "argv",
    [
        ("--sample", "topk:5", "--temperature", "1e-39"),
        ("--sample", "topp:0.9", "--temperature", "1e-300"),
        ("--sample", "topp:1e-46"),
    ],
)
def test_a_tiny_temperature_or_nucleus_prints_greedy_search(run, call, argv):
    """Their limit: greedy search's translations, not a NaN distribution that ran past max_positions."""
    status, greedy, err = call("translate", run, *SENTENCES, "--beam", "1", *FP32)
    assert status == 0, err
    status, sampled, err = call("translate", run, *SENTENCES, *argv, "--seed", "1", *FP32)
    assert (status, sampled) == (0, greedy), err


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--sample", "topk:3", "--beam", "4"), "--sample draws each token; it cannot go with --beam 4"),
        (("--sample", "top:3"), "--sample takes topk:K"),
        (("--temperature", "0.5"), "--temperature goes with --sample topk:K or --sample topp:P"),
        (("--seed", "1"), "--seed goes with --sample"),
        (("--sample", "topk:2", "--stop", "early"), "--stop is beam search's"),
        (("--sample", "topk:2", "--temperature", "0"), "--temperature must be a number above 0"),
    ],
)
def test_sampling_flags_are_refused_in_one_line(run, call, argv, message):
    status, out, err = call("translate", run, "ein hund", *argv)
    assert (status, out) == (2, "") and err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_a_prefix_file_starts_each_translation_with_its_line(run, call, tmp_path):
    prefixes = tmp_path / "prefixes.txt"
    prefixes.write_text("the dog\n\nblue red\n", encoding="utf-8")
    status, plain, err = call("translate", run, *SENTENCES, *FP32)
    assert status == 0, err
    status, out, err = call("translate", run, *SENTENCES, "--prefix-file", prefixes, *FP32)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("the dog") and lines[2].startswith("blue red")
    assert lines[1] == plain.splitlines()[1]  # an empty line: no prefix
    # The same through --input and through stdin, read chunk by chunk beside the prefixes.
    source = tmp_path / "in.txt"
    source.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    assert call("translate", run, "--input", source, "--prefix-file", prefixes, *FP32)[1] == out
    assert call("translate", run, "--prefix-file", prefixes, *FP32, stdin=source.read_text())[1] == out


def test_a_constraints_file_puts_its_phrases_in_each_translation(run, call, tmp_path):
    constraints = tmp_path / "constraints.tsv"
    constraints.write_text("dog\tred\n\nthe cat\n", encoding="utf-8")
    status, out, err = call("translate", run, *SENTENCES, "--constraints-file", constraints, "--nbest", "2", *FP32)
    assert status == 0, err
    lines = [line.split("\t") for line in out.splitlines()]
    assert len(lines) == 6
    unmet = {int(n) for n in re.findall(r"input line (\d+): its translations could not", err)}
    for (score, text), phrases in zip(lines, [["dog", "red"]] * 2 + [[]] * 2 + [["the cat"]] * 2):
        sentence = 1 + [["dog", "red"], [], ["the cat"]].index(phrases)
        if sentence not in unmet and score != "-inf":
            assert all(p in text for p in phrases), (text, phrases)


@pytest.mark.parametrize("flag", ["--prefix-file", "--constraints-file"])
def test_a_line_file_needs_one_line_per_input_line(run, call, tmp_path, flag):
    short = tmp_path / "short.txt"
    short.write_text("a\n", encoding="utf-8")
    status, out, err = call("translate", run, *SENTENCES, flag, short)
    assert (status, out) == (2, "")
    assert (
        err
        == f"error: translate: {flag} {short} has 1 lines for 3 input lines; it needs one per input line (an empty line where a sentence has none)\n"
    )
    status, out, err = call("translate", run, flag, short, *FP32, stdin="ein hund\nzwei katzen\n")
    assert status == 2 and f"{flag} {short} has 1 lines, and the input goes on past them" in err
    status, out, err = call("translate", run, flag, short, *FP32, stdin="")
    assert status == 2 and "has 1 lines for 0 input lines" in err


def test_constraints_go_with_beam_search_and_our_engine(run, call, tmp_path):
    constraints = tmp_path / "c.tsv"
    constraints.write_text("dog\n", encoding="utf-8")
    status, _, err = call("translate", run, "ein hund", "--constraints-file", constraints, "--sample", "topk:3")
    assert (status, err) == (2, "error: translate: --constraints-file needs beam search; it cannot go with --sample\n")
    status, _, err = call("translate", run, "ein hund", "--constraints-file", constraints, "--engine", "ctranslate2")
    assert (
        status == 2
        and err == "error: translate: --engine ctranslate2 has no terminology constraints; use --engine ours\n"
    )


@pytest.mark.parametrize(
    "flag, text, message",
    [
        (
            "--prefix-file",
            "the dog\n\nthe 東京 dog\n",
            "the prefix of input line 3 has characters the vocabulary lacks: '東', '京'",
        ),
        (
            "--constraints-file",
            "dog\n€\n\n",
            "the constraint '€' of input line 2 has characters the vocabulary lacks: '€'",
        ),
    ],
)
def test_a_prefix_or_constraint_the_vocabulary_cannot_spell_is_refused_before_anything_is_written(
    run, call, tmp_path, flag, text, message
):
    """Not forced as <unk> (⁇ in the output, and "met"): refused in one line naming the characters, whether the
    input comes as arguments, a file or stdin, and --output is never begun."""
    line_file, source, output = tmp_path / "lines.txt", tmp_path / "in.txt", tmp_path / "out.txt"
    line_file.write_text(text, encoding="utf-8")
    source.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    for argv, stdin in (
        ((*SENTENCES,), None),
        (("--input", source, "--output", output), None),
        ((), source.read_text()),
    ):
        status, out, err = call("translate", run, *argv, flag, line_file, *FP32, stdin=stdin)
        assert (status, out) == (2, "") and err.startswith(f"error: {message} (") and err.count("\n") == 1, err
    assert not output.exists() and not (tmp_path / "out.txt.partial").exists()
