"""`transformer animate`: a GIF of one picture per frame at 800 pixels wide, an MP4 through ffmpeg, a folder of PNG
frames; an output that exists is refused without --force and never half-written; every scene draws."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import png_size, sentences
from transformer.config import from_dict
from transformer.data.vocab import train_vocab
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model.transformer import Transformer
from transformer.visualize import animation
from transformer.visualize.walkthrough import frames, walk

pytest.importorskip("matplotlib", reason="the 'plot' extra is not installed")
from PIL import Image  # noqa: E402  (Pillow comes with matplotlib)

SENTENCE = "der mann sitzt"


def expected_frames(checkpoint: Path, sentence: str, **kwargs) -> list:
    translator = Translator(checkpoint, "cpu", SearchFlags(dtype="fp32"))
    return frames(walk(translator.model, translator.vocab, sentence, translator.settings, **kwargs))


def only_ours(folder: Path) -> None:
    """No temporary file or folder left beside the output."""
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_the_gif_holds_one_picture_per_frame_at_800_pixels(copy_model, tmp_path, call):
    out = tmp_path / "walk.gif"
    status, stdout, err = call("animate", copy_model, SENTENCE, "--out", out, "--fps", "2")
    assert status == 0, err
    assert stdout.strip() == str(out) and f"translation: {SENTENCE}" in err  # the copy model copies
    shown = expected_frames(copy_model, SENTENCE)
    with Image.open(out) as gif:
        assert gif.format == "GIF" and gif.size == (800, 500) and gif.n_frames == len(shown)
        held = []
        for i in range(gif.n_frames):
            gif.seek(i)
            held.append(gif.info["duration"])
    assert held == [500 * f.hold for f in shown] and held[-1] == 1500
    assert out.stat().st_size < 1_000_000
    only_ours(tmp_path)


def test_an_existing_output_is_refused_without_force_and_kept_when_drawing_fails(
    copy_model, tmp_path, call, monkeypatch
):
    out = tmp_path / "walk.gif"
    out.write_bytes(b"GIF89a someone's")
    status, _, err = call("animate", copy_model, SENTENCE, "--out", out)
    assert (status, err) == (2, f"error: animate: {out} exists; add --force to replace it\n")

    def broken(frames):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(animation, "render", broken)
    status, _, err = call("animate", copy_model, SENTENCE, "--out", out, "--force")
    assert status == 2 and out.read_bytes() == b"GIF89a someone's"
    only_ours(tmp_path)
    monkeypatch.undo()
    status, _, _ = call("animate", copy_model, SENTENCE, "--out", out, "--force", "--only", "encoder")
    assert status == 0 and out.read_bytes()[:6] == b"GIF89a" and out.stat().st_size > 10_000


def test_a_folder_of_png_frames_replaced_only_when_it_holds_frames(copy_model, tmp_path, call, monkeypatch):
    out = tmp_path / "frames"
    status, stdout, err = call("animate", copy_model, SENTENCE, "--out", out, "--only", "encoder")
    assert status == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        f"frame_{i:03d}.png" for i in range(1, len(expected_frames(copy_model, SENTENCE, only="encoder")) + 1)
    ]
    assert png_size(out / names[0]) == (800, 500)
    status, _, err = call("animate", copy_model, SENTENCE, "--out", out, "--only", "decoder")
    assert status == 2 and "exists; add --force" in err
    calls = []

    def failing(self, *args, **kwargs):  # the third frame cannot be written: the folder stays as it was
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    real = Image.Image.save
    monkeypatch.setattr(Image.Image, "save", failing)
    status, _, err = call("animate", copy_model, SENTENCE, "--out", out, "--force", "--only", "decoder")
    assert status == 2 and "No space left on device" in err
    assert sorted(p.name for p in out.iterdir()) == names
    monkeypatch.undo()
    status, _, _ = call("animate", copy_model, SENTENCE, "--out", out, "--force", "--only", "decoder")
    assert status == 0 and len(list(out.iterdir())) == len(expected_frames(copy_model, SENTENCE, only="decoder"))
    only_ours(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    status, _, err = call("animate", copy_model, SENTENCE, "--out", mine, "--force")
    assert status == 2 and "holds files that are not an animation's frames (notes.txt)" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def fake_ffmpeg(folder: Path) -> Path:
    """An `ffmpeg` that writes how many bytes of raw frames it was piped, to the file named last."""
    folder.mkdir()
    ffmpeg = folder / "ffmpeg"
    ffmpeg.write_text(
        f"#!{sys.executable}\nimport sys\ndata = sys.stdin.buffer.read()\n"
        "open(sys.argv[-1], 'w').write(str(len(data)))\n"
    )
    ffmpeg.chmod(0o755)
    return folder


def test_mp4_goes_through_ffmpeg_or_names_it(copy_model, tmp_path, call, monkeypatch):
    out = tmp_path / "walk.mp4"
    monkeypatch.setenv("PATH", str(tmp_path))  # no ffmpeg there
    status, _, err = call("animate", copy_model, SENTENCE, "--out", out)
    assert status == 2 and err.startswith("error: animate: writing .mp4 needs ffmpeg on PATH") and not out.exists()
    monkeypatch.setenv("PATH", str(fake_ffmpeg(tmp_path / "bin")))
    status, _, err = call("animate", copy_model, SENTENCE, "--out", out, "--only", "encoder", "--fps", "3")
    assert status == 0, err
    shown = expected_frames(copy_model, SENTENCE, only="encoder")
    assert int(out.read_text()) == sum(f.hold for f in shown) * 800 * 500 * 4  # every frame, RGBA, held as long
    only_ours(tmp_path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "{tmp}/walk.png"], "animate: cannot write {tmp}/walk.png: give FILE.gif, FILE.mp4, or a folder"),
        (["--out", "{tmp}/walk.gif", "--fps", "0"], "animate: --fps must be between 0.1 and 50, got 0"),
        (["--out", "{tmp}/walk.gif", "--layer", "2"], "--layer 2 is out of range: the encoder has 1 layer, numbered"),
        (["--out", "{tmp}/walk.gif", "--head", "2"], "--head 2 is out of range: the encoder has 1 head, numbered"),
        (
            ["--out", "{tmp}/walk.gif", "--layer", "3", "--only", "decoder"],
            "--layer 3 is out of range: the decoder has 2 layers",
        ),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(copy_model, tmp_path, call, argv, message):
    status, _, err = call("animate", copy_model, SENTENCE, *[a.format(tmp=tmp_path) for a in argv])
    assert status == 2 and err.startswith(f"error: {message.format(tmp=tmp_path)}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_every_scene_draws_at_the_frame_size_also_with_many_heads_and_a_long_sentence(tmp_path):
    """16 heads in two rows; a sentence longer than a frame shows, cut; each picture 800 x 500, none blank."""
    vocab = train_vocab(sentences(0, 300), vocab_size=80)
    torch.manual_seed(0)
    shape = {"d_model": 32, "n_heads": 16, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 32, "dropout": 0.0}
    cfg = from_dict({"model": {**shape, "max_positions": 64, "norm": "pre"}, "data": {"max_len": 40}})
    model = Transformer(cfg.model, len(vocab)).eval()
    long = " ".join(sentences(4, 1, lo=14, hi=14)) + r" auf dem $\haus$"  # not mathtext, which would fail
    shown = frames(walk(model, vocab, long, SearchSettings(beam=1, max_len_offset=3)))
    assert {f.scene for f in shown} == set(animation.SCENES) and shown[0].note
    pictures = animation.render(shown)
    assert all(p.shape == (500, 800, 3) and p.dtype == np.uint8 for p in pictures)
    assert all((p < 250).any(axis=2).mean() > 0.05 for p in pictures)  # drawn on, not blank
    assert len({p.tobytes() for p in pictures}) == len(pictures)  # every frame shows something new
    data = animation.gif_bytes(pictures, animation.durations(shown, 1.0))
    (tmp_path / "w.gif").write_bytes(data)
    with Image.open(tmp_path / "w.gif") as gif:
        assert gif.n_frames == len(shown)
