"""The prepared store (through prepare, which builds it): round trip, reuse and rebuild by fingerprint, corruption
detected, streaming reads, hub source."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import tiny_config, write_corpus, write_hub_folder
from transformer.config import from_dict
from transformer.data import corpus as corpus_module
from transformer.data import store as store_module
from transformer.data.corpus import count_lines, iter_lines, open_split, read_lines
from transformer.data.prepare import prepare
from transformer.data.store import Store, problem
from transformer.data.vocab import Vocab
from transformer.errors import UserError


def config(tmp_path: Path, corpus: Path, **data):
    return from_dict(tiny_config(tmp_path, data_dir=corpus, data={"max_len": 6, **data}))


def encoded_pairs(vocab: Vocab, corpus: Path, split: str, max_len: int) -> tuple[list, dict, list]:
    """What the store should hold: the encoded pairs that pass the filter, the counts, the kept raw targets."""
    src, tgt = read_lines(corpus / f"{split}.de"), read_lines(corpus / f"{split}.en")
    kept, refs, counts = [], [], {"dropped_long": 0, "dropped_blank": 0}
    for _s_text, t_text, s, t in zip(src, tgt, vocab.encode(src), vocab.encode(tgt)):
        if not s or not t:
            counts["dropped_blank"] += 1
        elif len(s) > max_len or len(t) > max_len:
            counts["dropped_long"] += 1
        else:
            kept.append((s, t))
            refs.append(t_text)
    return kept, counts, refs


@pytest.mark.parametrize("dtype, chunk_lines", [("uint16", None), ("int32", None), ("uint16", 7)])
def test_round_trip_equals_the_encoded_and_filtered_pairs(tmp_path, corpus, monkeypatch, dtype, chunk_lines):
    """chunk_lines 7: a split read in many chunks, as every corpus of over 50,000 pairs is (the offsets of each
    chunk continue those of the last)."""
    monkeypatch.setattr(store_module, "token_dtype", lambda vocab_size: np.dtype(dtype))
    if chunk_lines:
        monkeypatch.setattr(corpus_module, "CHUNK_LINES", chunk_lines)
    cfg = config(tmp_path, corpus)
    store = prepare(cfg, Path(cfg.train.run_dir), quiet=True)
    vocab = Vocab.load(Path(cfg.train.run_dir) / "spm.model")
    assert store.dtype == np.dtype(dtype)
    for split in ("train", "valid"):
        pairs, counts, refs = encoded_pairs(vocab, corpus, split, max_len=6)
        assert counts["dropped_blank"] == 3 and counts["dropped_long"] > 0  # the filter had work to do
        corpus_arrays = store.corpus(split)
        assert corpus_arrays.src_tokens.dtype == np.dtype(dtype)
        assert [corpus_arrays.pair(i) for i in range(len(corpus_arrays))] == pairs
        stats = store.stats(split)
        assert (stats["pairs"], stats["dropped_long"], stats["dropped_blank"]) == (
            len(pairs),
            counts["dropped_long"],
            counts["dropped_blank"],
        )
        assert stats["read"] == len(read_lines(corpus / f"{split}.de"))
    assert store.references("valid") == encoded_pairs(vocab, corpus, "valid", 6)[2]


def test_reused_when_unchanged_and_rebuilt_with_the_reason_when_an_input_changes(tmp_path, corpus, caplog):
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    caplog.set_level(logging.INFO, logger="transformer")
    prepare(cfg, run_dir, quiet=True)
    manifest = (run_dir / "store" / "manifest.json").stat().st_mtime_ns

    caplog.clear()
    prepare(cfg, run_dir, quiet=True)
    assert "store: reusing" in caplog.text
    assert (run_dir / "store" / "manifest.json").stat().st_mtime_ns == manifest

    def rebuilt(cfg, vocab=None) -> str:
        caplog.clear()
        prepare(cfg, run_dir, vocab, quiet=True)
        return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("store: rebuilding"))

    with (corpus / "train.en").open("a", encoding="utf-8") as f:  # one more pair
        f.write("a new dog\n")
    with (corpus / "train.de").open("a", encoding="utf-8") as f:
        f.write("ein neuer hund\n")
    assert "train.de changed" in rebuilt(cfg)
    assert Store(run_dir / "store").stats("train")["read"] == count_lines(corpus / "train.de")

    assert "data.max_len changed (6 -> 8)" in rebuilt(config(tmp_path, corpus, max_len=8))

    other = from_dict(tiny_config(tmp_path, "other", data_dir=corpus, data={"vocab_size": 48}))
    prepare(other, Path(other.train.run_dir), quiet=True)
    other_vocab = Vocab.load(Path(other.train.run_dir) / "spm.model")
    assert "the vocabulary changed" in rebuilt(config(tmp_path, corpus, max_len=8), other_vocab)

    assert "data.max_train_pairs changed (0 -> 100)" in rebuilt(
        config(tmp_path, corpus, max_len=8, max_train_pairs=100)
    )
    assert Store(run_dir / "store").stats("train")["read"] == 100


def test_a_truncated_or_torn_store_is_detected_and_rebuilt(tmp_path, corpus, caplog):
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)
    expected = [Store(run_dir / "store").corpus("train").pair(i) for i in range(5)]
    victim = run_dir / "store" / "train.tgt.bin"
    victim.write_bytes(victim.read_bytes()[:-2])
    assert "truncated or corrupt" in problem(run_dir / "store")
    with pytest.raises(UserError, match="train.tgt.bin is .* bytes, the manifest says .* truncated or corrupt"):
        Store(run_dir / "store")
    caplog.set_level(logging.INFO, logger="transformer")
    prepare(cfg, run_dir, quiet=True)
    assert "store: rebuilding" in caplog.text and "truncated or corrupt" in caplog.text
    assert [Store(run_dir / "store").corpus("train").pair(i) for i in range(5)] == expected

    # A kill mid-build leaves files without a manifest (it is written last): never used.
    (run_dir / "store" / "manifest.json").unlink()
    assert "incomplete" in problem(run_dir / "store")


def open_files() -> list[str]:
    names = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            names.append(os.readlink(fd))
    return names


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_an_error_while_encoding_closes_the_files_and_writes_no_manifest(tmp_path, corpus, monkeypatch):
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)  # the vocabulary, kept for the rebuild below
    cfg = config(tmp_path, corpus, max_len=8)  # another max_len: rebuilt
    calls = {"n": 0}
    encode = Vocab.encode

    def failing_encode(self, lines):
        calls["n"] += 1
        if calls["n"] == 3:  # train (one chunk, two sides) is written; valid fails
            raise OSError("disk went away")
        return encode(self, lines)

    monkeypatch.setattr(Vocab, "encode", failing_encode)
    try:
        prepare(cfg, run_dir, quiet=True)
    except OSError as e:
        assert "disk went away" in str(e)
        # Checked while the error is in flight: its traceback keeps the frames (and what they did not close)
        # alive until a caller, such as the CLI printing its message, is done with it.
        # Its own store's files only: another test in this process may still hold a store it opened.
        assert [f for f in open_files() if f.startswith(f"{run_dir / 'store'}/")] == []
    else:
        pytest.fail("prepare did not raise")
    assert not (run_dir / "store" / "manifest.json").exists()
    assert "incomplete (its build was stopped)" in problem(run_dir / "store")
    monkeypatch.undo()
    prepare(cfg, run_dir, quiet=True)  # the building record says whose it is: rebuilt
    assert problem(run_dir / "store") is None and not (run_dir / "store" / "building.json").exists()


@pytest.mark.parametrize("block", [1, 3, 7, 1 << 20])
def test_streamed_lines_match_whole_file_semantics(tmp_path, block):
    path = tmp_path / "f.txt"
    lines = ["\ufeffeins", "zwei\r", "", "drei\u2028vier", "fünf\x0c", "sechs"]
    path.write_bytes(("\n".join(lines)).encode("utf-8"))  # no final newline
    got = list(iter_lines(path, block_bytes=block))
    assert got == ["eins", "zwei", "", "drei\u2028vier", "fünf\x0c", "sechs"]
    assert count_lines(path) == len(got)
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    assert list(iter_lines(path, block_bytes=block)) == got and count_lines(path) == len(got)
    path.write_bytes(b"ok\nok\nbad \xff here\n")
    with pytest.raises(UserError, match=r"f.txt line 3 is not valid UTF-8 \(byte 0xff\)"):
        list(iter_lines(path, block_bytes=block))


def test_mismatched_sides_fail_before_any_encoding(tmp_path, corpus):
    with (corpus / "train.de").open("a", encoding="utf-8") as f:
        f.write("eine zeile mehr\n")
    cfg = config(tmp_path, corpus)
    with pytest.raises(UserError, match="train.de has 304 lines but .*train.en has 303"):
        prepare(cfg, Path(cfg.train.run_dir), quiet=True)
    assert not (Path(cfg.train.run_dir) / "spm.model").exists()


@pytest.mark.parametrize("damage", ["uneven", "empty"])
def test_a_bad_validation_split_fails_before_the_vocabulary_or_the_training_split_is_built(
    tmp_path, corpus, damage, monkeypatch
):
    """It used to be found only after SentencePiece training and encoding the whole training split (minutes
    at WMT sizes), and the encoded training split was then thrown away."""
    if damage == "uneven":
        with (corpus / "valid.de").open("a", encoding="utf-8") as f:
            f.write("eine zeile mehr\n")
    else:
        for side in ("de", "en"):
            (corpus / f"valid.{side}").write_text("", encoding="utf-8")
    message = (
        "valid.de has 34 lines but .*valid.en has 33" if damage == "uneven" else "valid.de and .*valid.en are empty"
    )
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    with pytest.raises(UserError, match=message):
        prepare(cfg, run_dir, quiet=True)
    assert not (run_dir / "spm.model").exists()
    # With the vocabulary there (a later start), the training split is still not encoded first.
    good_corpus = write_corpus(tmp_path / "good", n_train=300, n_valid=30, seed=4)
    good = from_dict(tiny_config(tmp_path / "other", data_dir=good_corpus))
    prepare(good, run_dir, quiet=True)  # a store (of other inputs, so rebuilt below) and spm.model from good data
    encoded = []
    monkeypatch.setattr(store_module, "_encode_split", lambda *args, **kwargs: encoded.append(args[2]))
    with pytest.raises(UserError, match=message):
        prepare(cfg, run_dir, quiet=True)
    assert encoded == [] and (run_dir / "store").is_dir()  # nothing encoded, nothing removed


# --------------------------------------------------------------------------- the hub source, offline


@pytest.mark.parametrize("layout", ["columns", "translation"])
def test_hub_source_goes_through_the_same_store_with_default_split_names(offline_hub, tmp_path, corpus, layout, caplog):
    # The same sentences as the local corpus, as `datasets` sees a folder of jsonl files: train, validation, test.
    splits = {"train": "train", "validation": "valid", "test": "valid"}
    folder = write_hub_folder(
        tmp_path / f"hub-{layout}",
        layout,
        {
            name: list(zip(read_lines(corpus / f"{local}.de"), read_lines(corpus / f"{local}.en")))
            for name, local in splits.items()
        },
    )
    local_cfg = config(tmp_path, corpus)
    local = prepare(local_cfg, Path(local_cfg.train.run_dir), quiet=True)
    vocab = Vocab.load(Path(local_cfg.train.run_dir) / "spm.model")

    hub_cfg = from_dict(
        tiny_config(tmp_path, f"hub-run-{layout}", data={"source": "hub", "hub_name": str(folder), "max_len": 6})
    )  # valid_split keeps its default, "valid"
    assert hub_cfg.data.valid_split == "valid"
    caplog.set_level(logging.INFO, logger="transformer")
    hub = prepare(hub_cfg, Path(hub_cfg.train.run_dir), vocab, quiet=True)
    assert "split 'valid' not found; using 'validation'" in caplog.text
    for split in ("train", "valid"):
        a, b = local.corpus(split), hub.corpus(split)
        assert [a.pair(i) for i in range(len(a))] == [b.pair(i) for i in range(len(b))]
    assert hub.references("valid") == local.references("valid")

    caplog.clear()
    prepare(hub_cfg, Path(hub_cfg.train.run_dir), vocab, quiet=True)
    assert "store: reusing" in caplog.text


def test_hub_wrong_split_name_fails_before_any_expensive_work(offline_hub, tmp_path):
    folder = write_hub_folder(
        tmp_path / "hub", "columns", {"train": [("Ein Hund.", "A dog.")] * 5, "validation": [("Eine Katze.", "A cat.")]}
    )
    cfg = from_dict(tiny_config(tmp_path, data={"source": "hub", "hub_name": str(folder), "valid_split": "dev2"}))
    with pytest.raises(UserError, match=r"has no split 'dev2' \(its splits: train, validation\)"):
        prepare(cfg, Path(cfg.train.run_dir), quiet=True)
    assert not (Path(cfg.train.run_dir) / "spm.model").exists()  # failed before training the vocabulary
    assert open_split(cfg.data, "valid").name == "validation"


def test_why_a_store_is_rebuilt_names_every_split_that_changed():
    def manifest(train_size: int, valid_rows: int) -> dict:
        return {
            "inputs": {
                "train": {
                    "source": "local",
                    "limit": 0,
                    "files": [{"path": "/d/train.de", "size": train_size, "mtime_ns": 1}],
                },
                "valid": {
                    "source": "hub",
                    "limit": 0,
                    "rows": valid_rows,
                    "files": [{"path": "/cache/v.arrow", "size": 9, "mtime_ns": 1}],
                },
            },
            "vocab_sha256": "v",
            "src_lang": "de",
            "tgt_lang": "en",
            "max_len": 100,
        }

    reasons = store_module._differences(manifest(10, 5), manifest(11, 6))
    assert reasons == ["/d/train.de changed (size or modification time)", "the valid corpus changed"]


def test_token_dtype_holds_every_id():
    assert store_module.token_dtype(1 << 16) == np.uint16  # ids 0 .. 65535
    assert store_module.token_dtype((1 << 16) + 1) == np.int32


def test_an_index_that_does_not_start_at_zero_is_refused(tmp_path, corpus):
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)
    index = run_dir / "store" / "train.src.idx"
    data = bytearray(index.read_bytes())
    data[:8] = np.int64(1).tobytes()  # same size, so the manifest's byte counts still agree
    index.write_bytes(bytes(data))
    with pytest.raises(UserError, match="train.src.idx: its offsets run from 1 to .*: corrupt"):
        Store(run_dir / "store").corpus("train")


def test_every_store_file_is_synced_before_the_manifest(tmp_path, corpus, monkeypatch):
    """The manifest says the store is complete; after a power loss it must not be on disk before the data."""
    events = []
    fsync = os.fsync

    def recording_fsync(fd):
        events.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name if Path("/proc/self/fd").is_dir() else fd)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    cfg = config(tmp_path, corpus)
    prepare(cfg, Path(cfg.train.run_dir), quiet=True)
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the synced files")
    data = {
        f"{split}.{side}.{kind}" for split in ("train", "valid") for side in ("src", "tgt") for kind in ("bin", "idx")
    }
    manifest_at = next(i for i, name in enumerate(events) if name.lstrip(".").startswith("manifest.json"))
    assert data <= set(events[:manifest_at]), events


def test_encoding_logs_how_far_it_is_when_no_progress_bar_shows(tmp_path, corpus, monkeypatch, caplog):
    """stderr is not a terminal here (as in a batch job's log), so tqdm shows no bar: log lines say how far it is."""
    monkeypatch.setattr(corpus_module, "CHUNK_LINES", 100)
    monkeypatch.setattr(store_module, "PROGRESS_LOG_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger="transformer")
    cfg = config(tmp_path, corpus)
    prepare(cfg, Path(cfg.train.run_dir))
    lines = [r.getMessage() for r in caplog.records if "pairs encoded" in r.getMessage()]
    n = len(read_lines(corpus / "train.de"))
    assert 200 < n < 400 and len(read_lines(corpus / "valid.de")) < 100
    assert lines == [f"store: train: {k} of {n} pairs encoded ({100 * k / n:.0f}%)" for k in (100, 200, 300)]
    caplog.clear()
    prepare(cfg, Path(cfg.train.run_dir), quiet=True)  # quiet: nothing
    assert not [r for r in caplog.records if "pairs encoded" in r.getMessage()]


# --------------------------------------------------------------------------- whose store it is, and what it holds


def tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("manifest", [None, b"[]", b"null", b'{"format": "my-own-format"}'])
def test_a_users_own_store_directory_is_never_taken_for_a_run(tmp_path, corpus, call, manifest):
    """A directory holding only the user's store/ (files named as ours, but no manifest of ours) used to pass for a
    run directory, and prepare or train deleted its files. Only a manifest (or building record) we wrote makes it ours."""
    from tests.helpers import write_config

    run_dir = tmp_path / "mine"
    own = run_dir / "store"
    own.mkdir(parents=True)
    (own / "train.src.bin").write_bytes(b"my own bytes")
    (own / "notes.txt").write_text("keep me\n", encoding="utf-8")
    if manifest is not None:
        (own / "manifest.json").write_bytes(manifest)
    before = tree(run_dir)
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, data_dir=corpus, train={"run_dir": str(run_dir)}))
    for command in ("prepare", "train"):
        status, _, err = call(command, path)
        assert status == 2, err
        assert f"train.run_dir {run_dir} holds files that are not a run's (store)" in err
        assert "Traceback" not in err
    assert tree(run_dir) == before

    # Beside a run's own files too (spm.model makes it a run directory): refused by the store itself.
    cfg = from_dict(tiny_config(tmp_path, data_dir=corpus, train={"run_dir": str(run_dir)}))
    prepare(cfg, tmp_path / "other-run", quiet=True)
    (run_dir / "spm.model").write_bytes((tmp_path / "other-run" / "spm.model").read_bytes())
    before = tree(run_dir)
    with pytest.raises(
        UserError,
        match=rf"store: {own} holds files that `transformer prepare` did not write .*"
        "it is never deleted: move it away",
    ):
        prepare(cfg, run_dir, quiet=True)
    assert tree(run_dir) == before


