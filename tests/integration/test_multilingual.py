"""A run on several language pairs: the target languages' tokens in the vocabulary and before every source,
validation and the end of training scoring each pair and their mean, the vocabulary's text and the batches shared
among pairs by temperature."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.helpers import WORDS, read_metrics, tiny_config
from transformer.config import from_dict
from transformer.data.mixture import Part
from transformer.data.prepare import prepare, prepare_corpora, tempered
from transformer.data.store import Corpus
from transformer.data.vocab import Vocab
from transformer.errors import UserError
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator
from transformer.training.loop import train


def write_three_way(directory: Path, n_train: int = 120, seed: int = 0) -> Path:
    """train/valid/test in de, en and fr, line for line: en reverses the German words, fr upper-cases them."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("valid", 12), ("test", 10)):
        de = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) for _ in range(n)]
        for lang, lines in (
            ("de", de),
            ("en", [" ".join(reversed(s.split())) for s in de]),
            ("fr", [s.upper() for s in de]),
        ):
            (directory / f"{split}.{lang}").write_text("".join(s + "\n" for s in lines), encoding="utf-8")
    return directory


def multilingual(tmp_path: Path, **train) -> dict:
    corpus = write_three_way(tmp_path / "c")
    fr = {"name": "de-fr", "dir": str(corpus), "tgt_lang": "fr", "valid_split": "valid", "test_split": "test"}
    return tiny_config(
        tmp_path,
        data_dir=corpus,
        data={"corpora": [fr], "vocab_size": 96},
        train={"max_steps": 8, "valid_every": 4, "valid_bleu": True, "valid_bleu_pairs": 6, **train},
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, object]:
    """A finished tiny run of German -> English and French (the run directory, its config)."""
    root = tmp_path_factory.mktemp("multilingual")
    cfg = from_dict(multilingual(root, finish=True, keep_last=2))
    return train(cfg, quiet=True), cfg


def test_every_source_asks_for_its_target_language_and_each_pair_is_scored(trained):
    run_dir, cfg = trained
    assert cfg.data.target_tokens == {"en": ">>en<<", "fr": ">>fr<<"}
    vocab = Vocab.load(run_dir / "spm.model")
    en, fr = vocab.piece_ids([">>en<<", ">>fr<<"])
    assert vocab.specials.unk not in (en, fr)  # each one piece of the vocabulary
    store = prepare(cfg, run_dir, quiet=True)
    [(_, french)] = prepare_corpora(cfg, run_dir, vocab, quiet=True)
    for corpus, token in ((store.corpus("train"), en), (store.corpus("valid"), en), (french.corpus("train"), fr)):
        assert all(corpus.source(i)[0] == token for i in range(len(corpus)))
    valid = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert valid and all(m["bleu"] == pytest.approx((m["bleu_de-en"] + m["bleu_de-fr"]) / 2) for m in valid)
    summary = json.loads((run_dir / "summary.json").read_text())
    pairs = summary["test"]["pairs"]
    assert set(pairs) == {"de-en", "de-fr"}
    assert summary["test"]["bleu"] == pytest.approx((pairs["de-en"]["bleu"] + pairs["de-fr"]["bleu"]) / 2, abs=0.01)
    assert set(summary["test"]["hypotheses"]) == {"de-en", "de-fr"}
    for path in summary["test"]["hypotheses"].values():
        assert len(Path(path).read_text(encoding="utf-8").splitlines()) == 10


def test_a_run_of_one_pair_has_no_target_token():
    cfg = from_dict({"data": {"corpora": [{"name": "more", "dir": "x", "tag": "<bt>"}]}})
    assert cfg.data.target_tokens == {} and cfg.data.tags == ("<bt>",)


@pytest.mark.parametrize("temperature, shares", [(1.0, (0.8, 0.2)), (1e9, (0.5, 0.5)), (2.0, (2 / 3, 1 / 3))])
def test_a_temperature_shares_an_epoch_among_corpora_of_different_sizes(temperature, shares):
    big, small = Corpus.from_pairs([([5], [6])] * 400), Corpus.from_pairs([([5], [6])] * 100)
    parts = tempered([Part("big", big), Part("small", small)], temperature)
    drawn = [p.weight * len(p.corpus) for p in parts]
    assert sum(drawn) == pytest.approx(500)  # an epoch as large as the corpora together
    assert [d / 500 for d in drawn] == pytest.approx(list(shares), rel=1e-6)
    assert tempered([Part("big", big), Part("small", small)], 1.0)[1].weight == 1.0  # 1: exactly as they are


