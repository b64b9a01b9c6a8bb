"""Translation end to end on tiny run directories: the Translator and the `translate` command (arguments, files,
stdin streaming, n-best), dtypes, stop rules and the CTranslate2 engine."""

import json
import os
import random
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch

from tests.helpers import LINES, SENTENCES, sentences, subprocess_env
from transformer.cli import translate_io
from transformer.data.vocab import BOS_ID, PAD_ID
from transformer.device import (
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_CACHE_VARIABLES,
    bounded_onednn_caches,
    cpu_bf16_flags,
    cpu_description,
)
from transformer.errors import UserError
from transformer.inference.ctranslate2_engine import ctranslate2_limited, ctranslate2_search, limit_bucket
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator, pick_dtype, search_ids, translate_ids
from transformer.inference.weight_formats import InputMajorLinear
from transformer.model.checkpoint import load_model, save_checkpoint


@pytest.fixture(scope="module")
def singles(run):
    """Each sentence translated alone: what any batching and ordering must reproduce."""
    translator = Translator(run, "cpu")
    return [translator.translate([s])[0] for s in SENTENCES]


def test_translate_arguments_keep_order(run, singles, call):
    status, out, _ = call("translate", run, *SENTENCES)
    assert status == 0
    assert out.splitlines() == singles
    assert len(set(singles)) > 1  # the sentences do get different translations: the order check means something


def test_translate_input_file_with_empty_lines(run, singles, tmp_path, call):
    lines = [SENTENCES[0], "", SENTENCES[1], "   ", SENTENCES[2], ""]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    status, out, _ = call("translate", run, "--input", src, "--output", tmp_path / "out.txt")
    assert status == 0 and out == ""
    got = (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert got == [singles[0], "", singles[1], "", singles[2], ""]


def test_an_argument_that_is_not_utf8_translates_as_the_replacement_character(run, call, tmp_path):
    """b"ein h\\xe4nd" (Latin-1) as an argument reaches Python as "ein h\\udce4nd"; it used to end in a traceback."""
    status, out, err = call("translate", run, "ein h\udce4nd", "zwei katzen")
    assert status == 0 and "Traceback" not in err
    assert out == call("translate", run, "ein h\ufffdnd", "zwei katzen")[1] and len(out.splitlines()) == 2
    status, _, err = call("attention", run, "ein h\udce4nd", "--target", "a d\udcf6g", "--out", tmp_path / "a.png")
    assert status == 0 and "Traceback" not in err


def test_a_checkpoint_with_nan_weights_is_refused_on_load(run, tmp_path, call):
    """Torn bytes inside a checkpoint's tensor data load without complaint; they used to end in an IndexError
    (beam search: no hypothesis ever finished), no output at all (--nbest 2), or lines of unknown pieces (greedy)."""
    state = torch.load(run / "best.pt", weights_only=True)
    state["model"]["decoder_layers.0.ffn.fc1.weight"][0, :3] = float("nan")
    save_checkpoint(state, tmp_path / "nan.pt")
    for flags in ((), ("--nbest", "2"), ("--beam", "1")):
        status, out, err = call("translate", tmp_path / "nan.pt", "ein hund", *flags)
        assert (status, out) == (2, "") and err == (
            "error: checkpoint: 1 weight tensor(s) hold NaN or infinite values "
            "(decoder_layers.0.ffn.fc1.weight): the file is corrupt or its run diverged; use another "
            "checkpoint (step_*.pt, last.pt)\n"
        )


@pytest.mark.parametrize("beam, nbest", [(1, 1), (3, 1), (3, 2)])
def test_scores_that_are_not_numbers_give_an_empty_line_not_a_missing_one(run, beam, nbest, monkeypatch, capsys):
    """What a reduced precision that overflows would give: NaN logits from finite weights. Each sentence gets
    nbest empty translations scored -inf, and a warning (beam search used to finish no hypothesis: an
    IndexError, or no output line at all). Per sentence, so that one sentence cannot fail a batch of others."""
    translator = Translator(run, "cpu", SearchFlags(beam=beam))
    decode = translator.model.decode
    monkeypatch.setattr(translator.model, "decode", lambda *args, **kwargs: decode(*args, **kwargs) * float("nan"))
    capsys.readouterr()
    assert translator.translate_nbest(SENTENCES[:3], nbest=nbest) == [[(float("-inf"), "")] * nbest] * 3
    assert "scores for a sentence are not numbers (NaN)" in capsys.readouterr().err


def test_translate_stdin(run, singles, call):
    status, out, _ = call("translate", run, stdin="\n".join(SENTENCES) + "\n")
    assert status == 0 and out.splitlines() == singles


def test_translate_input_that_is_no_regular_file(run, singles, tmp_path, call):
    """A pipe (what bash's <(zcat x.gz) gives), a FIFO, a device and `-` (stdin) are read like a file, once."""
    read_end, write_end = os.pipe()
    os.write(write_end, ("\n".join(SENTENCES) + "\n").encode("utf-8"))
    os.close(write_end)
    try:
        status, out, err = call("translate", run, "--input", f"/dev/fd/{read_end}")
    finally:
        os.close(read_end)
    assert (status, out.splitlines()) == (0, singles), err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(SENTENCES[0] + "\n",), daemon=True)  # until read
    writer.start()
    try:
        status, out, err = call("translate", run, "--input", fifo)
    finally:
        writer.join(timeout=60)
    assert (status, out.splitlines()) == (0, singles[:1]), err
    assert call("translate", run, "--input", os.devnull)[:2] == (0, "")
    status, out, _ = call("translate", run, "--input", "-", stdin="\n".join(SENTENCES) + "\n")
    assert (status, out.splitlines()) == (0, singles)
    status, _, err = call("translate", run, "--input", tmp_path)
    assert (status, err) == (2, f"error: data: {tmp_path} is a directory, not a file\n")


