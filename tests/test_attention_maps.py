"""Attention inspection and plots: the recorded weights are the ones the model used; the figures get written."""

from __future__ import annotations

import json
import math
import random
import struct
import sys

import numpy as np
import pytest
import torch

from transformer.batch import Batch
from transformer.checkpoint import save_checkpoint
from transformer.cli import main
from transformer.config import Config, DataConfig, ModelConfig, to_dict
from transformer.errors import UserError
from transformer.attention_maps import KINDS, collect_attention, inspect_attention, recording
from transformer.model import Transformer
from transformer.vocab import PAD_ID, train_vocab

torch.set_num_threads(1)

WORDS = "the a cat dog sat on mat ran big small red blue house der die das Hund Katze lief schnell".split()


@pytest.fixture(scope="module")
def vocab():
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(300)]
    return train_vocab(sentences, 60)


@pytest.fixture(scope="module")
def cfg():
    return Config(model=ModelConfig(d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=3, d_ff=64,
                                    dropout=0.1, attention_dropout=0.1, max_positions=64),
                  data=DataConfig(max_len=40))


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
    pairs = [(vocab.encode(["the big dog ran on the mat"])[0], vocab.encode(["der Hund lief"])[0]),
             (vocab.encode(["a cat"])[0], vocab.encode(["die Katze lief schnell das Haus"])[0])]
    return Batch.from_pairs(pairs)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


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
    src_pad = batch.src == PAD_ID          # (B, S)
    tgt_pad = batch.tgt_in == PAD_ID       # (B, T)
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
            calls[name] = (key_value.detach(), output.detach())
        return fn

    handles = [m.register_forward_hook(hook((kind, i)), with_kwargs=True)
               for kind in KINDS for i, m in enumerate(modules[kind])]
    try:
        with torch.no_grad():  # fast path: record is None
            fast_logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        logits, weights = collect_attention(model, batch.src, batch.tgt_in)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(logits, fast_logits, atol=1e-5, rtol=1e-5)
    for (kind, i), (key_value, output) in calls.items():
        m = modules[kind][i]
        with torch.no_grad():
            v = m._split(m.v_proj(key_value))                            # (B, H, Tk, Dh)
            mixed = weights[kind][i] @ v                                  # (B, H, Tq, Dh)
            b, _, tq, _ = mixed.shape
            rebuilt = m.out_proj(mixed.transpose(1, 2).reshape(b, tq, -1))
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
    maps = inspect_attention(model, vocab, "the dog sat on the mat", "der Hund lief")
    assert maps.source_pieces[-1] == "</s>" and maps.target_pieces[0] == "<s>"
    assert maps.source_pieces[:-1] == vocab.pieces(vocab.encode(["the dog sat on the mat"])[0])
    for kind in KINDS:
        query, key = maps.axes(kind)
        assert isinstance(maps.weights[kind], np.ndarray)
        assert maps.weights[kind].shape[2:] == (len(query), len(key))
    assert maps.shape("decoder") == (3, 4) and maps.shape("encoder") == (2, 4)
    assert not maps.translated
    own = inspect_attention(model, vocab, "the dog sat", beam=1, max_len_offset=5)
    assert own.translated and own.weights["cross"].shape[2] == len(own.target_pieces)
    with pytest.raises(UserError, match="empty"):
        inspect_attention(model, vocab, "   ")


