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


def test_every_source_asks_for_its_target_language_and_each_pair_is_scored(tmp_path):
    raw = multilingual(tmp_path, finish=True, keep_last=2)
    cfg = from_dict(raw)
    assert cfg.data.target_tokens == {"en": ">>en<<", "fr": ">>fr<<"}
    run_dir = train(cfg, quiet=True)
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
