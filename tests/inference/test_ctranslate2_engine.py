"""CTranslate2 as an engine (inference/ctranslate2_engine.py): `export ctranslate2` (the exported model computes ours:
same token log-probabilities, same greedy translations; the command's files and errors, and only what we wrote is
replaced), the cached conversion, and the search through it (greedy equal to ours, beam outputs where the rules
agree, our scores, length limits in few calls, prefixes, sampling, alignments)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import pytest
import torch

from tests.helpers import LINES, positions_model, sentences, tiny_config, write_checkpoint
from transformer.config import from_dict
from transformer.data.batch import pad_sequences, padding_mask, prepare_sources, target_mask
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID, train_vocab
from transformer.errors import UserError
from transformer.inference.ctranslate2_engine import (
    build_spec,
    ctranslate2_limited,
    ctranslate2_search,
    export_ctranslate2,
    limit_bucket,
)
from transformer.inference.search import length_penalty, search
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator, search_ids
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


def test_export_force_never_replaces_a_file_changed_since_the_export(tmp_path, copy_model, call):
    """The record listed file names (with their size and mtime, which an edit can keep): --force replaced a file
    edited since. Now it holds each file's sha256; an export that an earlier version recorded by [size, mtime_ns]
    is still replaced while those are unchanged."""
    from transformer.inference import ctranslate2_engine as export

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


def test_missing_ctranslate2_is_a_one_line_error(run, monkeypatch, call):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 now raises ImportError
    for argv in (
        ("translate", run, "--engine", "ctranslate2", "x"),
        ("evaluate", run, "--engine", "ctranslate2"),
        ("export", "ctranslate2", run, run.parent / "ct2_out"),
    ):
        status, _, err = call(*argv)
        assert status == 2 and len(err.splitlines()) == 1 and "transformer[ctranslate2]" in err, (argv, err)


def test_ctranslate2_engine_greedy_equals_ours(ctranslate2, copy_model, capsys, call):
    ours = Translator(copy_model, "cpu", SearchFlags(beam=1)).translate(LINES + [""])
    theirs = Translator(copy_model, "cpu", SearchFlags(beam=1, engine="ctranslate2"))
    assert theirs.translate(LINES + [""]) == ours
    assert ours[-1] == "" and len(set(ours)) > len(LINES) // 2
    # Through the command, with the conversion reused.
    capsys.readouterr()
    status, out, err = call(
        "translate", copy_model, "--beam", "1", "--engine", "ctranslate2", "--dtype", "fp32", *LINES[:5]
    )
    assert status == 0 and out.splitlines() == ours[:5] and "converting" not in err


def test_ctranslate2_engine_never_emits_bos_or_pad(ctranslate2, untrained_checkpoint, tmp_path):
    """Ours never emits BOS or PAD (search.py); CTranslate2 does unless told not to. A model whose output favours
    them (their rows copy the two tokens it emits most, scaled up) shows it: greedy outputs of both engines are
    then the same token ids, and no hypothesis of either holds BOS or PAD."""
    state = torch.load(untrained_checkpoint, weights_only=True)
    ids = Translator(untrained_checkpoint, "cpu", SearchFlags(beam=1)).encode(LINES)
    greedy = SearchSettings(beam=1, lenpen=0.6, max_len_offset=4, max_tokens=64)
    emitted = [t for h in search_ids(model_of(untrained_checkpoint), ids, greedy, "cpu") for t in h[0].tokens]
    first, second = torch.bincount(torch.tensor(emitted)).topk(2).indices.tolist()
    weight = state["model"]["output.weight"]  # tied: the embeddings change too, for both engines alike
    weight[BOS_ID], weight[PAD_ID] = 1.1 * weight[first], 1.1 * weight[second]
    checkpoint = tmp_path / "model.pt"
    save_checkpoint(state, checkpoint)
    theirs = Translator(checkpoint, "cpu", SearchFlags(beam=1, engine="ctranslate2"))
    raw = theirs.ct2.translate_batch([theirs.vocab.pieces(s) for s in ids], beam_size=1, max_decoding_length=20)
    assert sum("<s>" in r.hypotheses[0] for r in raw) > len(ids) // 2  # unsuppressed, it would emit <s>
    ours = Translator(checkpoint, "cpu", SearchFlags(beam=1)).search(ids)
    assert [h[0].tokens for h in theirs.search(ids)] == [h[0].tokens for h in ours]
    wide = Translator(checkpoint, "cpu", SearchFlags(beam=3, nbest=3, engine="ctranslate2"))
    beam = wide.search(ids)
    assert not any({BOS_ID, PAD_ID} & set(h.tokens) for hyps in beam + ours for h in hyps)


def model_of(checkpoint):
    model, _, _ = load_model(checkpoint)
    return model.eval()


def test_ctranslate2_beam_outputs_are_ours_where_the_rules_agree(ctranslate2, copy_model):
    """With a length penalty CTranslate2 stops as our early rule does, and it returns the beam best by its own
    penalty, which are re-ranked by ours: the best one is ours (our early rule's best is the best of all it
    finishes), unless its penalty ranked ours out of its beam, so it is never better. Without a length penalty
    it stops at the exact bound for the best (the best candidate is EOS): ours under the exact rule. Scores:
    the engines' kernels agree to ~1e-5 a token, hence 1e-3."""
    for beam, lenpen, stop in ((3, 0.6, "early"), (4, 1.0, "early"), (3, 0.0, "exact")):
        ours = Translator(copy_model, "cpu", SearchFlags(beam=beam, lenpen=lenpen, stop=stop)).translate_nbest(LINES)
        theirs = Translator(
            copy_model, "cpu", SearchFlags(beam=beam, lenpen=lenpen, engine="ctranslate2")
        ).translate_nbest(LINES)
        same = sum(a[0][1] == b[0][1] for a, b in zip(ours, theirs))
        assert same >= len(LINES) - 1, (beam, lenpen, same)  # measured: 40, 39 (its penalty) and 40 of 40
        for a, b in zip(ours, theirs):
            if a[0][1] == b[0][1]:
                assert a[0][0] == pytest.approx(b[0][0], abs=1e-3)
            else:
                assert b[0][0] <= a[0][0] + 1e-3


