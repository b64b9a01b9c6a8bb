"""Preparing a run's data (prepare.py): the prepare command, the store used without its raw corpus, the vocabulary
trained (on a sample) or reused, taken from another run with the tags it lacks; data.corpora's stores, shared and
reused, tagged; the mixture training draws from them."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.test_store import config
from tests.helpers import tiny_config, write_corpus
from transformer.config import Config, from_dict
from transformer.data.corpus import read_lines
from transformer.data.prepare import STORES, eval_pairs, open_prepared, pair_data, prepare, prepare_corpora
from transformer.data.store import BUILDING, FORMAT
from transformer.data.vocab import Vocab
from transformer.errors import UserError


def test_prepare_command_then_train_reuses_the_store(tmp_path, corpus, call):
    raw = tiny_config(tmp_path, data_dir=corpus, train={"max_steps": 2, "valid_every": 2})
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(raw), encoding="utf-8")
    status, out, err = call("prepare", path)
    assert status == 0, err
    assert out.strip() == str(tmp_path / "run" / "store")
    assert "store: preparing" in err
    status, _, err = call("train", path)
    assert status == 0, err
    assert "vocab: reusing" in err and "store: reusing" in err


def test_a_complete_store_is_used_without_the_raw_corpus(tmp_path, corpus, caplog):
    """Prepare once, train anywhere: a machine given only the run directory (or a corpus moved away) trains
    from the store, with a warning; a store encoded with other data settings is not used."""
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    built = prepare(cfg, run_dir, quiet=True)
    pairs = [built.corpus("train").pair(i) for i in range(len(built.corpus("train")))]
    corpus.rename(tmp_path / "elsewhere")
    caplog.set_level(logging.WARNING, logger="transformer")
    store = prepare(cfg, run_dir, quiet=True)
    assert [store.corpus("train").pair(i) for i in range(len(store.corpus("train")))] == pairs
    assert f"using the prepared store {run_dir / 'store'}" in caplog.text and "no such file" in caplog.text
    vocab = Vocab.load(run_dir / "spm.model")
    assert open_prepared(cfg, run_dir, vocab).manifest == store.manifest  # the other ranks
    for changed in ({"max_len": 5}, {"max_train_pairs": 100}, {"train_split": "trian"}):
        with pytest.raises(UserError, match="no such file"):
            prepare(config(tmp_path, corpus, **changed), run_dir, quiet=True)
    # A data.dir that is there but lacks a file (a new corpus without its valid split): reported, not replaced.
    other = tmp_path / "new_corpus"
    other.mkdir()
    for side in ("de", "en"):
        (other / f"train.{side}").write_text("ein hund\n", encoding="utf-8")
    with pytest.raises(UserError, match="valid"):
        prepare(from_dict(tiny_config(tmp_path, data_dir=other, data={"max_len": 6})), run_dir, quiet=True)
    (run_dir / "store" / "manifest.json").unlink()
    with pytest.raises(UserError, match="no such file"):
        prepare(cfg, run_dir, quiet=True)


@pytest.mark.parametrize(
    "spm_max_sentences, said", [(0, "on the 606 training"), (200, "on a sample of 200 of the 606")]
)
def test_the_vocabulary_log_says_whether_it_trains_on_a_sample(tmp_path, corpus, caplog, spm_max_sentences, said):
    caplog.set_level(logging.INFO, logger="transformer")
    cfg = config(tmp_path, corpus, spm_max_sentences=spm_max_sentences)
    prepare(cfg, Path(cfg.train.run_dir), quiet=True)
    assert said in caplog.text


def test_a_sample_sentencepiece_refuses_is_a_clear_error_only_where_a_vocabulary_is_trained(tmp_path, corpus):
    cfg = config(tmp_path, corpus, spm_max_sentences=100)  # SentencePiece: INTERNAL error in trainer_interface.cc
    with pytest.raises(UserError, match=r"spm_max_sentences must be 0 \(every sentence\) or above 100 .*got 100"):
        prepare(cfg, Path(cfg.train.run_dir), quiet=True)
    reused = config(tmp_path, corpus)
    prepare(reused, Path(reused.train.run_dir), quiet=True)
    prepare(cfg, Path(cfg.train.run_dir), quiet=True)  # the vocabulary is reused: the setting plays no part


def test_half_a_test_split_is_refused_at_the_start_when_training_will_score_it(tmp_path):
    """The end of training scores the test split; one side's file missing is said before the vocabulary and
    store are built, not when training ends. With train.finish off nothing reads it."""
    corpus = write_corpus(tmp_path / "c", n_train=50, n_valid=8)
    (corpus / "test.de").write_text("ein satz\n", encoding="utf-8")
    with pytest.raises(UserError, match="no such file: .*test.en"):
        prepare(from_dict(tiny_config(tmp_path, data_dir=corpus, train={"finish": True})), tmp_path / "run")
    assert not (tmp_path / "run" / "spm.model").exists()
    prepare(from_dict(tiny_config(tmp_path, data_dir=corpus, train={"finish": False})), tmp_path / "run")


# --------------------------------------------------------------------------- data.corpora


def with_corpora(tmp_path: Path, corpus: Path, run: str = "run", **data) -> Config:
    """config() of `run`, with one more corpus: 120 pairs of other sentences, half of them an epoch, tagged <bt>."""
    extra = tmp_path / "extra"
    if not extra.exists():
        write_corpus(extra, n_train=120, n_valid=1, seed=9)
    corpora = [{"name": "bt", "dir": str(extra), "weight": 0.5, "tag": "<bt>"}]
    return from_dict(tiny_config(tmp_path, run, data_dir=corpus, data={"max_len": 6, "corpora": corpora, **data}))


def test_a_corpus_is_prepared_once_with_its_tag_before_each_source_and_shared_by_the_runs_naming_it(
    tmp_path, corpus, caplog
):
    cfg = with_corpora(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)
    vocab = Vocab.load(run_dir / "spm.model")
    [tag] = vocab.piece_ids(["<bt>"])
    assert tag != vocab.specials.unk  # trained with the tag reserved: one piece
    [(corpus_cfg, store)] = prepare_corpora(cfg, run_dir, vocab, quiet=True)
    assert corpus_cfg.name == "bt" and store.directory.parent == tmp_path / STORES
    lines = read_lines(tmp_path / "extra" / "train.de")
    expected = [
        s
        for s, t in zip(vocab.encode(lines), vocab.encode(read_lines(tmp_path / "extra" / "train.en")))
        if 0 < len(s) <= 6 and 0 < len(t) <= 6
    ]
    train = store.corpus("train")
    assert [train.source(i) for i in range(len(train))] == [[tag, *s] for s in expected]
    assert all(tag not in store.corpus("train").pair(i)[1] for i in range(len(train)))  # targets untagged
    caplog.set_level(logging.INFO, logger="transformer")
    other = with_corpora(tmp_path, corpus, "run2", vocab_from=str(run_dir))  # the same vocabulary, taken
    prepare(other, Path(other.train.run_dir), quiet=True)
    [(_, reused)] = prepare_corpora(other, Path(other.train.run_dir), Vocab.load(tmp_path / "run2" / "spm.model"))
    assert reused.directory == store.directory and f"bt: reusing {store.directory}" in caplog.text
    assert [p.name for p in (tmp_path / STORES).iterdir()] == [store.directory.name]


def test_a_vocabulary_taken_from_a_run_gains_the_tags_it_lacks_and_a_trained_model_cannot(tmp_path, corpus):
    plain = config(tmp_path, corpus)
    prepare(plain, tmp_path / "run", quiet=True)
    base = Vocab.load(tmp_path / "run" / "spm.model")
    assert base.piece_ids(["<bt>"]) == [base.specials.unk]
    cfg = with_corpora(tmp_path, corpus, "tagged", vocab_from=str(tmp_path / "run"))
    prepare(cfg, tmp_path / "tagged", quiet=True)
    taken = Vocab.load(tmp_path / "tagged" / "spm.model")
    assert len(taken) == len(base) + 1 and taken.piece_ids(["<bt>"]) == [len(base)]
    assert taken.encode(["der hund läuft"]) == base.encode(["der hund läuft"])  # the rest as it was
    # A run (or a model it starts from) whose vocabulary lacks the tag: refused, nothing replaced.
    with pytest.raises(UserError, match=r"the tag '<bt>' is not a piece of this run's vocabulary .*start a new run"):
        prepare(with_corpora(tmp_path, corpus), tmp_path / "run", quiet=True)
    with pytest.raises(UserError, match="the tag '<bt>' is not a piece of the vocabulary of the model"):
        prepare(with_corpora(tmp_path, corpus, "fresh"), tmp_path / "fresh", base, quiet=True)
    assert Vocab.load(tmp_path / "run" / "spm.model").proto == base.proto


def test_a_folder_at_a_corpus_stores_place_that_is_not_ours_stays_and_a_killed_builds_leftover_goes(tmp_path, corpus):
    cfg = with_corpora(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)
    vocab = Vocab.load(run_dir / "spm.model")
    [(_, store)] = prepare_corpora(cfg, run_dir, vocab, quiet=True)
    directory = store.directory
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = directory.parent / f".{directory.name}.building-{int(dead.stdout)}"
    leftover.mkdir()
    (leftover / BUILDING).write_text(json.dumps({"format": FORMAT}))
    (leftover / "train.src.bin").write_bytes(b"\0" * 10)
    shutil.rmtree(directory)
    directory.mkdir()
    (directory / "notes.txt").write_text("mine")  # a user's folder where the store would go
    with pytest.raises(UserError, match="never deleted"):
        prepare_corpora(cfg, run_dir, vocab, quiet=True)
    assert (directory / "notes.txt").read_text() == "mine"
    (directory / "notes.txt").unlink()
    directory.rmdir()
    prepare_corpora(cfg, run_dir, vocab, quiet=True)
    assert not leftover.exists() and (directory / "manifest.json").is_file()


def test_pair_data_picks_a_pair_by_its_target_its_source_or_both():
    one_to_many = from_dict(
        {
            "data": {
                "dir": "m",
                "src_lang": "en",
                "tgt_lang": "de",
                "corpora": [
                    {"name": "en-fr", "dir": "m", "tgt_lang": "fr", "test_split": "test"},
                ],
            }
        }
    ).data
    many_to_one = from_dict(
        {
            "data": {
                "dir": "m",
                "src_lang": "de",
                "tgt_lang": "en",
                "corpora": [
                    {"name": "fr-en", "dir": "f", "src_lang": "fr", "test_split": "test2016"},
                    {"name": "cs-en", "dir": "c", "src_lang": "cs"},  # no split to score: not a pair to evaluate
                ],
            }
        }
    ).data
    assert pair_data(one_to_many, None) is one_to_many and pair_data(one_to_many, "de") is one_to_many
    assert (pair_data(one_to_many, "fr").src_lang, pair_data(one_to_many, "fr").tgt_lang) == ("en", "fr")
    assert pair_data(many_to_one, "en") is many_to_one and pair_data(many_to_one, None, "de") is many_to_one
    french = pair_data(many_to_one, "en", "fr")
    assert (french.dir, french.src_lang, french.tgt_lang, french.test_split) == ("f", "fr", "en", "test2016")
    assert pair_data(many_to_one, None, "fr") == french
    for target, source in (("fr", None), (None, "cs"), ("de", "fr")):
        with pytest.raises(UserError, match=r"no pair of this run .* \(its pairs: de-en, fr-en\)"):
            pair_data(many_to_one, target, source)


def test_a_second_test_set_named_as_another_set_of_the_run_is_refused_before_one_overwrites_the_other():
    """A second de-en test set is scored under its corpus's name: named "de-en", or "fr-en" beside a French pair,
    it would share a name with another set, and one's scores and translations would overwrite the other's; named
    "fr-en" before the French pair, or "en-de", its de-en scores would go by the name of another pair."""
    french = {"name": "multi30k_fr", "dir": "m", "src_lang": "fr", "test_split": "test"}  # scored as fr-en
    for name, before, after in (("de-en", [], []), ("fr-en", [french], []), ("fr-en", [], [french]), ("en-de", [], [])):
        second = {"name": name, "dir": "f", "test_split": "test_2017"}  # data.dir's languages: de-en
        d = from_dict({"data": {"dir": "m", "corpora": [*before, second, *after]}}).data
        with pytest.raises(UserError, match=rf"'{name}' holds a second validation or test set of de-en.*rename"):
            eval_pairs(d)
    d = from_dict({"data": {"dir": "m", "corpora": [french, {"name": "flickr2017", "dir": "f", "test_split": "t"}]}})
    assert [p.name for p in eval_pairs(d.data)] == ["de-en", "fr-en", "flickr2017"]


def test_eval_pairs_names_each_pair_once_and_a_second_test_set_of_a_pair_by_its_corpus():
    """Validation, the end of training and `evaluate` take a run's pairs from eval_pairs: a corpus of data.dir's
    languages with its own test split (a second test set) is named by its corpus, not as data.dir's pair again,
    and a corpus with no split to score is not a pair at all."""
    d = from_dict(
        {
            "data": {
                "dir": "m",
                "corpora": [
                    {"name": "flickr2017", "dir": "f", "test_split": "test_2017"},
                    {"name": "fr-en", "dir": "m", "src_lang": "fr", "valid_split": "valid", "test_split": "test"},
                    {"name": "bt", "dir": "b"},
                ],
            }
        }
    ).data
    pairs = eval_pairs(d)
    assert [p.name for p in pairs] == ["de-en", "flickr2017", "fr-en"]
    assert [(p.data.dir, p.data.src_lang, p.valid_split, p.test_split) for p in pairs] == [
        ("m", "de", "valid", "test"),
        ("f", "de", "", "test_2017"),
        ("m", "fr", "valid", "test"),
    ]
    assert pairs[0].corpus is None and [p.corpus.name for p in pairs[1:]] == ["flickr2017", "fr-en"]
    assert pair_data(d, None, "de") is d  # data.dir's pair comes first among those of its languages
    second = pair_data(d, None, None, "flickr2017")  # but its second test set is there by its name
    assert (second.dir, second.src_lang, second.test_split) == ("f", "de", "test_2017")
    assert pair_data(d, None, None, "de-en") is d and pair_data(d, None, None, "fr-en").src_lang == "fr"
    with pytest.raises(UserError, match=r"no pair .* is bt \(its pairs: de-en, flickr2017, fr-en\)"):
        pair_data(d, None, None, "bt")  # a corpus with no split to score
