"""`transformer export ctranslate2`: the exported model computes ours (same token log-probabilities, same
greedy translations); the command's files and errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import tiny_config
from transformer.config import from_dict
from transformer.data.batch import pad_sequences, padding_mask, prepare_sources, target_mask
from transformer.data.vocab import BOS_ID, EOS_ID
from transformer.inference.ctranslate2_engine import export_ctranslate2
from transformer.inference.search import search
from transformer.model.checkpoint import load_model
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
    raw = tiny_config(tmp_path, model=model_overrides, train={"max_steps": 30, "valid_every": 100})
    run_dir = train(from_dict(raw), quiet=True)
    model, vocab, _ = load_model(run_dir)
    model.eval()
    out = export_ctranslate2(run_dir, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32", intra_threads=1)
    src_ids = vocab.encode(SOURCES)
    src, _ = prepare_sources(src_ids, model.cfg.max_positions)  # (B, S)

    # Scoring: CTranslate2's per-token log-probabilities of our greedy outputs equal ours.
    ours = search(model, src, beam=1, max_len_offset=10).best()
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

    # Greedy search: the same output tokens. One call per sentence, because CTranslate2's length limit is
    # per call and ours per sentence (source length with EOS + offset); a barely trained model may hit it.
    for s, t in zip(src_ids, targets):
        result = translator.translate_batch([vocab.pieces(s)], beam_size=1, max_decoding_length=len(s) + 1 + 10)
        assert result[0].hypotheses[0] == vocab.pieces(t)
    assert (out / "spm.model").read_bytes() == vocab.proto


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
    from transformer.inference import ctranslate2_engine as export

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


# --------------------------------------------------------------------------- only what we wrote is replaced


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
    from transformer.inference import ctranslate2_engine as export

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