def test_a_store_of_ours_is_rebuilt_by_name_and_a_file_of_the_users_in_it_stays(tmp_path, corpus):
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)
    (run_dir / "store" / "README").write_text("mine\n", encoding="utf-8")
    prepare(config(tmp_path, corpus, max_len=8), run_dir, quiet=True)  # rebuilt
    assert (run_dir / "store" / "README").read_text(encoding="utf-8") == "mine\n"
    assert Store(run_dir / "store").manifest["fingerprint"]["max_len"] == 8


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda m: [], r"not a store manifest this version reads \(it holds list, not a JSON object\)"),
        (lambda m: None, r"not a store manifest this version reads \(it holds null, not a JSON object\)"),
        (lambda m: {k: v for k, v in m.items() if k != "fingerprint"}, "it has no fingerprint of its inputs"),
        (
            lambda m: {**m, "fingerprint": {k: v for k, v in m["fingerprint"].items() if k != "inputs"}},
            "it has no fingerprint of its inputs",
        ),
        (lambda m: {**m, "splits": {"train": m["splits"]["train"]}}, "its split counts are missing or wrong"),
    ],
)
def test_a_malformed_manifest_is_a_reason_not_a_traceback(tmp_path, corpus, caplog, damage, reason):
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)
    path = run_dir / "store" / "manifest.json"
    path.write_text(json.dumps(damage(json.loads(path.read_text(encoding="utf-8")))), encoding="utf-8")
    assert re.search(reason, problem(run_dir / "store", {"inputs": {}}))
    with pytest.raises(UserError, match=reason):
        Store(run_dir / "store")
    # Without the corpus, such a store is not used: the missing corpus is reported.
    moved = from_dict(tiny_config(tmp_path, data_dir=tmp_path / "gone", data={"max_len": 6}))
    with pytest.raises(UserError, match="no such file"):
        prepare(moved, run_dir, quiet=True)
    caplog.set_level(logging.INFO, logger="transformer")
    if isinstance(damage({"fingerprint": {}, "splits": {"train": 0}}), dict):  # still ours (our format): rebuilt
        prepare(cfg, run_dir, quiet=True)
        assert "store: rebuilding" in caplog.text and problem(run_dir / "store") is None
    else:  # [] or null proves nothing: refused, left as it is
        with pytest.raises(UserError, match="holds files that `transformer prepare` did not write"):
            prepare(cfg, run_dir, quiet=True)
        assert (run_dir / "store" / "train.src.bin").exists()