def test_ctranslate2_engine_nbest_scores_are_ours(ctranslate2, copy_model):
    ours = Translator(copy_model, "cpu", SearchFlags(beam=3, lenpen=0.6)).translate_nbest(LINES[:15], 3)
    theirs = Translator(copy_model, "cpu", SearchFlags(beam=3, lenpen=0.6, engine="ctranslate2"))
    theirs = theirs.translate_nbest(LINES[:15], 3)
    shared = 0
    for mine, other in zip(ours, theirs):
        assert len(other) == 3 and [s for s, _ in other] == sorted((s for s, _ in other), reverse=True)
        texts = [text for _, text in mine]
        scores = {text: score for score, text in mine if texts.count(text) == 1}  # two hypotheses may read the same
        for score, text in other:
            if text in scores:  # the same hypothesis found by both: the same score definition
                assert score == pytest.approx(scores[text], abs=1e-3)
                shared += 1
    assert shared >= 30  # most hypotheses are found by both, so the score check was not vacuous


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


def test_ctranslate2_engine_at_the_length_limit(ctranslate2, run):
    """An untrained model runs to its length limits, which differ per sentence but are one per CTranslate2
    call: outputs are cut to each sentence's own limit and rescored, so they still equal ours."""
    lines = sentences(6, 12)
    ours = Translator(run, "cpu", SearchFlags(beam=1))
    theirs = Translator(run, "cpu", SearchFlags(beam=1, engine="ctranslate2"))
    ids = ours.encode(lines)
    mine, other = ours.search(ids), theirs.search(ids)
    limits = [len(s) + 1 + ours.settings.max_len_offset for s in ids]
    assert sum(len(h[0].tokens) == n for h, n in zip(mine, limits)) >= 3  # the limit case is exercised
    assert len(set(limits)) > 1
    for a, b in zip(mine, other):
        assert a[0].tokens == b[0].tokens and a[0].score == pytest.approx(b[0].score, abs=1e-3)


def own_limits(translator: Translator, ids) -> dict[int, int]:
    cap = translator.cfg.model.max_positions - 1
    return {i: min(len(s) + 1 + translator.settings.max_len_offset, cap) for i, s in enumerate(ids) if s}