def test_attention_command_writes_pngs(checkpoint, tmp_path, capsys):
    from transformer.plots import DPI

    out = tmp_path / "att.png"
    main(["attention", str(checkpoint.parent), "the big dog ran", "--target", "der Hund lief", "--out", str(out)])
    printed = capsys.readouterr().out.split()
    paths = [tmp_path / f"att_{kind}.png" for kind in KINDS]
    assert printed == [str(p) for p in paths]
    sizes = {p.name: png_size(p) for p in paths}
    assert all(w > 300 and h > 200 for w, h in sizes.values())
    # Grids grow with the sentence; a longer one must give a bigger picture.
    long_out = tmp_path / "long.png"
    main(["attention", str(checkpoint), " ".join(["the big dog ran on the mat"] * 4), "--target",
          "der Hund lief", "--kind", "encoder", "--out", str(long_out)])
    assert png_size(long_out)[0] > sizes["att_encoder.png"][0]
    # One layer and head: one large map, written to exactly --out.
    single = tmp_path / "one.png"
    main(["attention", str(checkpoint), "the big dog", "--target", "der Hund", "--layer", "3", "--head", "2",
          "--kind", "cross", "--out", str(single)])
    assert capsys.readouterr().out.split()[-1] == str(single)
    assert png_size(single) == (7 * DPI, 6 * DPI)  # the minimum size, for a short sentence
    svg = tmp_path / "att.svg"
    main(["attention", str(checkpoint), "the dog", "--target", "der Hund", "--kind", "decoder", "--out", str(svg)])
    assert svg.read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("argv, message", [
    (["--layer", "4"], "--layer 4 is out of range: the encoder attention has 2 layers"),
    (["--head", "0"], "--head 0 is out of range"),
    (["--kind", "decoder", "--layer", "3", "--head", "5"], "--head 5 is out of range"),
])
def test_attention_bad_indexes(checkpoint, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["attention", str(checkpoint), "the dog", "--target", "der Hund", "--out", str(tmp_path / "x.png")]
             + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_figure_pixel_size_is_figsize_times_dpi(tmp_path):
    from transformer.plots import DPI, attention_grid, save

    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.ones(7), size=(2, 3, 5))
    fig = attention_grid(weights, list("abcde"), list("ABCDEFG"), "title")
    w, h = fig.get_size_inches()
    path = save(fig, tmp_path / "grid")  # no suffix: PNG
    assert path.suffix == ".png"
    assert png_size(path) == (round(w * DPI), round(h * DPI))
    with pytest.raises(UserError, match="supported image formats"):
        save(fig, tmp_path / "grid.jpeg")


def test_plot_positions(tmp_path, capsys):
    out = tmp_path / "pos.png"
    main(["plot-positions", "--d-model", "64", "--length", "50", "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    w, h = png_size(out)
    assert w > h > 300
    with pytest.raises(SystemExit):
        main(["plot-positions", "--d-model", "63", "--out", str(out)])
    assert "even" in capsys.readouterr().err


def write_metrics(path, bleu: bool) -> None:
    with path.open("w") as f:
        for step in range(10, 201, 10):
            f.write(json.dumps({"step": step, "split": "train", "loss": 5 / math.sqrt(step), "lr": 1e-3,
                                "tokens_per_s": 1000.0}) + "\n")
            if step % 50 == 0:
                row = {"step": step, "split": "valid", "loss": 6 / math.sqrt(step), "nll": 1.0, "ppl": 2.7}
                if bleu:
                    row["bleu"] = step / 10
                f.write(json.dumps(row) + "\n")
        f.write('{"step": 210, "split": "tr')  # a line cut off by a running job


def test_plot_training_curves(tmp_path, capsys):
    from transformer.plots import DPI

    run = tmp_path / "run"
    run.mkdir()
    write_metrics(run / "metrics.jsonl", bleu=False)
    main(["plot", str(run), "--out", str(tmp_path / "curves.png")])
    without_bleu = png_size(tmp_path / "curves.png")
    write_metrics(run / "metrics.jsonl", bleu=True)
    main(["plot", str(run / "metrics.jsonl"), "--out", str(tmp_path / "curves_bleu.png")])
    with_bleu = png_size(tmp_path / "curves_bleu.png")
    assert without_bleu[0] == with_bleu[0] == 8 * DPI
    assert with_bleu[1] > without_bleu[1], "the BLEU panel appears only when BLEU is logged"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")])
    assert "no metrics file" in capsys.readouterr().err


def test_training_curves_against_wall_time():
    from transformer.plots import _series, training_curves

    rows = [{"step": 100, "split": "valid", "loss": 3.0, "elapsed": 60.0},
            {"step": 200, "split": "valid", "loss": 2.5, "elapsed": 150.0},
            {"step": 200, "split": "valid", "loss": 2.4, "elapsed": 180.0},  # redone after a resume: the later wins
            {"step": 300, "split": "valid", "loss": 2.2}]                    # an older run's line: no time
    assert _series(rows, "valid", "loss", "elapsed") == ([1.0, 3.0], [3.0, 2.4])
    assert _series(rows, "valid", "loss") == ([100, 200, 300], [3.0, 2.4, 2.2])
    with pytest.raises(UserError, match="against time"):
        training_curves([{"step": 1, "split": "train", "loss": 1.0}], x="elapsed")


def test_missing_matplotlib_is_a_user_error(monkeypatch, tmp_path, capsys):
    from transformer import plots

    # None in sys.modules makes `import matplotlib...` raise ImportError, as if not installed.
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"pip install 'transformer\[plot\]'"):
        plots.positional_encoding(16, 10)
    with pytest.raises(SystemExit):
        main(["plot-positions", "--out", str(tmp_path / "p.png")])
    assert "pip install" in capsys.readouterr().err