def test_translate_asks_for_a_language_by_flag_or_by_the_lines_token_and_refuses_none(trained, call):
    run_dir, _ = trained
    translator = Translator(run_dir, "cpu", SearchFlags(dtype="fp32"), target_lang="fr")
    en, fr = translator.vocab.piece_ids([">>en<<", ">>fr<<"])
    plain = translator.vocab.encode(["der hund"])[0]
    assert translator.encode(["der hund", ">>en<< der hund", ""]) == [[fr, *plain], [en, *plain], []]
    assert translator.encode(["der hund"], target_lang="en") == [[en, *plain]]
    status, out, err = call("translate", run_dir, "--target-lang", "fr", "--dtype", "fp32", "der hund")
    assert status == 0 and len(out.splitlines()) == 1, err
    for argv, message in [
        (["der hund"], "this model translates into en, fr: give --target-lang"),
        (["--target-lang", "cs", "der hund"], "--target-lang cs: this model translates into en, fr"),
        ([">>cs<< der hund"], "asks for >>cs<<: this model translates into en, fr"),
    ]:
        status, _, err = call("translate", run_dir, "--dtype", "fp32", *argv)
        assert status == 2 and message in err and len(err.splitlines()) == 1, err


def test_evaluate_takes_the_pair_of_the_language_asked(trained, call):
    run_dir, _ = trained
    status, out, err = call("evaluate", run_dir, "--split", "test", "--target-lang", "fr", "--dtype", "fp32")
    assert status == 0, err
    assert list((run_dir / "eval").glob("test.fr.*.json")), sorted(p.name for p in (run_dir / "eval").iterdir())
    status, _, err = call("evaluate", run_dir, "--split", "test", "--dtype", "fp32")  # data.dir's pair by default
    assert status == 0 and list((run_dir / "eval").glob("test.en.*.json")), err


def test_a_model_of_one_target_language_takes_its_own_and_no_other(run):
    assert Translator(run, "cpu", SearchFlags(dtype="fp32"), target_lang="en").target_lang == "en"
    with pytest.raises(UserError, match="--target-lang fr: this model translates into en only"):
        Translator(run, "cpu", SearchFlags(dtype="fp32"), target_lang="fr")


def test_serve_offers_the_languages_and_a_request_asks_for_one(trained):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transformer.serve.app import create_app
    from transformer.serve.service import ServeSettings, Service

    run_dir, _ = trained
    with TestClient(create_app(Service(run_dir, ServeSettings(), "cpu", SearchFlags(dtype="fp32")))) as client:
        info = client.get("/info").json()
        assert info["target_languages"] == ["en", "fr"] and info["target_lang"] is None
        asked = client.post("/translate", json={"text": ["der hund"], "target_lang": "fr"})
        assert asked.status_code == 200 and len(asked.json()["translations"]) == 1
        by_token = client.post("/translate", json={"text": [">>fr<< der hund"]}).json()
        assert by_token["translations"][0]["text"] == asked.json()["translations"][0]["text"]
        for body, message in [
            ({"text": ["der hund"]}, "give --target-lang"),
            ({"text": ["der hund"], "target_lang": "cs"}, "this model translates into en, fr"),
        ]:
            refused = client.post("/translate", json=body)
            assert refused.status_code == 422 and message in refused.json()["error"]


def test_a_multilingual_model_exports_to_marian_and_imports_back_with_its_language_tokens(trained, tmp_path, call):
    """The tokens are ordinary pieces: MarianTokenizer takes >>fr<< at a line's start as OPUS-MT's users write it
    and encodes the rest as we do; the imported run translates what ours translates."""
    transformers = pytest.importorskip("transformers")
    run_dir, _ = trained
    status, _, err = call("export", "hf", run_dir, tmp_path / "hf")
    assert status == 0, err
    tokenizer = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")
    ours = Translator(run_dir, "cpu", SearchFlags(dtype="fp32", beam=1), target_lang="fr")
    lines = ["der hund", "die katze spielt im haus"]
    assert [tokenizer(f">>fr<< {line}")["input_ids"] for line in lines] == [
        ids + [ours.vocab.specials.eos] for ids in ours.encode(lines)
    ]
    status, _, err = call("import", "hf", tmp_path / "hf", tmp_path / "imported")
    assert status == 0, err
    imported = Translator(tmp_path / "imported", "cpu", SearchFlags(dtype="fp32", beam=1), target_lang="fr")
    assert imported.targets == {"en": ">>en<<", "fr": ">>fr<<"}  # its codes, optional as OPUS-MT's are
    assert imported.translate(lines) == ours.translate(lines)
    assert imported.translate([f">>fr<< {line}" for line in lines]) == ours.translate(lines)


