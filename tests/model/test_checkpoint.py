"""The checkpoint file (model/checkpoint.py): a round trip gives the same model, files are readable like any other,
and one that is missing, torn, foreign or cannot rebuild a model is a one-line error naming it, in every command
that loads one."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from tests.helpers import small_vocab, tiny_config, write_config
from transformer.config import from_dict, to_dict
from transformer.data.batch import Batch
from transformer.data.vocab import train_vocab
from transformer.errors import UserError
from transformer.model.checkpoint import load_checkpoint, load_model, save_checkpoint, weights_checkpoint
from transformer.model.transformer import Transformer


def test_checkpoint_round_trip_gives_identical_logits(tmp_path):
    vocab = train_vocab((f"wort{i} word{i % 7}" for i in range(200)), vocab_size=60)
    cfg = from_dict(tiny_config(tmp_path))
    torch.manual_seed(0)
    model = Transformer(cfg.model, len(vocab)).eval()
    save_checkpoint({"config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict()}, tmp_path / "x.pt")
    loaded, loaded_vocab, loaded_cfg = load_model(tmp_path / "x.pt")
    batch = Batch.from_pairs([([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14, 15])])
    with torch.no_grad():
        a = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        b = loaded(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    assert torch.equal(a, b)
    assert loaded_cfg == cfg and loaded_vocab.proto == vocab.proto
    assert loaded.output.weight is loaded.tgt_embed.weight  # weight tying survives loading


def test_checkpoints_are_readable_like_other_files(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint({"run": {"step": 0}}, path)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint({**weights_checkpoint({}, small_vocab(), {"w": torch.zeros(100_000)}), "run": {"step": 1}}, good)
    data = good.read_bytes()
    cases = {
        "truncated.pt": data[: len(data) // 2],
        "text.pt": b"hello\n",
        "empty.pt": b"",
        "zeros.pt": bytes(4096),
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=f"{name} is not a checkpoint, or is truncated or corrupt"):
            load_checkpoint(tmp_path / name)
    torch.save({"model": {}}, tmp_path / "foreign.pt")  # a valid torch file, not ours
    with pytest.raises(UserError, match="not a checkpoint written by this package"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(UserError, match="no such file"):
        load_checkpoint(tmp_path / "missing.pt")
    assert load_checkpoint(good)["run"]["step"] == 1


def test_unreadable_checkpoints_in_translate_evaluate_and_average(run, tmp_path, call):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x00not a checkpoint" * 10)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((run / "best.pt").read_bytes()[:1000])
    cases = [
        (("translate", tmp_path / "missing.pt", "x"), "no such file"),
        (("translate", corrupt, "x"), "not a checkpoint"),
        (("evaluate", truncated), "truncated"),
        (("average", run / "best.pt", tmp_path / "missing.pt", "--output", tmp_path / "o.pt"), "no such file"),
        (("average", run / "best.pt", corrupt, "--output", tmp_path / "o.pt"), "not a checkpoint"),
        (
            ("average", run / "best.pt", run.parent / "other_shape.pt", "--output", tmp_path / "o.pt"),
            "different model configs (differing: d_ff)",
        ),
    ]
    for argv, message in cases:
        status, _, err = call(*argv)
        assert status == 2, argv
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, (argv, err)
    assert not (tmp_path / "o.pt").exists()


def _without(key: str):
    def damage(state: dict) -> None:
        del state[key]

    return damage


def _foreign_vocabulary(state: dict) -> None:
    state["vocab"] = b"\x00 not a SentencePiece model " * 8


@pytest.mark.parametrize(
    "damage, message",
    [
        (_without("model"), "has no 'model' (every checkpoint holds config, vocab, model)"),
        (_without("vocab"), "has no 'vocab' (every checkpoint holds config, vocab, model)"),
        (_foreign_vocabulary, "holds a vocabulary that is not a valid SentencePiece model ("),
    ],
    ids=["no model", "no vocab", "foreign vocabulary"],
)
def test_a_checkpoint_that_cannot_rebuild_a_model_is_named_in_one_line_everywhere(run, tmp_path, call, damage, message):
    """Our format with a key missing (a hand-edited file) used to end in KeyError: 'model' in train.init_from,
    translate and export hf; a vocabulary that is not a SentencePiece model, in SentencePiece's own message
    without the file's name. Every command that loads one names the file and what is wrong with it."""
    state = load_checkpoint(run / "best.pt")
    damage(state)
    broken = tmp_path / "broken.pt"
    save_checkpoint(state, broken)
    (tmp_path / "data").mkdir()
    raw = tiny_config(tmp_path, "ft", train={"init_from": str(broken)})
    config = write_config(tmp_path / "ft.yaml", raw)
    commands = [
        ("translate", broken, "ein hund"),
        ("evaluate", broken, "--src", tmp_path / "data" / "none.de", "--ref", tmp_path / "data" / "none.en"),
        ("attention", broken, "ein hund", "--out", tmp_path / "a.png"),
        ("average", run / "best.pt", broken, "--output", tmp_path / "avg.pt"),
        ("export", "hf", broken, tmp_path / "hf"),
        ("serve", broken, "--port", "0"),
        ("train", config),
        ("prepare", config),
    ]
    for argv in commands:
        status, _, err = call(*argv)
        lines = err.strip().splitlines()
        assert status == 2 and "Traceback" not in err, (argv, err)
        assert lines[-1].startswith("error: ") and f"checkpoint: {broken} {message}" in lines[-1], (argv, err)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "avg.pt").exists()
    assert not (tmp_path / "ft" / "store").exists()
