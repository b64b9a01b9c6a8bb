"""The search settings' one owner: where each setting comes from (flags > the checkpoint's decode section > config
defaults), every bad value refused in one place with its flag's name, the allowed values defined once, and the
same search options on translate, evaluate and serve."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.helpers import subprocess_env, tiny_config
from transformer.cli.parser import build_parser
from transformer.config import DecodeConfig, from_dict
from transformer.errors import UserError
from transformer.inference import settings as settings_module
from transformer.inference.settings import (
    DTYPES,
    ENGINES,
    FLAGS,
    OPTIONS,
    STOP_RULES,
    SearchFlags,
    SearchSettings,
    Takes,
    ctranslate2_keywords,
    ctranslate2_rescores,
    generate_keywords,
    search_settings,
)
from transformer.inference.translator import Translator
from transformer.model.checkpoint import load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SEARCH_VERBS = ("translate", "evaluate", "serve")

# (field, a value it cannot take, what the error says after the flag's name)
BAD = [
    ("beam", 0, "--beam must be at least 1 (1 = greedy), got 0"),
    ("beam", 2.5, "--beam must be a whole number, got 2.5"),
    ("lenpen", -0.1, "--lenpen must be a number from 0 to 10"),
    ("lenpen", float("nan"), "--lenpen must be a number from 0 to 10"),
    ("stop", "late", "--stop must be one of exact, early, hf, got 'late'"),
    ("no_repeat_ngram_size", -1, "--no-repeat-ngram-size must be at least 0 (0 = off), got -1"),
    ("no_repeat_ngram_size", 1.5, "--no-repeat-ngram-size must be a whole number, got 1.5"),
    ("max_len_offset", 0, "max_len_offset must be at least 1, got 0"),
    ("max_tokens", 0, "--max-tokens must be at least 1, got 0"),
    ("workers", -1, "--workers must be at least 1, got -1"),
    ("dtype", "fp16", "--dtype must be one of auto, fp32, bf16, int8, got 'fp16'"),
    ("engine", "onnx", "--engine must be one of ours, ctranslate2, got 'onnx'"),
    ("nbest", 0, "--nbest must be at least 1, got 0"),
    ("sample", "topk:0", "--sample takes topk:K (K a whole number >= 1) or topp:P (0 < P <= 1), got 'topk:0'"),
    ("sample", "topp:1.5", "--sample takes topk:K (K a whole number >= 1) or topp:P (0 < P <= 1), got 'topp:1.5'"),
    ("sample", "nucleus", "--sample takes topk:K (K a whole number >= 1) or topp:P (0 < P <= 1), got 'nucleus'"),
    ("temperature", 0.0, "--temperature must be a number above 0 and at most 100 (1 = the model's own), got 0.0"),
    ("temperature", float("nan"), "--temperature must be a number above 0 and at most 100"),
    ("seed", -1, "--seed must be a whole number from 0 to"),
    ("alignment_layer", 0, "--alignment-layer must be at least 1, got 0"),
]


def subparser(verb: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[verb]


def search_options(verb: str) -> dict[str, dict]:
    """The options of a verb's "search options" group, each as what argparse does with it."""
    group = next(g for g in subparser(verb)._action_groups if g.title == "search options")
    return {
        a.option_strings[0]: {
            "options": tuple(a.option_strings),
            "dest": a.dest,
            "type": a.type,
            "choices": a.choices,
            "default": a.default,
            "nargs": a.nargs,
            "const": a.const,
            "action": type(a).__name__,
        }
        for a in group._group_actions
    }


# ----------------------------------------------------------------------------- where a setting comes from


