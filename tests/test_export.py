"""`transformer export ctranslate2`: the exported model computes ours (same token log-probabilities, same
greedy translations); the command's files and errors."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import tiny_config
from transformer.batch import pad_sequences, padding_mask, prepare_sources, target_mask
from transformer.checkpoint import load_model
from transformer.config import from_dict
from transformer.export import export_ctranslate2
from transformer.search import search
from transformer.train import train
from transformer.vocab import BOS_ID, EOS_ID

ctranslate2 = pytest.importorskip("ctranslate2")

SOURCES = ["der mann sitzt auf dem haus", "eine katze", "ein kind spielt im haus mit dem hund", "rot"]


@pytest.mark.parametrize("model_overrides", [
    {},                                                                          # post-norm, all shared
    {"norm": "pre", "share_embeddings": False, "tie_output": False},
], ids=["post_shared", "pre_unshared"])
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
    from transformer import export

    raw = tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 100})
    run_dir = train(from_dict(raw), quiet=True)
    before = sorted(p.name for p in run_dir.iterdir())
    status, _, err = call("export", "ctranslate2", run_dir, run_dir, "--force")  # a run directory as OUT_DIR
    assert status == 2 and "is not a CTranslate2 model directory" in err
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
    assert status == 2 and "not replacing it" in err and (out / "notes.txt").exists()

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
