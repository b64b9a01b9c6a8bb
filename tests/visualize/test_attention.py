"""Attention inspection: the recorded weights are the ones the model used, and the `attention` command's figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import png_size, sentences
from transformer.cli import main
from transformer.config import Config, DataConfig, ModelConfig, to_dict
from transformer.data.batch import Batch, target_mask
from transformer.data.vocab import PAD_ID, train_vocab
from transformer.errors import UserError
from transformer.inference.settings import SearchSettings
from transformer.model.checkpoint import save_checkpoint
from transformer.model.transformer import Transformer
from transformer.visualize.attention import KINDS, collect_attention, inspect_attention, recording


@pytest.fixture(scope="module")
def vocab():
    return train_vocab(sentences(0, 300, lo=3, hi=10), 120)  # large enough for whole words: short maps


@pytest.fixture(scope="module")
def cfg():
    return Config(
        model=ModelConfig(
            d_model=32,
            n_heads=4,
            n_encoder_layers=2,
            n_decoder_layers=3,
            d_ff=64,
            dropout=0.1,
            attention_dropout=0.1,
            max_positions=64,
        ),
        data=DataConfig(max_len=40),
    )


@pytest.fixture(scope="module")
def model(vocab, cfg):
    torch.manual_seed(0)
    return Transformer(cfg.model, len(vocab)).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model, vocab, cfg):
    path = tmp_path_factory.mktemp("run") / "best.pt"
    save_checkpoint({"config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict()}, path)
    return path


def padded_batch(vocab) -> Batch:
    pairs = [
        (vocab.encode(["the big dog runs on the house"])[0], vocab.encode(["der hund läuft"])[0]),
        (vocab.encode(["a cat"])[0], vocab.encode(["die katze läuft auf dem haus"])[0]),
    ]
    return Batch.from_pairs(pairs)


def test_weights_are_distributions_and_respect_masks(model, vocab):
    batch = padded_batch(vocab)
    _, weights = collect_attention(model, batch.src, batch.tgt_in)
    b, s = batch.src.shape
    t = batch.tgt_in.size(1)
    expected = {"encoder": (2, b, 4, s, s), "decoder": (3, b, 4, t, t), "cross": (3, b, 4, t, s)}
    for kind in KINDS:
        w = weights[kind]
        assert tuple(w.shape) == expected[kind]
        assert torch.isfinite(w).all() and (w >= 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    src_pad = batch.src == PAD_ID  # (B, S)
    tgt_pad = batch.tgt_in == PAD_ID  # (B, T)
    assert src_pad.any() and tgt_pad.any(), "the batch must contain padding on both sides"
    for kind, pad in (("encoder", src_pad), ("cross", src_pad), ("decoder", tgt_pad)):
        keys = pad[None, :, None, None, :].expand_as(weights[kind])
        assert (weights[kind][keys] == 0).all(), f"{kind}: padded keys got weight"
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    assert (weights["decoder"][..., future] == 0).all(), "decoder self-attention looks ahead"


def test_weights_reproduce_the_fast_path_output(model, vocab):
    """Recorded weights applied to the module's V projection, then out_proj, give back the output the
    module produced with the fused kernel: the weights are the ones the model actually used."""
    batch = padded_batch(vocab)
    modules = model.attention_modules()
    calls = {}

    def hook(name):
        def fn(module, args, kwargs, output):
            key_value = args[1] if len(args) > 1 else kwargs["key_value"]
            calls[name] = (key_value.detach(), output.detach(), kwargs.get("packing"))

        return fn

    handles = [
        m.register_forward_hook(hook((kind, i)), with_kwargs=True)
        for kind in KINDS
        for i, m in enumerate(modules[kind])
    ]
    try:
        with torch.no_grad():  # fast path: record is None; the explicit mask collect_attention uses
            fast_logits = model(batch.src, batch.tgt_in, batch.src_mask, target_mask(batch.tgt_in))
        logits, weights = collect_attention(model, batch.src, batch.tgt_in)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(logits, fast_logits, atol=1e-5, rtol=1e-5)
    for (kind, i), (key_value, output, packing) in calls.items():
        m = modules[kind][i]
        with torch.no_grad():
            v = m._project(m.v_proj, key_value, packing)  # (B, H, Tk, Dh)
            mixed = weights[kind][i] @ v  # (B, H, Tq, Dh)
            b, _, tq, _ = mixed.shape
            mixed = mixed.transpose(1, 2).reshape(b, tq, -1)  # (B, Tq, C)
            rebuilt = m.out_proj(packing.pack(mixed) if packing is not None else mixed)
        torch.testing.assert_close(rebuilt, output, atol=1e-5, rtol=1e-4, msg=lambda m: f"{kind} {i}: {m}")
    assert len(calls) == 2 + 3 + 3


def test_recording_is_switched_off_afterwards(model, vocab):
    modules = [m for kind in KINDS for m in model.attention_modules()[kind]]
    batch = padded_batch(vocab)
    collect_attention(model, batch.src, batch.tgt_in)
    assert all(m.record is None for m in modules)
    with pytest.raises(RuntimeError):
        with recording(model):
            assert all(m.record == [] for m in modules)
            raise RuntimeError("boom")
    assert all(m.record is None for m in modules)
    model.train()
    collect_attention(model, batch.src, batch.tgt_in)
    assert model.training, "collecting must not leave the model in eval mode"
    model.eval()


def test_inspect_sentence_pieces_and_translation(model, vocab):
    maps = inspect_attention(model, vocab, "the dog sits on the house", "der hund läuft")
    assert maps.source_pieces[-1] == "</s>" and maps.target_pieces[0] == "<s>"
    assert maps.source_pieces[:-1] == vocab.pieces(vocab.encode(["the dog sits on the house"])[0])
    for kind in KINDS:
        query, key = maps.axes(kind)
        assert isinstance(maps.weights[kind], np.ndarray)
        assert maps.weights[kind].shape[2:] == (len(query), len(key))
    assert maps.shape("decoder") == (3, 4) and maps.shape("encoder") == (2, 4)
    assert not maps.translated
    own = inspect_attention(model, vocab, "the dog sits", settings=SearchSettings(beam=1, max_len_offset=5))
    assert own.translated and own.weights["cross"].shape[2] == len(own.target_pieces)
    with pytest.raises(UserError, match="empty"):
        inspect_attention(model, vocab, "   ")


def test_attention_command_writes_pngs(checkpoint, tmp_path, capsys):
    from transformer.visualize.plots import DPI

    out = tmp_path / "att.png"
    main(["attention", str(checkpoint.parent), "the big dog runs", "--target", "der hund läuft", "--out", str(out)])
    printed = capsys.readouterr().out.split()
    paths = [tmp_path / f"att_{kind}.png" for kind in KINDS]
    assert printed == [str(p) for p in paths]
    sizes = {p.name: png_size(p) for p in paths}
    assert all(w > 300 and h > 200 for w, h in sizes.values())
    # Grids grow with the sentence; a longer one must give a bigger picture.
    long_out = tmp_path / "long.png"
    main(
        [
            "attention",
            str(checkpoint),
            " ".join(["the big dog runs on the house"] * 4),
            "--target",
            "der hund läuft",
            "--kind",
            "encoder",
            "--out",
            str(long_out),
        ]
    )
    assert png_size(long_out)[0] > sizes["att_encoder.png"][0]
    # One layer and head: one large map, written to exactly --out.
    single = tmp_path / "one.png"
    main(
        [
            "attention",
            str(checkpoint),
            "the big dog",
            "--target",
            "der hund",
            "--layer",
            "3",
            "--head",
            "2",
            "--kind",
            "cross",
            "--out",
            str(single),
        ]
    )
    assert capsys.readouterr().out.split()[-1] == str(single)
    assert png_size(single) == (7 * DPI, 6 * DPI)  # the minimum size, for a short sentence
    svg = tmp_path / "att.svg"
    main(["attention", str(checkpoint), "the dog", "--target", "der hund", "--kind", "decoder", "--out", str(svg)])
    assert svg.read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layer", "4"], "--layer 4 is out of range: the encoder attention has 2 layers"),
        (["--head", "0"], "--head 0 is out of range"),
        (["--kind", "decoder", "--layer", "3", "--head", "5"], "--head 5 is out of range"),
    ],
)
def test_attention_bad_indexes(checkpoint, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["attention", str(checkpoint), "the dog", "--target", "der hund", "--out", str(tmp_path / "x.png")] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_target_is_read_up_to_the_decoders_positions_and_the_limit_counts_its_pieces(model, vocab, cfg):
    """max_positions 64: BOS and 63 pieces fit; the message counts the target's pieces, not BOS."""
    word = next(w for w in ("der", "die", "das", "hund") if len(vocab.encode([w])[0]) == 1)
    fits = inspect_attention(model, vocab, "the dog", " ".join([word] * (cfg.model.max_positions - 1)))
    assert len(fits.target_pieces) == cfg.model.max_positions
    with pytest.raises(
        UserError,
        match=f"is {cfg.model.max_positions} pieces long; this model accepts at most {cfg.model.max_positions - 1}$",
    ):
        inspect_attention(model, vocab, "the dog", " ".join([word] * cfg.model.max_positions))
