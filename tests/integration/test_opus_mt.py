"""An imported OPUS-MT-like model (built in the test, tests/helpers.py's write_marian_dir) through every verb:
translate, evaluate, attention, serve and its page, export ctranslate2 (greedy identical to ours), and
train.init_from: a few updates on a local corpus encoded with its vocabulary, then translate, evaluate, resume."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from tests.helpers import marian_sentences, read_metrics, write_config
from transformer.data.vocab import MarianVocab
from transformer.inference.hf_import import import_hf
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator
from transformer.model.checkpoint import load_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("hf_offline")
LINES = marian_sentences(11, 10)


@pytest.fixture(scope="module")
def imported(marian_dir, tmp_path_factory) -> Path:
    return import_hf(marian_dir, tmp_path_factory.mktemp("opus") / "run")[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """{train,valid,test}.{de,en}: the source words' sentences and, as targets, the target words' ones."""
    directory = tmp_path_factory.mktemp("corpus")
    rng = random.Random(3)
    for split, n in (("train", 96), ("valid", 12), ("test", 12)):
        src = marian_sentences(rng.randrange(1 << 30), n)
        tgt = marian_sentences(rng.randrange(1 << 30), n, target=True)
        (directory / f"{split}.de").write_text("\n".join(src) + "\n", encoding="utf-8")
        (directory / f"{split}.en").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return directory


def ours(run: Path, **flags) -> list[str]:
    return Translator(run, "cpu", SearchFlags(dtype="fp32", **flags)).translate(LINES)


def test_translate_and_evaluate_take_the_imported_run(imported, corpus, call):
    status, out, err = call("translate", imported, *LINES[:3], "--dtype", "fp32")
    assert status == 0 and out.splitlines() == ours(imported)[:3], err
    status, out, err = call(
        "evaluate", imported, "--src", corpus / "test.de", "--ref", corpus / "test.en", "--dtype", "fp32", "--beam", "2"
    )
    assert status == 0 and "BLEU" in out + err, err
    assert any((imported / "eval").iterdir())
    long_line = " ".join(["ein mann"] * 40)  # past the model's own limit, max_positions 64
    status, out, err = call("translate", imported, long_line, "--dtype", "fp32")
    assert status == 0 and "truncated to the first 62 subwords (model.max_positions - 2)" in err


def test_ctranslate2_greedy_is_ours(imported, ctranslate2, tmp_path, call):
    """export ctranslate2 of an imported model (swish, the output bias, the Marian vocabulary starting from <pad>):
    greedy outputs identical to ours, through --engine ctranslate2 and through the exported directory."""
    greedy = ours(imported, beam=1)
    assert ours(imported, beam=1, engine="ctranslate2") == greedy
    status, _, err = call("export", "ctranslate2", imported, tmp_path / "ct2")
    assert status == 0, err
    vocab = MarianVocab.load(tmp_path / "ct2")  # the tokenizer's files travel with the export
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    sources = [vocab.pieces(ids) for ids in vocab.encode(LINES)]
    limit = load_checkpoint(imported / "final.pt")["config"]["model"]["max_positions"] - 1  # ours, for these sources
    found = translator.translate_batch(
        sources, beam_size=1, max_decoding_length=limit, min_decoding_length=0, suppress_sequences=[["<pad>"]]
    )
    model_ids = [vocab.piece_ids(r.hypotheses[0]) for r in found]
    assert vocab.decode(model_ids) == greedy


def test_attention_and_the_page_take_the_imported_run(imported, tmp_path, call):
    status, out, err = call("attention", imported, LINES[0], "--out", tmp_path / "a.png", "--kind", "cross")
    assert status == 0 and out.strip(), err
    from fastapi.testclient import TestClient

    from transformer.serve.app import create_app
    from transformer.serve.service import ServeSettings, Service

    with TestClient(create_app(Service(imported, ServeSettings(), "cpu", SearchFlags(dtype="fp32")))) as client:
        answer = client.post("/translate", json={"text": LINES}).json()
        assert [t["text"] for t in answer["translations"]] == ours(imported)
        maps = client.post("/attention", json={"text": LINES[3], "target": "a dog"}).json()
        assert maps["source_pieces"][-1] == "</s>" and maps["target_pieces"][0] == "<pad>"  # the decoder's start
        assert maps["target_pieces"][1:] == ["▁a", "▁dog"]  # split by target.spm
        trace = client.post("/beam", json={"text": LINES[3], "beam": 2}).json()
        best = client.post("/translate", json={"text": [LINES[3]], "beam": 2}).json()["translations"][0]["text"]
        assert trace["nbest"][0]["text"] == best
        info = client.get("/info").json()
        assert info["decode"]["stop"] == "hf" and info["decode"]["lenpen_kind"] == "length"
        assert client.get("/").status_code == 200


def test_fine_tuning_from_the_imported_model(imported, corpus, tmp_path, call):
    """train.init_from an imported model: the store encoded with its vocabulary (targets by target.spm), a few
    updates, the end of training, then translate and evaluate; --resume continues the run."""
    raw = yaml.safe_load((imported / "config.yaml").read_text())
    raw["data"].update({"dir": str(corpus), "max_tokens": 256, "max_len": 30})
    raw["train"] = {
        "run_dir": str(tmp_path / "ft"),
        "init_from": str(imported),
        "max_steps": 3,
        "valid_every": 3,
        "lr_schedule": "constant",
        "lr": 1e-4,
        "warmup_steps": 0,
        "precision": "fp32",
        "device": "cpu",
    }
    config = write_config(tmp_path / "ft.yaml", raw)
    status, _, err = call("train", config)
    assert status == 0, err
    run = tmp_path / "ft"
    assert MarianVocab.load(run).files == MarianVocab.load(imported).files  # the vocabulary's files, installed
    started = next(m for m in read_metrics(run) if m.get("event") == "init_from")
    assert started["vocab_fit"]["new"]["tgt"]["unknown_pieces_pct"] == 0  # targets split by target.spm
    state = load_checkpoint(run / "last.pt")
    assert state["vocab"] == load_checkpoint(imported / "final.pt")["vocab"] and state["run"]["step"] == 3
    assert (run / "final.pt").is_file()
    status, out, _ = call("translate", run, LINES[0], "--dtype", "fp32")
    assert status == 0 and out.strip() == Translator(run, "cpu", SearchFlags(dtype="fp32")).translate(LINES[:1])[0]
    status, out, err = call("evaluate", run, "--split", "test", "--dtype", "fp32", "--beam", "1")
    assert status == 0, err
    status, _, err = call("train", config, "--resume", "--set", "train.max_steps=5")
    assert status == 0, err
    assert load_checkpoint(run / "last.pt")["run"]["step"] == 5