def _poke(path: Path, dtype, index: int, value: int) -> None:
    """Write one value into a store file in place: its size, and so the manifest's byte counts, unchanged."""
    array = np.memmap(path, dtype=dtype, mode="r+")
    array[index] = value
    array.flush()
    del array


@pytest.mark.parametrize(
    "file, dtype, index, value, reason",
    [
        ("train.tgt.bin", np.uint16, 5, 60_000, r"train.tgt.bin: it holds id 60000, outside the vocabulary's 0..\d+"),
        ("train.src.idx", np.int64, 3, 1, r"train.src.idx: sentence 2 spans offsets \d+..1, not 1 to 6 tokens"),
        ("train.tgt.idx", np.int64, -1, 7, r"train.tgt.idx: sentence \d+ spans offsets \d+..7, not 1 to 6 tokens"),
        (
            "train.tgt.idx",
            np.int64,
            0,
            1,
            r"train.tgt.idx: its offsets run from 1 to \d+, not from 0 to its \d+ tokens",
        ),
        ("valid.src.idx", np.int64, 1, 0, r"valid.src.idx: sentence 0 spans offsets 0..0, not 1 to 6 tokens"),
    ],
)
def test_store_contents_are_checked_before_reusing(tmp_path, corpus, caplog, file, dtype, index, value, reason):
    """Files of the right size with wrong contents used to be reused, until an IndexError in training (or a CUDA
    assert): out-of-range ids, offsets out of order or past the tokens. Checked in one numpy pass, and rebuilt."""
    cfg = config(tmp_path, corpus)
    run_dir = Path(cfg.train.run_dir)
    prepare(cfg, run_dir, quiet=True)

    def pairs() -> list:
        store = Store(run_dir / "store")
        return [store.corpus(s).pair(i) for s in ("train", "valid") for i in range(len(store.corpus(s)))]

    expected = pairs()
    _poke(run_dir / "store" / file, dtype, index, value)
    assert re.search(reason + ".*: corrupt$", problem(run_dir / "store"))
    with pytest.raises(UserError, match=reason):
        Store(run_dir / "store")
    caplog.set_level(logging.INFO, logger="transformer")
    prepare(cfg, run_dir, quiet=True)
    assert "store: rebuilding" in caplog.text and "corrupt" in caplog.text and "store: reusing" not in caplog.text
    assert pairs() == expected