def test_what_the_inspections_show_is_the_translation_into_the_language_asked(trained, call, tmp_path):
    from transformer.visualize.attention import inspect_attention
    from transformer.visualize.walkthrough import walk

    run_dir, _ = trained
    translator = Translator(run_dir, "cpu", SearchFlags(beam=1, dtype="fp32"))
    for line, lang in ((">>fr<< der hund", None), ("der hund", "fr"), ("der hund", "en")):
        (text,), (prefix,) = translator.asking([line], lang)
        maps = inspect_attention(translator.model, translator.vocab, text, None, translator.settings, prefix)
        shown = walk(translator.model, translator.vocab, text, translator.settings, only="encoder", prefix=prefix)
        token = f">>{lang or 'fr'}<<"
        assert maps.source_pieces[0] == shown.encoder.pieces[0] == token
        asked = Translator(run_dir, "cpu", SearchFlags(beam=1, dtype="fp32"), target_lang=lang or "fr")
        assert maps.target == asked.translate([text])[0]
    status, out, err = call("attention", run_dir, "der hund", "--target-lang", "fr", "--out", tmp_path / "a.png")
    assert status == 0 and len(out.splitlines()) == 3, err
    status, _, err = call("attention", run_dir, "der hund", "--out", tmp_path / "b.png")
    assert status == 2 and "give --target-lang" in err and len(err.splitlines()) == 1, err


def test_the_page_inspections_ask_for_the_language_as_translate_does(trained):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transformer.serve.app import create_app
    from transformer.serve.service import ServeSettings, Service

    run_dir, _ = trained
    with TestClient(create_app(Service(run_dir, ServeSettings(), "cpu", SearchFlags(dtype="fp32")))) as client:
        for body in ({"text": "der hund", "target_lang": "fr"}, {"text": ">>fr<< der hund"}):
            attention = client.post("/attention", json={**body, "beam": 1}).json()
            translated = client.post("/translate", json={**body, "text": [body["text"]], "beam": 1}).json()
            assert attention["source_pieces"][0] == ">>fr<<" and attention["source"] == "der hund"
            assert attention["target"] == translated["translations"][0]["text"]
            assert client.post("/beam", json=body).json()["source_pieces"][0] == ">>fr<<"
        for path in ("/attention", "/beam", "/animate"):
            refused = client.post(path, json={"text": "der hund"})
            assert refused.status_code == 422 and "give --target-lang" in refused.json()["error"], path
            refused = client.post(path, json={"text": "der hund", "target_lang": "cs"})
            assert refused.status_code == 422 and "this model translates into en, fr" in refused.json()["error"]


def test_evaluate_takes_a_many_to_one_pair_by_its_source_language_or_any_pair_by_its_name(tmp_path, call):
    corpus, other = write_three_way(tmp_path / "c"), write_three_way(tmp_path / "o", seed=1)
    fr = {"name": "fr-en", "dir": str(corpus), "src_lang": "fr", "valid_split": "valid", "test_split": "test"}
    second = {"name": "second", "dir": str(other), "test_split": "test"}  # a second de-en test set
    cfg = from_dict(tiny_config(tmp_path, data_dir=corpus, data={"corpora": [fr, second], "vocab_size": 96}))
    run_dir = train(cfg, quiet=True)
    assert cfg.data.target_tokens == {}  # one target language: no token, so the source picks the pair

    def inputs(glob: str) -> str:  # the digest of the sources and references a result was scored on
        [record] = (run_dir / "eval").glob(f"{glob}.beam*.json")
        return json.loads(record.read_text(encoding="utf-8"))["inputs_sha256"]

    for argv in (
        ["--split", "test", "--source-lang", "fr"],
        ["--src", corpus / "test.fr", "--ref", corpus / "test.en"],
        # The second German test set shares data.dir's languages: only its name picks it, as validation names it.
        ["--split", "test", "--pair", "second"],
        ["--src", other / "test.de", "--ref", other / "test.en"],
        ["--split", "test"],
    ):
        status, _, err = call("evaluate", run_dir, *argv, "--dtype", "fp32")
        assert status == 0, err
    assert inputs("test.fr-en") == inputs("test.fr")  # the French test set itself
    assert inputs("test.second") == inputs("test.de") != inputs("test") != inputs("test.fr")
    [picked] = (run_dir / "eval").glob("test.fr-en.*.hyp")
    for argv, message in [
        (
            ["--split", "test", "--source-lang", "cs"],
            "no pair of this run with a validation or test split is cs-* (its pairs: de-en, fr-en, second)",
        ),
        (
            ["--pair", "cs-en"],
            "no pair of this run with a validation or test split is cs-en (its pairs: de-en, fr-en, second)",
        ),
        (
            ["--src", corpus / "test.fr", "--ref", corpus / "test.en", "--source-lang", "fr"],
            "--source-lang picks a pair",
        ),
        (["--src", corpus / "test.fr", "--ref", corpus / "test.en", "--pair", "fr-en"], "--pair picks a pair"),
        (["--pair", "fr-en", "--source-lang", "fr"], "give it or --source-lang, not both"),
    ]:
        status, _, err = call("evaluate", run_dir, "--dtype", "fp32", *argv)
        assert status == 2 and message in err and len(err.splitlines()) == 1, err
    for flag, value in (("--source-lang", "fr"), ("--pair", "fr-en")):
        status, _, err = call("evaluate", "--hyp", picked, "--ref", corpus / "test.en", flag, value)
        assert status == 2 and f"{flag} picks nothing" in err, err