@pytest.mark.parametrize("seed", range(4))
def test_stdin_lines_do_not_depend_on_how_the_pipe_delivers_them(seed):
    """Lines from standard input equal those of the whole text split on newlines, whatever the sizes of the
    pieces the pipe delivers (a long line spans many reads; pieces end inside lines and inside characters)."""
    rng = random.Random(seed)
    lines = [rng.choice(["", "ein hund\r", "zwei kätzchen", "x" * rng.randrange(1, 300_000)]) for _ in range(40)]
    data = "\n".join(lines).encode("utf-8") + (b"\n" if seed % 2 else b"")
    read_end, write_end = os.pipe()

    def write():
        with os.fdopen(write_end, "wb", buffering=0) as f:
            at = 0
            while at < len(data):
                size = rng.choice([1, 7, 4096, 70_000, 200_000])
                f.write(data[at : at + size])
                at += size

    writer = threading.Thread(target=write)
    writer.start()
    try:
        got = [line for chunk in translate_io._fd_chunks(read_end) for line in chunk]
    finally:
        writer.join()
        os.close(read_end)
    expected = data.decode("utf-8").split("\n")
    if expected[-1] == "":  # a final newline ends the last line; it does not start another
        expected.pop()
    assert got == [line.removesuffix("\r") for line in expected]