# --------------------------------------------------------------------------- hub rows that are not text


def _write_jsonl(directory: Path, splits: dict[str, list]) -> Path:
    directory.mkdir()
    for name, rows in splits.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return directory


GOOD_ROWS = [{"de": "ein hund", "en": "a dog"}, {"de": "eine katze", "en": "a cat"}] * 4


@pytest.mark.parametrize(
    "rows, dropped",
    [
        ([{"de": None, "en": "a dog"}, {"de": "ein hund", "en": None}] + GOOD_ROWS, 2),  # null
        ([{"de": "ein hund"}, {"en": "a dog"}] + GOOD_ROWS, 2),  # a language missing
        ([{"translation": None}, {"translation": {"de": "ein hund"}}] + [{"translation": r} for r in GOOD_ROWS], 2),
    ],
    ids=["null", "columns lacking a language", "translation null or lacking a language"],
)
def test_hub_rows_without_a_side_count_as_blank(offline_hub, tmp_path, rows, dropped):
    """A null translation, or one whose first row lacks a language, used to end in a TypeError or KeyError."""
    valid = [{"translation": r} for r in GOOD_ROWS] if "translation" in rows[0] else GOOD_ROWS
    folder = _write_jsonl(tmp_path / "hub", {"train": rows, "validation": valid})
    cfg = from_dict(tiny_config(tmp_path, data={"source": "hub", "hub_name": str(folder), "vocab_size": 24}))
    store = prepare(cfg, Path(cfg.train.run_dir), quiet=True)
    assert (store.stats("train")["dropped_blank"], store.stats("train")["pairs"]) == (dropped, len(GOOD_ROWS))


