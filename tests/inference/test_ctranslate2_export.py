"""`export ctranslate2` and the conversion `--engine ctranslate2` caches (inference/ctranslate2_export.py): the exported
model computes ours (same token log-probabilities, same greedy translations), the command's files and errors, only
what we wrote is replaced, and the cached conversion follows its checkpoint."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.helpers import LINES, positions_model, sentences, tiny_config, write_checkpoint
from transformer.config import from_dict
from transformer.data.batch import pad_sequences, padding_mask, prepare_sources, target_mask
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID, train_vocab
from transformer.inference.ctranslate2_export import build_spec, export_ctranslate2
from transformer.inference.search import search
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.checkpoint import load_model, save_checkpoint
from transformer.training.loop import train

ctranslate2 = pytest.importorskip("ctranslate2")

SOURCES = ["der mann sitzt auf dem haus", "eine katze", "ein kind spielt im haus mit dem hund", "rot"]


@pytest.mark.parametrize(
    "model_overrides",
    [
        {},  # post-norm, all shared
        {"norm": "pre", "share_embeddings": False, "tie_output": False},
        {"positions": "learned"},  # a table per side: CTranslate2 adds any table
        {"positions": "rotary", "norm": "pre"},  # CTranslate2's rotary_dim, interleaved pairs as ours
    ],
    ids=["post_shared", "pre_unshared", "learned", "rotary"],
)
def test_exported_model_scores_and_translates_like_ours(tmp_path, model_overrides):
    """On seeded random weights with peaky outputs (the same on every machine: not a model trained here)."""
    raw = tiny_config(tmp_path, model=model_overrides)
    write_checkpoint(tmp_path / "model.pt", raw, train_vocab(sentences(0, 300), vocab_size=64), seed=1)
    model, vocab, _ = load_model(tmp_path / "model.pt")
    model.eval()
    out = export_ctranslate2(tmp_path / "model.pt", tmp_path / "ct2")
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32", intra_threads=1)
    src_ids = vocab.encode(SOURCES)
    src, _ = prepare_sources(src_ids, model.cfg.max_positions)  # (B, S)

    # Scoring: CTranslate2's per-token log-probabilities of our greedy outputs equal ours.
    ours = search(model, src, SearchSettings(beam=1, max_len_offset=10)).best()
    targets = [h.tokens for h in ours]
    scored = translator.score_batch([vocab.pieces(s) for s in src_ids], [vocab.pieces(t) for t in targets])
    with torch.no_grad():
        tgt_in = pad_sequences([[BOS_ID] + t for t in targets])  # (B, T)
        logits = model(src, tgt_in, padding_mask(src), target_mask(tgt_in))  # (B, T, V)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
    for row, (t, result) in enumerate(zip(targets, scored)):
        gold = t + [EOS_ID]
        expected = log_probs[row, torch.arange(len(gold)), torch.tensor(gold)]
        assert torch.allclose(torch.tensor(result.log_probs), expected, atol=1e-4), row

    # Greedy search: the same output tokens, wherever no step of ours is a near-tie (the two engines' sums differ
    # by ~1e-5). One call per sentence, because CTranslate2's length limit is per call and ours per sentence
    # (source length with EOS + offset); a random model may hit it. EOS may come first in both (CTranslate2's
    # default min_decoding_length is 1): such a model may translate to nothing.
    never = [BOS_ID, PAD_ID]  # ours never emits them; CTranslate2 is told to suppress them
    top2 = log_probs.index_fill(-1, torch.tensor(never), float("-inf")).topk(2, dim=-1).values
    compared = 0
    for row, (s, t) in enumerate(zip(src_ids, targets)):
        if (top2[row, : len(t) + 1, 0] - top2[row, : len(t) + 1, 1]).min() < 1e-3:
            continue
        result = translator.translate_batch(
            [vocab.pieces(s)],
            beam_size=1,
            max_decoding_length=len(s) + 1 + 10,
            min_decoding_length=0,
            suppress_sequences=[[piece] for piece in vocab.pieces(never)],
        )
        assert result[0].hypotheses[0] == vocab.pieces(t)
        compared += 1
    assert compared >= 3
    assert (out / "spm.model").read_bytes() == vocab.proto


def test_rotary_exports_as_ctranslate2s_rotary_dim_without_a_table():
    rotary = build_spec(positions_model("rotary"), [f"p{i}" for i in range(50)])
    assert int(rotary.decoder.layer[0].self_attention.rotary_dim) == 16  # the head size, all of it
    assert not hasattr(rotary.decoder, "position_encodings")


def test_export_command(tmp_path, call):
    raw = tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 100})
    run_dir = train(from_dict(raw), quiet=True)
    out = tmp_path / "exported"

    status, stdout, _ = call("export", "ctranslate2", run_dir, out, "--quantization", "int8")
    assert status == 0 and stdout == f"wrote {out}\n"
    assert {"model.bin", "config.json", "spm.model"} <= {p.name for p in out.iterdir()}
    loaded = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    loaded.translate_batch([["▁der"]], max_decoding_length=5)  # it loads and runs
    status, _, err = call("export", "ctranslate2", run_dir, out)
    assert status == 2 and err.startswith("error:") and "--force" in err
    assert call("export", "ctranslate2", run_dir, out, "--force")[0] == 0
    status, _, err = call("export", "ctranslate2", tmp_path / "nothing", tmp_path / "o")
    assert status == 2 and "no such file" in err and not (tmp_path / "o").exists()


def test_export_force_replaces_an_export_only_and_keeps_it_when_conversion_fails(tmp_path, call, monkeypatch):
    from transformer.inference import ctranslate2_export as export

    raw = tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 100})
    run_dir = train(from_dict(raw), quiet=True)
    before = sorted(p.name for p in run_dir.iterdir())
    status, _, err = call("export", "ctranslate2", run_dir, run_dir, "--force")  # a run directory as OUT_DIR
    assert status == 2 and "is not a directory this program wrote (no transformer-export.json" in err
    assert sorted(p.name for p in run_dir.iterdir()) == before

    out = tmp_path / "exported"
    assert call("export", "ctranslate2", run_dir, out)[0] == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it, not private
    (tmp_path / "empty").mkdir()
    assert call("export", "ctranslate2", run_dir, tmp_path / "empty", "--force")[0] == 0
    (tmp_path / "link").symlink_to(out)  # replaced through the link, which stays one
    assert call("export", "ctranslate2", run_dir, tmp_path / "link", "--force")[:2] == (0, f"wrote {tmp_path}/link\n")
    assert (tmp_path / "link").is_symlink() and (out / "model.bin").is_file()
    (out / "notes.txt").write_text("mine\n")
    status, _, err = call("export", "ctranslate2", run_dir, out, "--force")
    assert status == 2 and "it is never replaced" in err and (out / "notes.txt").exists()

    (out / "notes.txt").unlink()
    model_bin = (out / "model.bin").read_bytes()

    def broken(source, target, quantization):
        (target / "model.bin").write_bytes(b"half")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(export, "_write_model", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        export_ctranslate2(run_dir, out, force=True)
    assert (out / "model.bin").read_bytes() == model_bin
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _tree(directory) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _users_model(directory) -> None:
    """A CTranslate2 model folder of the user's own (another toolkit's), with a note: nothing of ours."""
    directory.mkdir(parents=True)
    for name, data in (
        ("model.bin", b"their weights"),
        ("shared_vocabulary.json", b'["<s>"]'),
        ("config.json", b"{}"),
        ("spm.model", b"their pieces"),
    ):
        (directory / name).write_bytes(data)


def test_export_force_replaces_only_a_folder_its_record_says_it_wrote(tmp_path, copy_model, call):
    """--force used to replace any folder holding model.bin and a file named like a vocabulary."""
    theirs = tmp_path / "theirs"
    _users_model(theirs)
    before = _tree(theirs)
    status, _, err = call("export", "ctranslate2", copy_model, theirs, "--force")
    assert (status, err) == (
        2,
        f"error: export: {theirs} exists and is not a directory this program wrote (no "
        "transformer-export.json of ours listing every file in it); it is never replaced: "
        "move it away or choose another directory (an export or conversion by an earlier "
        "version has no such record: delete it yourself)\n",
    )
    assert _tree(theirs) == before

    out = tmp_path / "ours"
    assert call("export", "ctranslate2", copy_model, out)[0] == 0
    record = json.loads((out / "transformer-export.json").read_text())
    assert set(record["files"]) == {p.name for p in out.iterdir()} - {"transformer-export.json"}
    assert call("export", "ctranslate2", copy_model, out, "--force", "--quantization", "int8")[0] == 0
    assert json.loads((out / "transformer-export.json").read_text())["quantization"] == "int8"
    (out / "transformer-export.json").write_text('{"format": "something else"}')  # a record, but not ours
    assert call("export", "ctranslate2", copy_model, out, "--force")[0] == 2


def test_export_force_never_replaces_a_file_changed_since_the_export(tmp_path, copy_model, call):
    """The record listed file names (with their size and mtime, which an edit can keep): --force replaced a file
    edited since. Now it holds each file's sha256; an export that an earlier version recorded by [size, mtime_ns]
    is still replaced while those are unchanged."""
    from transformer.inference import ctranslate2_export as export

    out = tmp_path / "ours"
    assert call("export", "ctranslate2", copy_model, out)[0] == 0
    config = out / "config.json"
    written, stat = config.read_bytes(), config.stat()
    edited = written.replace(b"{", b"{ ", 1)  # the same size and mtime: only the contents tell
    config.write_bytes(edited)
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    status, _, err = call("export", "ctranslate2", copy_model, out, "--force")
    assert (status, err) == (
        2,
        f"error: export: {config} was changed since transformer-export.json recorded it; it is never replaced: "
        "move it away, or delete the directory yourself to replace it\n",
    )
    assert config.read_bytes() == edited
    config.write_bytes(written)
    assert call("export", "ctranslate2", copy_model, out, "--force")[0] == 0  # as written again: replaced

    record = json.loads((out / export.EXPORT_RECORD).read_text())
    record["files"] = {
        p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in out.iterdir() if p.name in record["files"]
    }
    (out / export.EXPORT_RECORD).write_text(json.dumps(record))
    assert call("export", "ctranslate2", copy_model, out, "--force")[0] == 0
    assert all(isinstance(f, dict) for f in json.loads((out / export.EXPORT_RECORD).read_text())["files"].values())


def test_the_engines_conversion_never_empties_a_folder_it_did_not_write(tmp_path, copy_model, call):
    """`--engine ctranslate2 CKPT` used to empty CKPT_DIR/ct2/<name>/ whatever was there."""
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(copy_model.read_bytes())
    theirs = tmp_path / "ct2" / "model"
    _users_model(theirs)
    before = _tree(theirs)
    status, _, err = call("translate", checkpoint, "--engine", "ctranslate2", "--dtype", "fp32", "ein hund")
    assert (
        status == 2
        and err.startswith(
            f"error: --engine ctranslate2: {theirs} exists and is not a directory this "
            "program wrote (no source.json of ours"
        )
        and err.count("\n") == 1
    ), err
    assert _tree(theirs) == before
    # An export of ours is not the engine's conversion either: kept, it may be the only int8 copy.
    for p in theirs.iterdir():
        p.unlink()
    theirs.rmdir()
    assert call("export", "ctranslate2", checkpoint, theirs, "--quantization", "int8")[0] == 0
    before = _tree(theirs)
    assert call("translate", checkpoint, "--engine", "ctranslate2", "--dtype", "fp32", "ein hund")[0] == 2
    assert _tree(theirs) == before


def test_a_damaged_conversion_is_converted_again(tmp_path, copy_model, call):
    """Only model.bin's size was checked: a conversion missing its config.json or vocabulary, or one edited, stayed
    in use and CTranslate2 failed to load it, every time."""
    from transformer.inference import ctranslate2_export as export

    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(copy_model.read_bytes())
    status, first, err = call("translate", checkpoint, "--engine", "ctranslate2", "--dtype", "fp32", "ein hund")
    assert status == 0 and "converting" in err
    cache = tmp_path / "ct2" / "model"
    vocabulary = next(p for p in cache.iterdir() if "vocabulary" in p.name)
    for damage in (
        lambda: (cache / "config.json").unlink(),
        lambda: vocabulary.write_text("[]"),
        lambda: (cache / "config.json").write_text((cache / "config.json").read_text() + " "),
    ):
        damage()
        status, out, err = call("translate", checkpoint, "--engine", "ctranslate2", "--dtype", "fp32", "ein hund")
        assert (status, out) == (0, first) and "converting" in err, err
    status, out, err = call("translate", checkpoint, "--engine", "ctranslate2", "--dtype", "fp32", "ein hund")
    assert (status, out) == (0, first) and "converting" not in err  # current again: reused

    # A conversion an earlier version made (source.json without the list of files) is ours: converted again once.
    record = json.loads((cache / export.SOURCE_RECORD).read_text())
    del record["files"]
    record["model_bin_size"] = (cache / "model.bin").stat().st_size
    (cache / export.SOURCE_RECORD).write_text(json.dumps(record))
    status, out, err = call("translate", checkpoint, "--engine", "ctranslate2", "--dtype", "fp32", "ein hund")
    assert (status, out) == (0, first) and "converting" in err
    assert "files" in json.loads((cache / export.SOURCE_RECORD).read_text())


def test_missing_ctranslate2_is_a_one_line_error(run, monkeypatch, call):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 now raises ImportError
    for argv in (
        ("translate", run, "--engine", "ctranslate2", "x"),
        ("evaluate", run, "--engine", "ctranslate2"),
        ("export", "ctranslate2", run, run.parent / "ct2_out"),
    ):
        status, _, err = call(*argv)
        assert status == 2 and len(err.splitlines()) == 1 and "transformer[ctranslate2]" in err, (argv, err)


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
    key = "decoder_layers.0.cross_attn.out_proj.weight"
    state["model"][key] = -state["model"][key]  # a different model (negating the tied embeddings would not be one)
    save_checkpoint(state, checkpoint)
    changed = Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8])
    assert "converting" in capsys.readouterr().err
    assert changed == Translator(checkpoint, "cpu", SearchFlags(beam=1)).translate(LINES[:8]) != first
    # Another model of the same size (a retrained run's checkpoints all have one size): the mtime tells.
    size = checkpoint.stat().st_size
    state["model"][key] = -state["model"][key]  # the first model again
    save_checkpoint(state, checkpoint)
    assert checkpoint.stat().st_size == size
    assert Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8]) == first
    assert "converting" in capsys.readouterr().err
    # A torn conversion (a full disk, a kill of some other tool) is converted again, not an error for ever.
    model_bin.write_bytes(model_bin.read_bytes()[:1000])
    assert Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2")).translate(LINES[:8]) == first
    assert "converting" in capsys.readouterr().err