def test_translate_stdin_subprocess_streams_line_by_line(run, singles):
    """A real pipe: the first line's translation arrives before the second line is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer", "translate", str(run), "--device", "cpu"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        env=subprocess_env(),
    )
    try:
        proc.stdin.write(SENTENCES[0] + "\n")
        proc.stdin.flush()
        first = proc.stdout.readline().rstrip("\n")
        proc.stdin.write("\n".join(SENTENCES[1:]) + "\n")
        proc.stdin.close()
        rest = proc.stdout.read().splitlines()
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert [first] + rest == singles


def test_nbest_format(run, call):
    status, out, _ = call("translate", run, "--beam", "3", "--nbest", "3", SENTENCES[0], "", SENTENCES[1])
    assert status == 0
    rows = [line.split("\t") for line in out.split("\n")[:-1]]
    assert len(rows) == 9 and all(len(r) == 2 for r in rows)
    for group in (rows[0:3], rows[6:9]):
        scores = [float(r[0]) for r in group]
        assert scores == sorted(scores, reverse=True)
        assert len({r[1] for r in group}) == 3
    assert [r[1] for r in rows[3:6]] == ["", "", ""]


def test_nbest_larger_than_beam_is_an_error(run, call):
    status, _, err = call("translate", run, "--beam", "2", "--nbest", "3", "x")
    assert status == 2 and err.startswith("error:") and "--nbest" in err


def test_long_and_odd_inputs_do_not_crash(run, call):
    long_line = " ".join(["hund katze"] * 60)
    odd = ["\x00\x07 hund\x1b[31m katze", "😀🐕 " * 5, "\u2028 mann\u200b frau \ufeff", "\t"]
    status, out, err = call("translate", run, long_line, *odd)
    assert status == 0
    assert len(out.split("\n")[:-1]) == 1 + len(odd)
    assert "warning" in err and "truncat" in err


def test_translate_ids_keeps_order_and_matches_translator(run):
    model, vocab, cfg = load_model(run)
    lines = [SENTENCES[2], "", SENTENCES[0], SENTENCES[1]]
    reordered = vocab.encode(lines)
    settings = SearchSettings(beam=2, lenpen=0.6, max_len_offset=4, max_tokens=16, workers=1)
    out = translate_ids(model, reordered, settings, device="cpu")
    alone = [translate_ids(model, [s], settings, device="cpu")[0] for s in reordered]
    assert out == alone and out[1] == []
    assert len({tuple(o) for o in out}) > 2  # different translations: a mix-up of the order would show
    # The Translator (the decode settings of the checkpoint: max_len_offset 4) finds the same, as ids and as text.
    translator = Translator(run, "cpu", SearchFlags(beam=2, lenpen=0.6, max_tokens=16))
    assert [hyps[0].tokens for hyps in translator.search(reordered)] == out
    assert translator.translate(lines) == vocab.decode(out)


def test_int8_translation_runs_and_mostly_agrees(run, call):
    fp32 = Translator(run / "best.pt", "cpu", SearchFlags(beam=1))
    int8 = Translator(run / "best.pt", "cpu", SearchFlags(beam=1, dtype="int8"))
    lines = sentences(5, 20) + [""]
    a, b = fp32.translate(lines), int8.translate(lines)
    assert len(b) == len(lines) and b[-1] == ""
    assert isinstance(int8.model.output, torch.ao.nn.quantized.dynamic.Linear)  # really the int8 path
    assert isinstance(fp32.model.output, InputMajorLinear)  # and the float model as it was
    assert sum(x == y for x, y in zip(a, b)) >= len(lines) // 2  # quantization noise flips few argmaxes
    assert call("translate", str(run), "ein hund", "--int8", "--device", "cpu")[0] == 0


# --------------------------------------------------------------------------- dtype, stop rule, engines


def test_cpu_bf16_flags_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert cpu_bf16_flags(info) == []
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_flags(info) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags(tmp_path / "missing") == []


def test_cpu_description_names_the_generation_and_vector_units(tmp_path):
    info = tmp_path / "cpuinfo"
    core = (
        "vendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
        "cache size\t: 512 KB\nflags\t\t: fpu sse2 avx2 {extra}\n\n"
    )
    info.write_text(
        "processor\t: 0\n"
        + core.format(family=25, extra="avx512f avx512_bf16")
        + "processor\t: 1\n"
        + core.format(family=99, extra="")
    )
    assert cpu_description(info) == {
        "model_name": "AMD EPYC",
        "family": "25",
        "model": "1",
        "processors": 2,
        "cache_size": "512 KB",
        "flags": ["avx2", "avx512f", "avx512_bf16"],
    }
    assert cpu_description(tmp_path / "missing") == {}


def test_auto_dtype_is_bf16_only_where_native(monkeypatch, cpu_with_bf16_flags):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cpu_with_bf16_flags([])
    assert pick_dtype("auto", cpu)[0] == "fp32"  # emulated bf16 is far slower than fp32
    cpu_with_bf16_flags(["amx_bf16"])
    assert pick_dtype("auto", cpu) == ("bf16", "auto: this CPU has amx_bf16")
    for supported, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: supported)
        assert pick_dtype("auto", cuda)[0] == expected
    assert pick_dtype("int8", cpu)[0] == "int8"  # an explicit choice is kept


def test_translate_says_which_dtype_auto_picked(run, call, cpu_with_bf16_flags):
    cpu_with_bf16_flags([])
    status, out, err = call("translate", run, "--device", "cpu", SENTENCES[0])
    assert status == 0 and err.splitlines() == [
        "dtype: fp32 (auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16))"
    ]
    cpu_with_bf16_flags(["avx512_bf16"])
    translator = Translator(run, "cpu", SearchFlags(dtype="auto"))
    assert translator.settings.dtype == "bf16" and next(translator.model.parameters()).dtype == torch.bfloat16
    status, _, err = call("translate", run, "--device", "cpu", "--dtype", "fp32", SENTENCES[0])
    assert status == 0 and err == ""  # nothing to say about an explicit choice
    cpu_with_bf16_flags([])
    status, _, err = call("translate", run, "--device", "cpu", "--dtype", "bf16", SENTENCES[0])
    assert status == 0 and err.startswith("warning:") and "emulated" in err  # unless it is a slow choice


@pytest.mark.parametrize("beam", [1, 3])
def test_bf16_translations_are_close_to_fp32(copy_model, beam):
    fp32 = Translator(copy_model, "cpu", SearchFlags(beam=beam)).translate(LINES)
    bf16 = Translator(copy_model, "cpu", SearchFlags(beam=beam, dtype="bf16")).translate(LINES)
    assert sum(a == b for a, b in zip(fp32, bf16)) >= 0.75 * len(LINES)
    assert len(set(fp32)) > len(LINES) // 2  # real, varied translations: the agreement above means something


def test_stop_rule_setting(run, call):
    model, vocab, _ = load_model(run)
    ids = vocab.encode(SENTENCES)
    for stop in ("exact", "early"):
        translator = Translator(run, "cpu", SearchFlags(beam=3, stop=stop))
        assert translator.settings.stop == stop
        settings = SearchSettings(beam=3, lenpen=0.6, max_len_offset=4, max_tokens=64, workers=1, nbest=3, stop=stop)
        found = translator.search(ids, replace(translator.settings, nbest=3))
        expected = search_ids(model, ids, settings, "cpu")
        assert [[h.tokens for h in hyps] for hyps in found] == [[h.tokens for h in hyps] for hyps in expected]
        # Its input-major weights (weight_formats.py) multiply in another order: scores agree to float rounding.
        assert [h.score for hyps in found for h in hyps] == pytest.approx([h.score for hyps in expected for h in hyps])
    assert Translator(run, "cpu").settings.stop == "exact"  # decode.stop's default
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "2", "--stop", "early", "--dtype", "bf16")
    record = json.loads((run / "eval" / "test.beam2.lp0.6.early.bf16.json").read_text())
    assert status == 0 and record["stop"] == "early" and record["dtype"] == "bf16" and record["engine"] == "ours"
    status, _, err = call("translate", run, "--stop", "never", "x")
    assert status == 2 and "--stop" in err


def test_missing_ctranslate2_is_a_one_line_error(run, monkeypatch, call):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 now raises ImportError
    for argv in (
        ("translate", run, "--engine", "ctranslate2", "x"),
        ("evaluate", run, "--engine", "ctranslate2"),
        ("export", "ctranslate2", run, run.parent / "ct2_out"),
    ):
        status, _, err = call(*argv)
        assert status == 2 and len(err.splitlines()) == 1 and "transformer[ctranslate2]" in err, (argv, err)


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


@pytest.mark.parametrize("engine", ["ours", "ctranslate2"])
@pytest.mark.parametrize("beam", [1, 3])
def test_a_sentence_translates_the_same_whatever_shares_its_batch(request, run, engine, beam):
    """Length limits are per sentence in both engines (CTranslate2's is per call: one call per limit), so what
    a sentence gets does not depend on the others batched with it. An untrained model runs to its limits."""
    if engine == "ctranslate2":
        request.getfixturevalue("ctranslate2")
    translator = Translator(run, "cpu", SearchFlags(beam=beam, engine=engine, stop="early", max_tokens=100_000))
    ids = translator.encode(sentences(7, 12, lo=1, hi=9))
    limits = [len(s) + 1 + translator.settings.max_len_offset for s in ids]
    nbest = replace(translator.settings, nbest=beam)
    together = translator.search(ids, nbest)  # one batch
    alone = [translator.search([s], nbest)[0] for s in ids]
    assert len(set(limits)) > 3 and sum(len(h[0].tokens) == n for h, n in zip(together, limits)) >= 3
    for a, b in zip(together, alone):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


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


def test_ctranslate2_engine_auto_dtype_is_one_ctranslate2_computes(
    ctranslate2, copy_model, monkeypatch, call, cpu_with_bf16_flags
):
    """auto means bf16 for our engine on a CPU with native bf16, but CTranslate2's CPU builds compute no bf16:
    the default --dtype must not turn --engine ctranslate2 into an error there."""
    cpu_with_bf16_flags(["amx_bf16"])
    monkeypatch.setattr(ctranslate2, "get_supported_compute_types", lambda device: {"float32", "int8"})
    status, out, err = call("translate", copy_model, "--engine", "ctranslate2", "--beam", "1", LINES[0])
    assert status == 0 and len(out.splitlines()) == 1, err
    assert "dtype: fp32 (auto: CTranslate2 has no bf16 on this cpu)" in err
    assert pick_dtype("auto", torch.device("cpu"))[0] == "bf16"  # ours, on the same CPU
    monkeypatch.setattr(ctranslate2, "get_supported_compute_types", lambda device: {"float32", "bfloat16"})
    assert pick_dtype("auto", torch.device("cpu"), "ctranslate2")[0] == "bf16"


def test_ctranslate2_engine_says_it_ignores_an_exact_stop(ctranslate2, copy_model, call):
    status, out, err = call(
        "translate", copy_model, "--engine", "ctranslate2", "--stop", "exact", "--dtype", "fp32", LINES[0]
    )
    assert status == 0 and len(out.splitlines()) == 1
    assert "--stop exact does not apply to --engine ctranslate2" in err
    for flags in (("--stop", "early"), ()):  # early is what it does; no flag: the checkpoint's default, unasked
        status, _, err = call("translate", copy_model, "--engine", "ctranslate2", *flags, "--dtype", "fp32", LINES[0])
        assert status == 0 and "does not apply" not in err, flags


def test_ctranslate2_engine_nbest_scores_are_ours(ctranslate2, copy_model):
    ours = Translator(copy_model, "cpu", SearchFlags(beam=3, lenpen=0.6)).translate_nbest(LINES[:15], 3)
    theirs = Translator(copy_model, "cpu", SearchFlags(beam=3, lenpen=0.6, engine="ctranslate2"))
    theirs = theirs.translate_nbest(LINES[:15], 3)
    shared = 0
    for mine, other in zip(ours, theirs):
        assert len(other) == 3 and [s for s, _ in other] == sorted((s for s, _ in other), reverse=True)
        scores = dict((text, score) for score, text in mine)
        for score, text in other:
            if text in scores:  # the same hypothesis found by both: the same score definition
                assert score == pytest.approx(scores[text], abs=1e-3)
                shared += 1
    assert shared >= 30  # most hypotheses are found by both, so the score check was not vacuous


def test_ctranslate2_conversion_is_cached_and_follows_the_checkpoint(ctranslate2, copy_model, tmp_path, capsys):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(copy_model.read_bytes())
    first = Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8])
    model_bin = tmp_path / "ct2" / "model" / "model.bin"
    built = model_bin.stat().st_mtime_ns
    assert "converting" in capsys.readouterr().err
    os.utime(checkpoint)  # touched, same bytes: the sha256 says it is current
    assert Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8]) == first
    assert model_bin.stat().st_mtime_ns == built and "converting" not in capsys.readouterr().err
    state = torch.load(checkpoint, weights_only=True)
    state["model"]["output.weight"] = -state["model"]["output.weight"]  # (tied) a different model
    save_checkpoint(state, checkpoint)
    changed = Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8])
    assert "converting" in capsys.readouterr().err
    assert changed == Translator(checkpoint, "cpu", SearchFlags(beam=1)).translate(LINES[:8]) != first
    # Another model of the same size (a retrained run's checkpoints all have one size): the mtime tells.
    size = checkpoint.stat().st_size
    state["model"]["output.weight"] = -state["model"]["output.weight"]
    save_checkpoint(state, checkpoint)
    assert checkpoint.stat().st_size == size
    assert Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8]) == first
    assert "converting" in capsys.readouterr().err
    # A torn conversion (a full disk, a kill of some other tool) is converted again, not an error for ever.
    model_bin.write_bytes(model_bin.read_bytes()[:1000])
    assert Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8]) == first
    assert "converting" in capsys.readouterr().err


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


class CountingCalls:
    """A ctranslate2.Translator that records each translate_batch call: its sentence count and length limit."""

    def __init__(self, ct2):
        self.ct2, self.calls = ct2, []
        self.num_translators = ct2.num_translators

    def translate_batch(self, sources, **options):
        self.calls.append((len(sources), options["max_decoding_length"]))
        return self.ct2.translate_batch(sources, **options)

    def score_batch(self, *args, **options):
        return self.ct2.score_batch(*args, **options)


def own_limits(translator: Translator, ids) -> dict[int, int]:
    cap = translator.cfg.model.max_positions - 1
    return {i: min(len(s) + 1 + translator.settings.max_len_offset, cap) for i, s in enumerate(ids) if s}


@pytest.mark.parametrize("checkpoint", ["run", "copy_model"])
def test_ctranslate2_engine_in_few_calls_is_the_search_under_each_sentences_own_limit(request, ctranslate2, checkpoint):
    """A batch goes as one call per limit bucket, not one per distinct limit; with a length penalty the outcome is
    still each sentence searched under its own limit (one call per limit, as ctranslate2_limited searches), also
    for an untrained model whose sentences run to their limits and are searched again."""
    path = request.getfixturevalue(checkpoint)
    flags = SearchFlags(beam=3, nbest=3, lenpen=0.6, engine="ctranslate2", max_tokens=100_000)  # one batch
    translator = Translator(path, "cpu", flags)
    ids = translator.encode(sentences(3, 24, lo=1, hi=9))
    limits = own_limits(translator, ids)
    counting = CountingCalls(translator.ct2)
    settings = translator.settings
    found = ctranslate2_search(counting, translator.vocab, ids, settings, translator.cfg.model.max_positions)
    vocab = translator.vocab
    sources, none = {i: vocab.pieces(s) for i, s in enumerate(ids)}, {i: [] for i in range(len(ids))}
    one_per_limit = ctranslate2_limited(translator.ct2, vocab, sources, none, list(sources), limits, settings)
    for i, hyps in enumerate(found):
        assert [h.tokens for h in hyps] == [h.tokens for h in one_per_limit[i]], i
        assert [h.score for h in hyps] == pytest.approx([h.score for h in one_per_limit[i]], abs=1e-4)
    first = [limit for _, limit in counting.calls[: len({limit_bucket(n, 40) for n in limits.values()})]]
    assert len(set(limits.values())) > 4 and all(limit == limit_bucket(limit, 40) for limit in first)
    searched_again = sum(n for n, limit in counting.calls if limit != limit_bucket(limit, 40))
    at_limit = sum(len(hyps[0].tokens) == limits[i] for i, hyps in enumerate(found))
    if checkpoint == "run":  # untrained: runs to its limits, so those sentences are searched again
        assert at_limit >= 3 and searched_again >= at_limit
    else:  # trained: every sentence settled in the first calls, one per bucket
        assert searched_again == 0 and len(counting.calls) == len({limit_bucket(n, 40) for n in limits.values()})


def test_ctranslate2_translations_without_scores_are_those_with_scores(ctranslate2, copy_model, call):
    """translate and evaluate show no score, so CTranslate2's search scores rank its hypotheses with no scoring
    pass; n-best lists and serve get ours, computed again. The best translation is the same either way. Its
    search scores leave BOS and PAD out of each step's normalisation, so they are never below ours."""
    translator = Translator(copy_model, "cpu", SearchFlags(beam=4, lenpen=1.0, engine="ctranslate2"))
    ids = translator.encode(LINES)
    unscored, scored = translator.search(ids, scores=False), translator.search(ids)
    assert [h[0].tokens for h in unscored] == [h[0].tokens for h in scored]
    assert all(u[0].score >= s[0].score - 1e-5 for u, s in zip(unscored, scored))
    assert any(u[0].score > s[0].score + 1e-4 for u, s in zip(unscored, scored))  # this model gives BOS some
    assert translator.translate(LINES) == [hyps[0][1] for hyps in translator.translate_nbest(LINES)]


def test_limit_buckets_hold_their_limits():
    for max_positions in (8, 40, 256, 1024):
        for max_len in range(1, max_positions):
            bucket = limit_bucket(max_len, max_positions)
            assert max_len <= bucket <= max_positions - 1
            assert bucket == max_positions - 1 or (bucket & (bucket - 1) == 0 and bucket < 2 * max_len)
    assert len({limit_bucket(n, 256) for n in range(56, 92)}) == 2  # Multi30k's test limits: two calls a batch


def test_output_through_a_symlink_writes_the_target_and_keeps_the_link(run, tmp_path, call):
    real, link = tmp_path / "real.txt", tmp_path / "out.txt"
    real.write_text("old\n", encoding="utf-8")
    link.symlink_to(real)
    status, _, err = call("translate", run, "ein hund", "--output", link)
    assert status == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text(encoding="utf-8") == link.read_text(encoding="utf-8") != "old\n"


def test_load_model_is_in_eval_mode(run):
    """Every caller also sets eval mode itself today; one that did not would translate with dropout on."""
    assert not load_model(run)[0].training


def test_many_long_lines_warn_a_few_times_then_count(run, call, tmp_path):
    long_line = " ".join(["hund katze"] * 60)
    source = tmp_path / "long.de"
    source.write_text("\n".join([long_line] * 8 + ["hund"]) + "\n", encoding="utf-8")
    status, out, err = call("translate", run, "--input", source)
    assert status == 0 and len(out.splitlines()) == 9
    named = [line for line in err.splitlines() if line.startswith("warning: input line")]
    assert [line.split()[3] for line in named] == ["1", "2", "3", "4", "5"], err
    assert "counted at the end" in named[-1]
    assert "warning: 8 of 9 input lines were longer than" in err
    status, _, err = call("translate", run, long_line)  # one long line: its warning, no count
    assert status == 0 and "input line 1 has" in err and "counted" not in err and "of 1 input" not in err
    status, _, err = call("translate", run, *[long_line] * 5)  # exactly five: the count the fifth promised
    assert status == 0 and "counted at the end" in err and "warning: 5 of 5 input lines were longer" in err


# --------------------------------------------------------------------------- oneDNN's caches bounded


def _no_cache_settings(monkeypatch) -> None:
    """None of the capacity variables set, and whatever the test sets undone afterwards."""
    for names in ONEDNN_CACHE_VARIABLES:
        for name in names:
            monkeypatch.setenv(name, "0")  # recorded, so that the teardown removes what the code sets
            monkeypatch.delenv(name)


def test_onednn_cache_capacity_bounded_unless_the_user_set_it():
    environ = {}
    assert bounded_onednn_caches(environ) == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"]
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    assert ONEDNN_CACHE_CAPACITY == 64
    for theirs in ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}, {"DNNL_PRIMITIVE_CACHE_CAPACITY": "0"}):
        environ = {**theirs, "LRU_CACHE_CAPACITY": "7"}
        assert bounded_onednn_caches(environ) == [] and environ == {**theirs, "LRU_CACHE_CAPACITY": "7"}


