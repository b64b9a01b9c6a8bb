"""Translation end to end on tiny run directories: the Translator and the `translate` command (arguments, files,
stdin streaming, n-best), dtypes, stop rules and the CTranslate2 engine."""

import json
import os
from dataclasses import replace

import pytest
import torch

from tests.helpers import LINES, SENTENCES, sentences
from transformer.device import (
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_CACHE_VARIABLES,
    bounded_onednn_caches,
    cpu_bf16_flags,
    cpu_description,
    mkl_without_avx512,
)
from transformer.errors import UserError
from transformer.inference import translator as translate
from transformer.inference.batched import search_ids
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator, pick_dtype, translate_ids
from transformer.inference.weight_formats import InputMajorLinear, Int8Linear, PackedLinear
from transformer.model.checkpoint import load_model, save_checkpoint


def test_translate_arguments_keep_order(run, singles, call):
    status, out, _ = call("translate", run, *SENTENCES, "--dtype", "fp32")
    assert status == 0
    assert out.splitlines() == singles
    assert len(set(singles)) > 1  # the sentences do get different translations: the order check means something


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


def test_int8_translation_runs_and_mostly_agrees(run, copy_model, call):
    """On the copy model (each choice far from a tie, whatever the CPU's int8 kernels round)."""
    fp32 = Translator(copy_model, "cpu", SearchFlags(beam=1, dtype="fp32"))
    int8 = Translator(copy_model, "cpu", SearchFlags(beam=1, dtype="int8"))
    lines = sentences(5, 20) + [""]
    a, b = fp32.translate(lines), int8.translate(lines)
    assert len(b) == len(lines) and b[-1] == ""
    assert isinstance(int8.model.output, Int8Linear)  # really the int8 path
    assert isinstance(fp32.model.decoder_layers[0].ffn.fc1, (InputMajorLinear, PackedLinear))  # float as it was
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


def test_mkl_without_avx512_is_an_avx512_cpu_not_made_by_intel(tmp_path):
    info = tmp_path / "cpuinfo"
    cpu = "processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2 {extra}\n"
    for vendor, extra, expected in [
        ("AuthenticAMD", "avx512f avx512_bf16", True),  # Zen 4/5: MKL runs its AVX2 kernels there
        ("AuthenticAMD", "", False),  # AVX2 only: nothing left unused
        ("GenuineIntel", "avx512f amx_bf16", False),  # MKL's own AVX512 kernels
    ]:
        info.write_text(cpu.format(vendor=vendor, extra=extra))
        assert mkl_without_avx512(info) is expected, (vendor, extra)
    assert mkl_without_avx512(tmp_path / "missing") is False


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


def test_text_the_vocabulary_lacks_is_named_from_the_ids_whichever_model_split_them(run):
    vocab = load_model(run)[1]
    assert translate.lacking(vocab, "the dog", vocab.encode(["the dog"])[0]) is None
    text = "the 東京 dog 東 ﬁ"  # a character twice is named once; NFKC's "fi" is spelled by f and i
    assert translate.lacking(vocab, text, vocab.encode([text])[0]) == "characters the vocabulary lacks: '東', '京'"
    # Only the ids are read: an <unk> among pieces that spell every character is a piece the ids lack.
    ids = vocab.encode(["the dog"])[0]
    assert translate.lacking(vocab, "the dog", ids + [vocab.specials.unk]) == "pieces the vocabulary has no id for"
    many = "".join(chr(0x4E00 + i) for i in range(12))
    assert translate.lacking(vocab, many, vocab.encode([many])[0]).endswith("'三' and 2 more")
    translator = Translator(run, "cpu", SearchFlags(dtype="fp32"))
    with pytest.raises(UserError, match=r"^the prefix of input line 7 has characters the vocabulary lacks: '€' \("):
        translator.sentence_options(2, ["the", "a €"], first_line=5)
    with pytest.raises(UserError, match=r"^the constraint '€' of input line 1 has characters"):
        translator.sentence_options(1, constraints=[["dog", "€"]])
    assert translator.sentence_options(1, ["the dog"], [["red"]])[0].constraints


def test_sampling_auto_dtype_is_fp32_even_where_bf16_is_native(copy_model, cpu_with_bf16_flags):
    """In bf16 a seeded sentence's samples depend on its batch: sampling's auto is fp32, said on stderr; an
    explicit bf16 is kept, with a warning that its samples may change with the batching."""
    cpu_with_bf16_flags(["amx_bf16"])
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cpu)[0] == "bf16"  # the fixture at work: search's auto is bf16 here
    assert pick_dtype("auto", cpu, sampling=True) == ("fp32", translate.SAMPLING_DTYPE)
    sampling = Translator(copy_model, "cpu", SearchFlags(dtype="auto", sample="topk:5", seed=1))
    assert sampling.settings.dtype == "fp32" and next(sampling.model.parameters()).dtype == torch.float32
    assert f"dtype: fp32 ({translate.SAMPLING_DTYPE})" in sampling.note
    explicit = Translator(copy_model, "cpu", SearchFlags(dtype="bf16", sample="topk:5", seed=1))
    assert explicit.settings.dtype == "bf16" and translate.SAMPLING_IN.format(dtype="bf16") in explicit.note
    assert "sampling in" not in (Translator(copy_model, "cpu", SearchFlags(dtype="bf16")).note or "")


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
        # Its input-major or packed weights (weight_formats.py) multiply in another order: scores agree to float
        # rounding (a sum of ~10 log-probabilities, each rounded on its own).
        assert [h.score for hyps in found for h in hyps] == pytest.approx(
            [h.score for hyps in expected for h in hyps], rel=1e-6, abs=1e-5
        )
    assert Translator(run, "cpu").settings.stop == "exact"  # decode.stop's default
    status, _, _ = call("evaluate", run, "--split", "test", "--beam", "2", "--stop", "early", "--dtype", "bf16")
    record = json.loads((run / "eval" / "test.beam2.lp0.6.early.bf16.json").read_text())
    assert status == 0 and record["stop"] == "early" and record["dtype"] == "bf16" and record["engine"] == "ours"
    status, _, err = call("translate", run, "--stop", "never", "x")
    assert status == 2 and "--stop" in err


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
    import transformer.serve.server
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
    monkeypatch.setattr(transformer.serve.server, "run_serve", record)
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


def test_a_line_over_the_bound_is_read_up_to_it_with_a_warning(untrained_checkpoint, monkeypatch, capsys):

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


@pytest.mark.usefixtures("hf_offline")
def test_an_imported_models_prefixes_and_constraints_are_split_as_its_targets(marian_dir, tmp_path):
    """A Marian vocabulary has a SentencePiece model per side: prefixes and constraints were split with source.spm
    (an OPUS-MT model forced "yellow" as ▁ y ell o w where its target vocabulary has ▁yellow)."""
    pytest.importorskip("transformers")
    from transformer.inference.hf_import import import_hf

    run, _ = import_hf(marian_dir, tmp_path / "run")
    translator = Translator(run, "cpu", SearchFlags(beam=2))
    vocab = translator.vocab
    prefix, phrase = "the red dog", "blue cat"
    assert vocab.encode_target([prefix]) != vocab.encode([prefix])  # the two sides split it differently
    [options] = translator.sentence_options(1, [prefix], [[phrase]])
    assert options.prefix == tuple(vocab.encode_target([prefix])[0])
    assert options.constraints == (tuple(vocab.encode_target([phrase])[0]),)
    [found] = translator.translate_lines(["der mann sitzt auf dem haus"], [prefix], [[phrase]])
    assert found[0].text.startswith(prefix) and found[0].constrained, found[0]
