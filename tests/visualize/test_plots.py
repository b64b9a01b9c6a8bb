"""Figures: pixel sizes, formats, the positional-encoding table, training curves, and matplotlib as an option."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from tests.helpers import png_size
from transformer.cli import main
from transformer.errors import UserError


def test_figure_pixel_size_is_figsize_times_dpi(tmp_path):
    from transformer.visualize.plots import DPI, attention_grid, save

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


def test_plot_positions_draws_each_kind_and_a_models_own(tmp_path, call):
    for kind in ("rotary", "marian"):
        status, out, err = call(
            "plot-positions", "--kind", kind, "--d-model", "64", "--length", "20", "--out", tmp_path / f"{kind}.png"
        )
        assert status == 0 and (tmp_path / f"{kind}.png").stat().st_size > 1000, err
    status, _, err = call(
        "plot-positions", "--kind", "rotary", "--d-model", "64", "--n-heads", "64", "--out", tmp_path / "x.png"
    )
    assert status == 2 and "rotary positions need an even head size (--d-model / --n-heads" in err
    status, _, err = call("plot-positions", "--kind", "learned", "--out", tmp_path / "x.png")
    assert status == 2 and "a table a model learns" in err
    # A learned table exists only in a model: --model (tests below)


def write_metrics(path, bleu: bool) -> None:
    with path.open("w") as f:
        for step in range(10, 201, 10):
            f.write(
                json.dumps(
                    {"step": step, "split": "train", "loss": 5 / math.sqrt(step), "lr": 1e-3, "tokens_per_s": 1000.0}
                )
                + "\n"
            )
            if step % 50 == 0:
                row = {"step": step, "split": "valid", "loss": 6 / math.sqrt(step), "nll": 1.0, "ppl": 2.7}
                if bleu:
                    row["bleu"] = step / 10
                f.write(json.dumps(row) + "\n")
        f.write('{"step": 210, "split": "tr')  # a line cut off by a running job


def test_plot_training_curves(tmp_path, capsys):
    from transformer.visualize.plots import DPI

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
    from transformer.visualize.plots import _series, training_curves

    rows = [
        {"step": 100, "split": "valid", "loss": 3.0, "elapsed": 60.0},
        {"step": 200, "split": "valid", "loss": 2.5, "elapsed": 150.0},
        {"step": 200, "split": "valid", "loss": 2.4, "elapsed": 180.0},  # redone after a resume: the later wins
        {"step": 300, "split": "valid", "loss": 2.2},
    ]  # an older run's line: no time
    assert _series(rows, "valid", "loss", "elapsed") == ([1.0, 3.0], [3.0, 2.4])
    assert _series(rows, "valid", "loss") == ([100, 200, 300], [3.0, 2.4, 2.2])
    with pytest.raises(UserError, match="against time"):
        training_curves([{"step": 1, "split": "train", "loss": 1.0}], x="elapsed")


def test_missing_matplotlib_is_a_user_error(monkeypatch, tmp_path, capsys):
    from transformer.visualize import plots

    # None in sys.modules makes `import matplotlib...` raise ImportError, as if not installed.
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"pip install 'transformer\[plot\]'"):
        plots.positional_encoding(16, 10)
    with pytest.raises(SystemExit):
        main(["plot-positions", "--out", str(tmp_path / "p.png")])
    assert "pip install" in capsys.readouterr().err


def test_each_score_validation_logged_gets_a_panel():
    pytest.importorskip("matplotlib")
    from transformer.inference.scoring import SCORES
    from transformer.visualize.plots import training_curves

    rows = [{"step": s, "split": "valid", "loss": 3.0 / s, "bleu": float(s), "chrf": 20.0 + s} for s in (1, 2)]
    labels = [ax.get_ylabel() for ax in training_curves(rows).axes]
    assert [label for label in labels if label in {f"valid {s.label}" for s in SCORES}] == ["valid BLEU", "valid chrF"]