@pytest.mark.parametrize("lenpen", [0.6, 0.0])
@pytest.mark.parametrize("checkpoint", ["run", "copy_model"])
def test_ctranslate2_engine_in_few_calls_is_the_search_under_each_sentences_own_limit(
    request, ctranslate2, checkpoint, lenpen
):
    """With a length penalty a batch goes as one call, under the largest of its sentences' limit buckets; without
    one, as one call per bucket. Either way the outcome is each sentence's own: with a length penalty its search
    under its own limit (one call per limit, as ctranslate2_limited searches; with BOS and PAD suppressed where a
    hypothesis holds one), also for an untrained model whose sentences run to their limits and are searched again;
    without one, its search alone."""
    path = request.getfixturevalue(checkpoint)
    flags = SearchFlags(beam=3, nbest=3, lenpen=lenpen, engine="ctranslate2", max_tokens=100_000)  # one batch
    translator = Translator(path, "cpu", flags)
    ids = translator.encode(sentences(3, 24, lo=1, hi=9))
    limits = own_limits(translator, ids)
    buckets = {limit_bucket(n, 40) for n in limits.values()}
    assert len(set(limits.values())) > 4 and len(buckets) > 1  # the calls could be several
    counting = CountingCalls(translator.ct2)
    settings, vocab, max_positions = translator.settings, translator.vocab, translator.cfg.model.max_positions
    found = ctranslate2_search(counting, vocab, ids, settings, max_positions)
    if lenpen:
        sources, none = {i: vocab.pieces(s) for i, s in enumerate(ids)}, {i: [] for i in range(len(ids))}
        own = ctranslate2_limited(translator.ct2, vocab, sources, none, list(sources), limits, settings, False)
        never = {vocab.specials.bos, vocab.specials.pad}
        unwanted = [i for i, hyps in own.items() if any(never.intersection(h.tokens) for h in hyps)]
        own.update(ctranslate2_limited(translator.ct2, vocab, sources, none, unwanted, limits, settings, True))
    else:
        own = {i: ctranslate2_search(translator.ct2, vocab, [s], settings, max_positions)[0] for i, s in enumerate(ids)}
    for i, hyps in enumerate(found):
        assert [h.tokens for h in hyps] == [h.tokens for h in own[i]], i
        assert [h.score for h in hyps] == pytest.approx([h.score for h in own[i]], abs=1e-4)
    first = counting.calls[: 1 if lenpen else len(buckets)]
    assert sorted(limit for _, limit in first) == ([max(buckets)] if lenpen else sorted(buckets))
    assert sum(n for n, _ in first) == len(ids)
    searched_again = sum(n for n, _ in counting.calls[len(first) :])
    at_limit = sum(len(hyps[0].tokens) == limits[i] for i, hyps in enumerate(found))
    if checkpoint == "run" and lenpen:  # untrained: runs to its limits, so those sentences are searched again
        assert at_limit >= 3 and searched_again >= at_limit
    elif checkpoint == "copy_model":  # copies by construction: every hypothesis ends at its EOS
        assert searched_again == 0 and counting.scored == 0


def test_ctranslate2_engine_search_scores_are_ours_without_a_scoring_pass(ctranslate2, copy_model):
    """BOS and PAD are not suppressed in its search, so each step is normalised over the whole vocabulary, as ours:
    the scores it searched with are those its scorer gives (ours), and no hypothesis is scored again. Suppressed,
    this model's scores would differ (it gives BOS some probability), so the check is not vacuous."""
    translator = Translator(copy_model, "cpu", SearchFlags(beam=4, nbest=4, lenpen=1.0, engine="ctranslate2"))
    ids, vocab, settings = translator.encode(LINES), translator.vocab, translator.settings
    counting = CountingCalls(translator.ct2)
    found = ctranslate2_search(counting, vocab, ids, settings, translator.cfg.model.max_positions)
    assert counting.scored == 0  # every sentence settled in the first calls: no scoring pass
    sources = {i: vocab.pieces(s) for i, s in enumerate(ids)}
    pairs = [(sources[i], vocab.pieces(h.tokens), h) for i, hyps in enumerate(found) for h in hyps]
    scored = translator.ct2.score_batch([p[0] for p in pairs], [p[1] for p in pairs])
    penalty = [length_penalty(len(h.tokens) + 1, settings.lenpen, settings.lenpen_kind) for _, _, h in pairs]
    assert [h.score for _, _, h in pairs] == pytest.approx(
        [sum(r.log_probs) / lp for r, lp in zip(scored, penalty)], abs=1e-4
    )
    # Suppressed, its search scores are renormalised: above the scorer's wherever BOS and PAD had some.
    raw = translator.ct2.translate_batch(
        list(sources.values()),
        beam_size=4,
        length_penalty=0.0,
        return_scores=True,
        return_end_token=True,
        suppress_sequences=[[piece] for piece in vocab.pieces([BOS_ID, PAD_ID])],
    )
    rescored = translator.ct2.score_batch(list(sources.values()), [r.hypotheses[0][:-1] for r in raw])  # no </s>
    assert all(r.hypotheses[0][-1] == "</s>" for r in raw)
    assert any(r.scores[0] > sum(x.log_probs) + 1e-4 for r, x in zip(raw, rescored))
    assert translator.translate(LINES) == [hyps[0][1] for hyps in translator.translate_nbest(LINES, 1)]


def test_limit_buckets_hold_their_limits():
    for max_positions in (8, 40, 256, 1024):
        for max_len in range(1, max_positions):
            bucket = limit_bucket(max_len, max_positions)
            assert max_len <= bucket <= max_positions - 1
            assert bucket == max_positions - 1 or (bucket & (bucket - 1) == 0 and bucket < 2 * max_len)
    assert len({limit_bucket(n, 256) for n in range(56, 92)}) == 2  # Multi30k's test limits: two buckets