@pytest.mark.parametrize("verb", ["translate", "evaluate", "serve", "train"])
def test_every_entry_bounds_onednn_caches_before_its_work(run, call, monkeypatch, tmp_path, verb):
    """The commands (and train() and Translator, for a library caller) set the capacities before any work;
    a value of the user's own is kept."""
    import yaml

    import transformer.inference.translator
    import transformer.serve.app
    import transformer.training.loop
    from tests.helpers import tiny_config
    from transformer.config import from_dict

    seen = {}

    class Stop(Exception):
        pass

    def record(*args, **kwargs):
        seen.update({n: os.environ.get(n) for names in ONEDNN_CACHE_VARIABLES for n in names})
        raise Stop

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    # The first step of each after the bound: the work it must precede.
    monkeypatch.setattr(transformer.serve.app, "run_serve", record)
    monkeypatch.setattr(transformer.inference.translator, "pick_device", record)  # Translator (translate, evaluate)
    monkeypatch.setattr(transformer.training.loop, "init_distributed", record)  # train()
    argv = {"translate": (run, "ein hund"), "evaluate": (run,), "serve": (run,), "train": (config,)}[verb]
    bounded = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "DNNL_PRIMITIVE_CACHE_CAPACITY": None}
    for theirs in (None, "1000"):
        _no_cache_settings(monkeypatch)
        if theirs:
            monkeypatch.setenv("LRU_CACHE_CAPACITY", theirs)
        seen.clear()
        with pytest.raises(Stop):
            call(verb, *argv)
        assert seen == {**bounded, "LRU_CACHE_CAPACITY": theirs or "64"}, verb
    # The library entries, without the command line.
    _no_cache_settings(monkeypatch)
    with pytest.raises(Stop):
        transformer.training.loop.train(
            from_dict(tiny_config(tmp_path)), quiet=True
        ) if verb == "train" else Translator(run)
    assert seen == {**bounded, "LRU_CACHE_CAPACITY": "64"}


# ----------------------------------------------------------------------------- issue 43's features on CTranslate2


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