@pytest.mark.parametrize("layout", ["columns", "translation"])
def test_hub_values_that_are_not_text_are_one_line_errors(offline_hub, tmp_path, layout):
    """An integer column reached SentencePiece: AttributeError: 'int' object has no attribute 'strip'."""
    rows = GOOD_ROWS[:3] + [{"de": 5, "en": 7}] + GOOD_ROWS[3:]
    valid = GOOD_ROWS[:2]
    if layout == "translation":
        rows, valid = [{"translation": r} for r in rows], [{"translation": r} for r in valid]
    else:  # Arrow needs one type per column: the whole column holds integers
        rows = [{"de": i, "en": i + 1} for i in range(8)]
        valid = [{"de": 1, "en": 2}]
    folder = _write_jsonl(tmp_path / "hub", {"train": rows, "validation": valid})
    cfg = from_dict(tiny_config(tmp_path, data={"source": "hub", "hub_name": str(folder), "vocab_size": 24}))
    row, value = (3, 5) if layout == "translation" else (0, 0)
    with pytest.raises(
        UserError,
        match=rf"data: '{re.escape(str(folder))}' split 'train' row {row}: 'de' holds "
        rf"{value} \(int\), not text; check data.src_lang and data.tgt_lang",
    ):
        prepare(cfg, Path(cfg.train.run_dir), quiet=True)


def test_an_encoding_check_refuses_utf16_and_keeps_a_stray_nul(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"ein\x00 hund\nzwei katzen\n")  # one NUL in text: still text
    assert count_lines(path) == 2 and read_lines(path) == ["ein\x00 hund", "zwei katzen"]
    for encoding, said in (("utf-16-le", "NUL bytes"), ("utf-16", "UTF-16 text"), ("utf-32", "UTF-32 text")):
        path.write_bytes("ein hund\nzwei katzen\n".encode(encoding))
        for read in (count_lines, read_lines):
            with pytest.raises(UserError, match=f"f.txt is not UTF-8: it holds {said}"):
                read(path)


def test_an_empty_file_is_not_taken_for_another_encoding(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    assert count_lines(tmp_path / "empty.txt") == 0 and read_lines(tmp_path / "empty.txt") == []