def test_flags_win_over_the_checkpoints_decode_section_which_wins_over_the_config_defaults():
    # A decode section that sets the beam and the length penalty (as final.pt's tuned ones) and nothing else.
    decode = from_dict(tiny_config(Path("/nowhere"), decode={"beam": 6, "lenpen": 1.2})).decode
    found = search_settings(decode)
    assert (found.beam, found.lenpen) == (6, 1.2)  # the checkpoint's
    defaults = SearchSettings()
    assert (found.stop, found.max_len_offset, found.max_tokens, found.workers) == (
        DecodeConfig.stop,
        DecodeConfig.max_len_offset,
        DecodeConfig.max_tokens,
        DecodeConfig.workers,
    )
    assert (found.dtype, found.engine, found.nbest) == (defaults.dtype, defaults.engine, defaults.nbest)
    flags = SearchFlags(beam=2, stop="early", workers=1, dtype="int8", nbest=2)
    chosen = search_settings(decode, flags)
    assert (chosen.beam, chosen.stop, chosen.workers, chosen.dtype, chosen.nbest) == (2, "early", 1, "int8", 2)
    assert chosen.lenpen == 1.2  # not given: still the checkpoint's
    assert chosen == dataclasses.replace(found, **flags.given())


def test_a_checkpoints_decode_section_reaches_the_translator_under_the_flags(run, tmp_path):
    """A checkpoint that predates decode.stop and decode.workers, with its own beam and lenpen (as final.pt holds
    the tuned ones): those two from it, the missing keys from config.py, and every flag over both."""
    state = load_checkpoint(run / "best.pt")
    state["config"]["decode"] = {"beam": 2, "lenpen": 1.4, "max_len_offset": 4, "max_tokens": 64}
    save_checkpoint(state, tmp_path / "final.pt")
    settings = Translator(tmp_path / "final.pt", "cpu").settings
    assert settings == SearchSettings(
        beam=2,
        lenpen=1.4,
        max_len_offset=4,
        max_tokens=64,
        stop=DecodeConfig.stop,
        workers=DecodeConfig.workers,
        dtype="fp32",
    )
    flags = SearchFlags(beam=1, lenpen=0.0, stop="early", max_tokens=16, workers=1, nbest=1)
    assert Translator(tmp_path / "final.pt", "cpu", flags).settings == SearchSettings(
        beam=1, lenpen=0.0, stop="early", max_len_offset=4, max_tokens=16, workers=1, dtype="fp32"
    )


def test_the_command_line_resolves_nbest_against_the_checkpoints_beam(run, call):
    """--nbest is checked against the beam the search will use: the checkpoint's (3) unless --beam says otherwise."""
    status, out, err = call("translate", run, "--nbest", "3", "--dtype", "fp32", "ein hund")
    assert status == 0, err
    assert len(out.splitlines()) == 3  # three hypotheses: beam 3 came from the checkpoint
    status, _, err = call("translate", run, "--nbest", "3", "--beam", "2", "ein hund")
    assert (status, err) == (2, "error: --nbest (3) cannot exceed the beam size (2); raise --beam\n")


def test_the_translator_holds_the_dtype_it_picked_never_auto(run):
    translator = Translator(run, "cpu", SearchFlags(dtype="auto"))
    assert translator.settings.dtype in DTYPES and translator.settings.dtype != "auto"
    assert translator.note.startswith(f"dtype: {translator.settings.dtype} (")


# ----------------------------------------------------------------------------- each bad value refused once