def test_ctranslate2_engine_forces_a_prefix_as_ours_does(ctranslate2, copy_model):
    flags = SearchFlags(beam=1, dtype="fp32")
    ours, theirs = (
        Translator(copy_model, "cpu", flags),
        Translator(copy_model, "cpu", replace(flags, engine="ctranslate2")),
    )
    prefixes = ["der", "", "ein rot", *[line.split()[0] for line in LINES[3:12]]]
    ours_found = ours.translate_lines(LINES[:12], prefixes)
    theirs_found = theirs.translate_lines(LINES[:12], prefixes)
    assert [h[0].text for h in theirs_found] == [h[0].text for h in ours_found]
    assert all(h[0].text.startswith(p) for h, p in zip(ours_found, prefixes))
    assert [h[0].score for h in theirs_found] == pytest.approx([h[0].score for h in ours_found], abs=1e-3)


def test_ctranslate2_engine_samples_and_top_k_1_is_greedy(ctranslate2, copy_model):
    greedy = Translator(copy_model, "cpu", SearchFlags(beam=1, dtype="fp32")).translate(LINES[:10])
    flags = SearchFlags(sample="topk:1", seed=3, dtype="fp32", engine="ctranslate2", workers=1)
    assert Translator(copy_model, "cpu", flags).translate(LINES[:10]) == greedy
    sampler = Translator(copy_model, "cpu", replace(flags, sample="topp:0.95", temperature=2.0, nbest=3))
    drawn = [[t.text for t in hyps] for hyps in sampler.translate_lines(LINES[:10])]
    assert all(len(hyps) == 3 for hyps in drawn) and drawn != [[g] * 3 for g in greedy]
    # A seed repeats a run (the same input, one worker): CTranslate2 seeds a worker's stream when it starts.
    again = Translator(copy_model, "cpu", replace(flags, sample="topp:0.95", temperature=2.0, nbest=3))
    assert [[t.text for t in hyps] for hyps in again.translate_lines(LINES[:10])] == drawn


def test_ctranslate2_engine_gives_our_alignments(ctranslate2, copy_model):
    """return_attention of the conversion is the last layer's cross-attention averaged over all heads, without
    the source's EOS: the same alignments as ours."""
    flags = SearchFlags(beam=1, dtype="fp32", alignments=True)
    ours = Translator(copy_model, "cpu", flags).translate_lines(LINES[:12])
    theirs = Translator(copy_model, "cpu", replace(flags, engine="ctranslate2")).translate_lines(LINES[:12])
    assert [h[0].alignment for h in theirs] == [h[0].alignment for h in ours]
    with pytest.raises(UserError, match=r"^--engine ctranslate2 returns the attention of the last decoder layer \(2\)"):
        Translator(copy_model, "cpu", replace(flags, engine="ctranslate2", alignment_layer=1))
    with pytest.raises(UserError, match="^--engine ctranslate2 has no terminology constraints"):
        Translator(copy_model, "cpu", replace(flags, engine="ctranslate2")).translate_lines(
            ["ein hund"], None, [["dog"]]
        )


class CountingCalls:
    """A ctranslate2.Translator that records each translate_batch call: its sentence count and length limit."""

    def __init__(self, ct2):
        self.ct2, self.calls, self.scored = ct2, [], 0  # scored: hypotheses scored again
        self.num_translators = ct2.num_translators

    def translate_batch(self, sources, **options):
        self.calls.append((len(sources), options["max_decoding_length"]))
        return self.ct2.translate_batch(sources, **options)

    def score_batch(self, sources, *args, **options):
        self.scored += len(sources)
        return self.ct2.score_batch(sources, *args, **options)


def test_ctranslate2_workers_translate_as_one(ctranslate2, copy_model, two_threads):
    one = Translator(copy_model, "cpu", SearchFlags(beam=2, max_tokens=64, engine="ctranslate2", workers=1))
    two = Translator(copy_model, "cpu", SearchFlags(beam=2, max_tokens=64, engine="ctranslate2", workers=2))
    assert (one.ct2.num_translators, two.ct2.num_translators) == (1, 2)
    assert torch.get_num_threads() == 2  # CTranslate2 set the caller's count to its intra_threads, 1
    found_one, found_two = one.translate_nbest(LINES, 2), two.translate_nbest(LINES, 2)
    assert [[text for _, text in hyps] for hyps in found_two] == [[text for _, text in hyps] for hyps in found_one]
    for hyps_two, hyps_one in zip(found_two, found_one):  # other batches: float sums in another order
        assert [score for score, _ in hyps_two] == pytest.approx([score for score, _ in hyps_one], abs=1e-4)