@pytest.mark.parametrize("field, value, message", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_each_bad_value_is_refused_in_one_line_naming_its_flag(field, value, message):
    assert message.startswith(FLAGS[field])
    for make in (SearchFlags, SearchSettings):
        with pytest.raises(UserError) as refused:
            make(**{field: value})
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    good = SearchSettings()
    with pytest.raises(UserError, match="^" + re.escape(message)):
        dataclasses.replace(good, **{field: value})  # a settings object cannot be changed into a bad one


def test_what_only_the_combination_or_the_model_can_tell():
    with pytest.raises(UserError, match=r"^--nbest \(3\) cannot exceed the beam size \(2\); raise --beam$"):
        SearchSettings(beam=2, nbest=3)
    SearchFlags(beam=2, nbest=3)  # the beam used may be another: settled by search_settings
    with pytest.raises(UserError, match=r"^--nbest \(5\) cannot exceed the beam size \(4\)"):
        search_settings(DecodeConfig(beam=4), SearchFlags(nbest=5))
    message = r"^--nbest with --sample draws at most 16 samples per sentence, got 1000000; for more, run again with"
    for make in (SearchFlags, SearchSettings):  # before a checkpoint loads, and in what serve and a library make
        with pytest.raises(UserError, match=message):
            make(sample="topk:5", nbest=1_000_000)
        make(sample="topp:0.9", nbest=settings_module.MAX_SAMPLES)
    with pytest.raises(UserError, match=message):
        dataclasses.replace(SearchSettings(sample="topk:5"), nbest=1_000_000)
    with pytest.raises(UserError, match=r"^beam must be at most the vocabulary size \(80 pieces\), got 81$"):
        search_settings(DecodeConfig(), SearchFlags(beam=81), vocab_size=80)
    assert search_settings(DecodeConfig(), SearchFlags(beam=80), vocab_size=80).beam == 80


CLI_BAD = [
    ("--beam", "0", "--beam must be at least 1 (1 = greedy), got 0"),
    ("--lenpen", "11", "--lenpen must be a number from 0 to 10"),
    ("--max-tokens", "0", "--max-tokens must be at least 1, got 0"),
    ("--workers", "0", "--workers must be at least 1, got 0"),
]


def test_translate_refuses_more_samples_than_the_bound_before_it_reads_the_checkpoint(call, tmp_path):
    status, out, err = call("translate", tmp_path / "nowhere", "x", "--sample", "topk:5", "--nbest", "1000000")
    assert (status, out) == (2, "")
    assert err.startswith("error: --nbest with --sample draws at most 16 samples per sentence, got 1000000")


@pytest.mark.parametrize("verb", SEARCH_VERBS)
@pytest.mark.parametrize("flag, value, message", CLI_BAD, ids=[c[0] for c in CLI_BAD])
def test_every_verb_refuses_a_bad_flag_before_it_reads_the_checkpoint(verb, flag, value, message, call, tmp_path):
    """The same one-line error from translate, evaluate and serve, before anything is read: the checkpoint here
    does not exist, and the flag's error is still the one reported."""
    argv = [verb, tmp_path / "nowhere", flag, value] + (["x"] if verb == "translate" else [])
    status, out, err = call(*argv)
    assert (status, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


# ----------------------------------------------------------------------------- one definition of the values


def test_translate_evaluate_and_serve_take_exactly_the_same_search_options():
    options = {verb: search_options(verb) for verb in SEARCH_VERBS}
    assert options["translate"] == options["evaluate"] == options["serve"]
    translate_only = ("max_len_offset", "nbest", "alignments", "alignment_layer")  # outputs of translate's own
    flags = {flag for field, flag in FLAGS.items() if field not in translate_only}
    assert set(options["translate"]) == flags | {"--device", "--int8"}
    # And they reach SearchFlags on each verb: a flag each verb parses into the same value.
    argv = [
        "--beam",
        "2",
        "--lenpen",
        "1",
        "--stop",
        "early",
        "--max-tokens",
        "9",
        "--workers",
        "1",
        "--dtype",
        "int8",
        "--engine",
        "ours",
    ]
    dests = {o["dest"] for o in options["translate"].values()}
    parsed = [
        {k: v for k, v in vars(subparser(verb).parse_args(["CKPT", *argv])).items() if k in dests}
        for verb in SEARCH_VERBS
    ]
    assert parsed[0] == parsed[1] == parsed[2] and parsed[0]["stop"] == "early" and parsed[0]["beam"] == 2


def test_the_parsers_choices_and_the_configs_check_read_the_one_definition():
    options = search_options("translate")
    assert options["--stop"]["choices"] is STOP_RULES
    assert options["--dtype"]["choices"] is DTYPES
    assert options["--engine"]["choices"] is ENGINES
    assert typing.get_args(typing.get_type_hints(DecodeConfig)["stop"]) == STOP_RULES  # decode.stop's check
    assert typing.get_args(settings_module.Dtype) == DTYPES and typing.get_args(settings_module.Engine) == ENGINES


def test_no_module_writes_the_allowed_values_out_again():
    """A tuple, list or set of two or more of a kind's values (stop rules, dtypes, engines) appears in the package
    only where that kind is defined, as its Literal: anywhere else it is a copy that a new value would miss."""
    kinds = {"stop rules": set(STOP_RULES), "dtypes": set(DTYPES), "engines": set(ENGINES)}
    copies = []
    for path in sorted((ROOT / "transformer").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        definitions = {
            id(node.slice)
            for node in ast.walk(tree)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal"
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or id(node) in definitions:
                continue
            values = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            for kind, allowed in kinds.items():
                if len(values) >= 2 and values <= allowed:
                    copies.append(f"{path.relative_to(ROOT)}:{node.lineno}: {kind} {sorted(values)}")
    assert not copies, copies


def test_the_settings_types_agree_with_each_other_and_with_the_decode_section():
    settings_fields = [f.name for f in dataclasses.fields(SearchSettings)]
    assert [f.name for f in dataclasses.fields(SearchFlags)] == settings_fields == list(FLAGS)
    assert {f.name for f in dataclasses.fields(DecodeConfig)} <= set(settings_fields)
    assert all(getattr(SearchSettings(), f.name) == f.default for f in dataclasses.fields(DecodeConfig))
    with pytest.raises(dataclasses.FrozenInstanceError):
        SearchSettings().beam = 2  # type: ignore[misc]


def test_the_settings_and_the_parser_import_no_torch():
    """--help reads the choices from settings.py: neither it nor the parser may pull in torch."""
    code = (
        "import sys\nfrom transformer.cli.parser import build_parser\nbuild_parser()\n"
        "import transformer.inference.settings\nprint('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_describe_names_what_changes_outputs():
    assert SearchSettings(beam=4, lenpen=0.6).describe() == "beam4.lp0.6"
    assert SearchSettings(beam=4, stop="early", dtype="bf16").describe() == "beam4.lp0.6.early.bf16"
    assert SearchSettings(beam=1, stop="early").describe() == "beam1.lp0.6"  # greedy has no stop rule
    assert SearchSettings(beam=4, stop="early", engine="ctranslate2", dtype="int8").describe() == "beam4.lp0.6.int8.ct2"
    assert (
        SearchSettings(stop="early", no_repeat_ngram_size=3, dtype="bf16").describe()
        == "beam4.lp0.6.early.norepeat3.bf16"
    )


def test_no_repeat_ngram_size_is_a_flag_of_every_search_verb(call, tmp_path):
    for verb in ("translate", "evaluate", "synthesize", "serve"):
        argv = ["CKPT", "--no-repeat-ngram-size", "3"] + (
            ["--input", "x", "--out", "y"] if verb == "synthesize" else []
        )
        assert subparser(verb).parse_args(argv).no_repeat_ngram_size == 3
    status, out, err = call("translate", tmp_path / "nowhere", "x", "--no-repeat-ngram-size", "-2")
    assert (status, out, err) == (2, "", "error: --no-repeat-ngram-size must be at least 0 (0 = off), got -2\n")


# ----------------------------------------------------------------------------- the options table


def test_the_table_holds_every_setting_and_each_engine_maps_or_refuses_it():
    """As test_positions does for kinds: each field of SearchSettings has its entry in OPTIONS, and each foreign
    engine takes it under a keyword (one it has), or a line says what stands for it or refuses it."""
    fields = [f.name for f in dataclasses.fields(SearchSettings)]
    assert list(OPTIONS) == fields
    assert {name for name, option in OPTIONS.items() if option.config} == {
        f.name for f in dataclasses.fields(DecodeConfig)
    }
    for name, option in OPTIONS.items():
        for engine in ("ctranslate2", "generate"):
            takes: Takes = getattr(option, engine)
            said = takes.keyword or takes.why or takes.refusal
            assert said and "\n" not in said, (name, engine)
        assert option.check(option.called, getattr(SearchSettings(), name)) is None, name  # the default passes
        assert bool(option.help) == (bool(option.flag) and option.shared), name  # a shared flag says what it is


def test_each_engines_keywords_are_ones_it_has():
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    import ctranslate2
    import transformers

    signature = ctranslate2.Translator.translate_batch.__doc__.splitlines()[0]
    translate_batch = set(re.findall(r"(\w+): ", signature))
    generation = transformers.GenerationConfig()
    for name, option in OPTIONS.items():
        if option.ctranslate2.keyword:
            assert option.ctranslate2.keyword in translate_batch, name
        if option.generate.keyword:
            assert hasattr(generation, option.generate.keyword), name


def test_no_engine_maps_a_search_option_by_hand():
    """What an engine takes as it is comes from the table: the CTranslate2 engine passes no table keyword to
    translate_batch itself, and the hf export writes none into generation_config.json itself."""
    keywords = {o.ctranslate2.keyword for o in OPTIONS.values()} | {o.generate.keyword for o in OPTIONS.values()}
    written = []
    for module in ("ctranslate2_engine", "hf_export"):
        tree = ast.parse((ROOT / "transformer" / "inference" / f"{module}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Call):
                names = [k.arg for k in node.keywords if k.arg]
            elif isinstance(node, ast.Dict):
                names = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            written += [f"{module}:{node.lineno}: {n}" for n in names if n in keywords - {""}]
    assert not written, written


def test_every_stop_rule_goes_to_generate_or_is_refused_in_one_line():
    for rule in STOP_RULES:
        assert generate_keywords(SearchSettings(stop=rule))["early_stopping"] in (True, False, "never")
    unknown = Takes(keyword="early_stopping", values={"exact": "never"})
    patched = dataclasses.replace(OPTIONS["stop"], generate=unknown)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(OPTIONS, "stop", patched)
        with pytest.raises(UserError, match=r"^generate has no equivalent of stop 'early' \(its early_stopping takes"):
            generate_keywords(SearchSettings(stop="early"))


def test_a_refusal_is_one_line_for_a_value_other_than_the_default():
    refusal = "--engine ctranslate2 has no such thing; use --engine ours"
    with pytest.MonkeyPatch.context() as m:
        m.setitem(
            OPTIONS, "temperature", dataclasses.replace(OPTIONS["temperature"], ctranslate2=Takes(refusal=refusal))
        )
        ctranslate2_keywords(SearchSettings())  # the default: nothing to refuse
        with pytest.raises(UserError, match="^" + re.escape(refusal) + "$"):
            ctranslate2_keywords(SearchSettings(sample="topk:2", temperature=0.5))


def test_the_parser_reads_each_flag_and_its_help_from_the_table():
    for verb in ("translate", "evaluate", "synthesize", "serve"):
        group = next(g for g in subparser(verb)._action_groups if g.title == "search options")
        actions = {a.option_strings[0]: a for a in group._group_actions}
        for option in OPTIONS.values():
            if option.flag and option.shared:
                words = (verb == "serve" and option.serve_help) or option.help
                assert actions[option.flag].help == words and actions[option.flag].dest == option.dest
    parsed = subparser("translate").parse_args(["CKPT", "--lenpen-kind", "length", "--temperature", "0.5"])
    assert (parsed.lenpen_kind, parsed.temperature) == ("length", 0.5)


def test_a_setting_ctranslate2_renormalises_for_has_its_hypotheses_scored_again():
    assert not ctranslate2_rescores(SearchSettings(beam=2, lenpen=1.0, temperature=0.5))
    renormalising = dataclasses.replace(
        OPTIONS["lenpen"], ctranslate2=Takes(keyword="length_penalty", renormalises=True)
    )
    with pytest.MonkeyPatch.context() as m:
        m.setitem(OPTIONS, "lenpen", renormalising)
        assert not ctranslate2_rescores(SearchSettings())  # at its default it changes nothing
        assert ctranslate2_rescores(SearchSettings(lenpen=1.0))
