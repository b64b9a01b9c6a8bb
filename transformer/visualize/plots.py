"""Figures: attention grids and maps, the positional-encoding table, and training curves (matplotlib, Agg)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from transformer.config import DEFAULT_POSITIONS
from transformer.errors import UserError, out_of_memory_names
from transformer.files import check_output_path, refuse_directory
from transformer.inference.scoring import SCORES

DPI = 100
FORMATS = ("png", "svg", "pdf")
MAX_TABLE_VALUES = 50_000_000  # plot-positions: 200 MB of float32, far past what a figure can show


def require_matplotlib():
    """Import matplotlib on first use: it is an optional dependency (the `plot` extra)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "plotting needs matplotlib: pip install 'transformer[plot]' (or pip install matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def new_figure(width: float, height: float, layout: str | None = "constrained"):
    """A Figure on its own Agg canvas: no pyplot, so no global backend switch and no figure leak."""
    Figure, FigureCanvasAgg = require_matplotlib()
    # Whole pixels, so the saved image is exactly figsize * DPI (Agg would truncate a fraction).
    width, height = round(width * DPI) / DPI, round(height * DPI) / DPI
    fig = Figure(figsize=(width, height), dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def output_path(path: str | Path, command: str = "plot") -> Path:
    """PNG unless the suffix names another supported format."""
    path = refuse_directory(path, command)  # before ".png" makes DIR a file beside it
    if not path.suffix:
        return path.with_suffix(".png")
    if path.suffix.lower().lstrip(".") not in FORMATS:
        raise UserError(f"cannot write {path}: supported image formats are " + ", ".join("." + f for f in FORMATS))
    return path


def save(fig, path: str | Path, command: str = "plot") -> Path:
    path = check_output_path(output_path(path, command), command=command)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    # A fixed canvas (no bbox_inches="tight"): the pixel size is figsize * DPI, predictable for docs.
    fig.savefig(path, dpi=DPI, format=path.suffix.lower().lstrip("."))
    return path


# ----------------------------------------------------------------------------- attention


def _clean(pieces: Sequence[str]) -> list[str]:
    # SentencePiece marks word starts with U+2581; keep it (it shows word boundaries) but make
    # sure nothing is empty, or the tick would silently vanish.
    return [p if p.strip() else repr(p) for p in pieces]


def _fit(text: str, width_in: float, font_pt: float, max_lines: int = 2) -> str:
    """Wrap each line of a title to the figure width; a very long sentence ends in an ellipsis."""
    chars = max(20, int(width_in * 72 / (0.55 * font_pt)))
    out = []
    for line in text.split("\n"):
        wrapped = textwrap.wrap(line, chars) or [""]
        if len(wrapped) > max_lines:
            wrapped = wrapped[: max_lines - 1] + [textwrap.shorten(" ".join(wrapped[max_lines - 1 :]), chars)]
        out.extend(wrapped)
    return "\n".join(out)


def _label_font(cell_pt: float) -> float:
    """Tick-label font size (points) for cells of `cell_pt` points: as large as fits, 4..9."""
    return min(9.0, max(4.0, 0.8 * cell_pt))


def _label_axes(ax, query: Sequence[str], key: Sequence[str], cell_pt: float, show_x: bool, show_y: bool) -> None:
    """Piece labels on the ticks; on long sentences every k-th so that labels never overlap."""
    size = _label_font(cell_pt)
    step = max(1, math.ceil(size / max(cell_pt, 1e-6)))
    for labels, set_ticks, set_labels, show, rotation in (
        (key, ax.set_xticks, ax.set_xticklabels, show_x, 90),
        (query, ax.set_yticks, ax.set_yticklabels, show_y, 0),
    ):
        # Inner panels of a grid get no ticks at all: thousands of tick artists make a
        # 6 x 8 grid slow to draw, and the outer panels label the same rows and columns.
        ticks = list(range(0, len(labels), step)) if show else []
        set_ticks(ticks)
        if show:
            set_labels([_clean(labels)[i] for i in ticks], fontsize=size, rotation=rotation)
    ax.tick_params(length=1.5, pad=1)


def _cmap():
    from matplotlib import colormaps

    # Forbidden (masked) cells are 0 too; grey keeps them apart from "allowed but ignored".
    return colormaps["viridis"].with_extremes(bad="0.85")


def _masked(weights: np.ndarray, masked: np.ndarray | None):
    return weights if masked is None else np.ma.masked_array(weights, mask=masked)


def attention_grid(
    weights: np.ndarray,  # (L, H, Tq, Tk)
    query: Sequence[str],
    key: Sequence[str],
    title: str,
    query_axis: str = "query",
    key_axis: str = "key",
    layers: Sequence[int] | None = None,  # 1-based labels of the rows of `weights`
    heads: Sequence[int] | None = None,
    masked: np.ndarray | None = None,  # (Tq, Tk) True where attention is forbidden: drawn grey
):
    """One panel per (layer, head): layers down, heads across; one colour scale 0..1 for all."""
    n_layers, n_heads, tq, tk = weights.shape
    layers = list(layers) if layers is not None else list(range(1, n_layers + 1))
    heads = list(heads) if heads is not None else list(range(1, n_heads + 1))
    longest = max(tq, tk)
    # Panels grow with the sentence until 4.5 in, then the cells shrink (and labels get thinned).
    cell = min(4.5, max(1.8, 0.16 * longest)) / longest  # inches per token
    pw, ph = tk * cell, tq * cell
    font = _label_font(cell * 72)
    # Laid out by hand, in inches: a layout engine measures every label of every panel, slow on a
    # 6 x 8 grid; this also makes the pixel size a plain formula.
    label_x = 0.15 + 0.6 * font / 72 * max(len(p) for p in _clean(key))  # rotated key labels
    label_y = 0.15 + 0.6 * font / 72 * max(len(p) for p in _clean(query))
    gap_w = 0.12
    left, right = 0.35 + label_y, 1.1  # axis name; colorbar
    width = left + n_heads * pw + (n_heads - 1) * gap_w + right
    title_font = min(18.0, max(10.0, 0.4 * width))  # big grids are viewed zoomed out
    panel_font = min(12.0, max(6.0, pw * 72 / 9))
    gap_h = 0.12 + 1.3 * panel_font / 72
    title = _fit(title, width - 0.4, title_font)
    bottom, top = 0.35 + label_x, 0.2 + 1.4 * title_font / 72 * (title.count("\n") + 1)
    height = bottom + n_layers * ph + n_layers * gap_h + top
    if height < 3.6:  # one row of short panels: leave room for the colorbar and the axis name
        bottom += 3.6 - height
        height = 3.6
    fig = new_figure(width, height, layout=None)
    image = None
    for i in range(n_layers):
        for j in range(n_heads):
            x = left + j * (pw + gap_w)
            y = height - top - gap_h - i * (ph + gap_h) - ph
            ax = fig.add_axes((x / width, y / height, pw / width, ph / height))
            image = ax.imshow(
                _masked(weights[i, j], masked), vmin=0.0, vmax=1.0, cmap=_cmap(), aspect="auto", interpolation="nearest"
            )
            ax.set_title(f"layer {layers[i]}, head {heads[j]}", fontsize=panel_font, pad=2)
            _label_axes(ax, query, key, cell * 72, show_x=(i == n_layers - 1), show_y=(j == 0))
    grid_h = n_layers * (ph + gap_h) - gap_h
    bar_h = min(height - top - 0.3, max(2.2, 0.6 * grid_h))
    bar_y = min(max(0.3, bottom + (grid_h - bar_h) / 2), height - top - bar_h)
    cax = fig.add_axes(((width - right + 0.2) / width, bar_y / height, 0.15 / width, bar_h / height))
    bar = fig.colorbar(image, cax=cax)
    bar.set_label("attention weight (each row sums to 1)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=title_font, y=1 - 0.1 / height, va="top")
    # Axis names right next to the piece labels, also when extra height left space below them.
    fig.text(
        0.5 * (left + width - right) / width,
        (bottom - label_x - 0.05) / height,
        key_axis,
        ha="center",
        va="top",
        fontsize=9,
    )
    half = 0.65 * 9 / 72 * len(query_axis) / 2  # half the length of the rotated name, inches
    fig.text(
        0.08 / width,
        min(max(half + 0.05, bottom + grid_h / 2), height - half - 0.05) / height,
        query_axis,
        rotation=90,
        ha="left",
        va="center",
        fontsize=9,
    )
    return fig


def attention_map(
    weights: np.ndarray,  # (Tq, Tk)
    query: Sequence[str],
    key: Sequence[str],
    title: str,
    query_axis: str = "query",
    key_axis: str = "key",
    masked: np.ndarray | None = None,
):
    """One (layer, head) large, every piece labelled, and the weight printed in cells when they fit."""
    tq, tk = weights.shape
    longest = max(tq, tk)
    cell_in = min(0.6, max(0.12, 10.0 / longest))
    label_room = 0.4 + 0.08 * max(len(p) for p in list(query) + list(key))
    # Never smaller than a page-width figure, or the titles and colorbar crowd a short sentence.
    fig = new_figure(max(7.0, tk * cell_in + label_room + 1.6), max(6.0, tq * cell_in + label_room + 1.6))
    ax = fig.subplots()
    image = ax.imshow(
        _masked(weights, masked), vmin=0.0, vmax=1.0, cmap=_cmap(), aspect="equal", interpolation="nearest"
    )
    _label_axes(ax, query, key, cell_in * 72, show_x=True, show_y=True)
    if cell_in >= 0.35:  # numbers only where they are legible
        for (r, c), w in np.ndenumerate(weights):
            if w >= 0.005:
                ax.text(
                    c,
                    r,
                    f"{w:.2f}"[1:] if w < 0.995 else "1",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if w > 0.6 else "white",
                )
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("attention weight (each row sums to 1)")
    ax.set_title(_fit(title, fig.get_figwidth() - 0.4, 11), fontsize=11)
    ax.set_xlabel(key_axis)
    ax.set_ylabel(query_axis)
    return fig


# ----------------------------------------------------------------------------- positions


DEFAULT_LENGTH = 100  # positions plot-positions shows unless told


def positional_encoding(
    d_model: int | None,
    length: int | None,
    kind: str | None = None,
    n_heads: int | None = None,
    model: str | None = None,
):
    """What a kind of position shows (Positions.view), as heat maps: one row per position. Without `model`, the kind
    at d_model (512) and n_heads (8; rotary's head size); with `model` (a run directory or checkpoint), that
    model's own positions, whose kind and sizes it fixes (a learned table exists only there). length: positions
    0 .. length-1; None: DEFAULT_LENGTH, or the model's positions where it has fewer."""
    if model is not None and (kind, d_model, n_heads) != (None, None, None):
        raise UserError(
            "plot-positions: --model takes the kind, --d-model and --n-heads from the model; give one or the other"
        )
    if length is not None and length < 1:
        raise UserError(f"--length must be at least 1, got {length}")
    require_matplotlib()  # before a checkpoint is read
    from transformer.model import positions  # torch: only for this figure
    from transformer.model.checkpoint import load_model

    if model is not None:
        loaded = load_model(model)[0].position_encoding
        d_model = loaded.d_model
        length = min(DEFAULT_LENGTH, loaded.max_positions) if length is None else length
    length = DEFAULT_LENGTH if length is None else length
    d_model = 512 if d_model is None else d_model
    if d_model * length > MAX_TABLE_VALUES:  # drawn as one image, and held in memory as one table
        raise UserError(
            f"--length x --d-model is {length:,} x {d_model:,}; the plotted table may hold at most "
            f"{MAX_TABLE_VALUES:,} values"
        )
    with out_of_memory_names(f"the table of --length {length} x --d-model {d_model}"):
        if model is not None:
            view = loaded.view(length)
        else:
            kind = DEFAULT_POSITIONS if kind is None else kind
            view = positions.settings_view(kind, d_model, 8 if n_heads is None else n_heads, length, NAMES)
    return _positions_figure(view, length)


NAMES = ("--d-model", "--n-heads")  # how plot-positions' user gives the sizes a kind of position may need


def _positions_figure(view, length: int):
    tables = [(name, table.numpy()) for name, table in view.tables.items()]
    width = max((t.shape[1] for _, t in tables), default=1)
    fig = new_figure(
        min(14.0, max(8.0, 4.0 + width / 64)), min(9.0, max(5.0, 3.0 + length / 25)) * max(1, len(tables)) ** 0.5
    )
    if not tables:  # a kind with nothing to draw: the figure says so
        fig.text(0.5, 0.5, textwrap.fill(view.note, 90), ha="center", va="center", fontsize=11)
        fig.suptitle(view.title)
        return fig
    scale = max(1e-9, max(float(np.abs(t).max()) for _, t in tables))  # sin and cos: 1; a learned table: its own
    axes = fig.subplots(len(tables), 1, squeeze=False)[:, 0]
    for ax, (name, table) in zip(axes, tables):
        image = ax.imshow(table, cmap="RdBu_r", vmin=-scale, vmax=scale, aspect="auto", interpolation="nearest")
        ax.set_ylabel(f"{name}: position" if len(tables) > 1 else "position in the sequence")
    axes[-1].set_xlabel(view.columns)
    fig.suptitle(_fit(f"{view.title}, positions 0..{length - 1}", fig.get_figwidth() - 0.4, 11), fontsize=11)
    bar = fig.colorbar(image, ax=list(axes), fraction=0.04, pad=0.02)
    bar.set_label(view.values)
    return fig


# ----------------------------------------------------------------------------- training curves


def _series(rows: list[dict], split: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x values, key values) of one split's rows; x is "step" or "elapsed" (training seconds since the start)."""
    points = [
        (r["step"], r.get("elapsed"), r[key])
        for r in rows
        if r.get("split") == split and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    # A resumed run logs some steps twice; the later line wins.
    latest = {step: (elapsed, value) for step, elapsed, value in points}
    steps = sorted(latest)
    if x == "elapsed":
        steps = [s for s in steps if isinstance(latest[s][0], (int, float))]
        return [latest[s][0] / 60 for s in steps], [latest[s][1] for s in steps]
    return steps, [latest[s][1] for s in steps]


def training_curves(rows: list[dict], title: str = "Training", x: str = "step"):
    """Loss (train and valid), valid perplexity, BLEU (and the other scores validation computed) and learning rate
    against steps, or against training wall time with x="elapsed" (runs that log it); absent ones skipped."""
    panels = []  # (y label, [(label, xs, values, style)], log scale)
    loss = [
        ("train loss", *_series(rows, "train", "loss", x), "-"),
        ("valid loss", *_series(rows, "valid", "loss", x), "o-"),
    ]
    if any(s for _, s, _, _ in loss):
        panels.append(("loss (per token, label-smoothed)", loss, False))
    ppl = [("valid perplexity", *_series(rows, "valid", "ppl", x), "o-")]
    if ppl[0][1]:
        panels.append(("valid perplexity", ppl, True))
    for score in SCORES:  # those validation computed (train.valid_scores)
        series = [(f"valid {score.label}", *_series(rows, "valid", score.name, x), "o-")]
        if series[0][1]:
            panels.append((f"valid {score.label}", series, False))
    lr = [("learning rate", *_series(rows, "train", "lr", x), "-")]
    if lr[0][1]:
        panels.append(("learning rate", lr, False))
    if not panels:
        raise UserError(
            "the metrics hold no loss, perplexity, BLEU or learning rate to plot"
            + (" against time (runs of older versions do not log it)" if x == "elapsed" else "")
        )
    fig = new_figure(8.0, 2.4 * len(panels) + 0.8)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (ylabel, lines, log_scale) in zip(axes, panels):
        for label, xs, values, style in lines:
            if xs:
                ax.plot(xs, values, style, label=label, markersize=3, linewidth=1.2)
        ax.set_ylabel(ylabel)
        if log_scale:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if sum(1 for _, s, _, _ in lines if s) > 1:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("training time (minutes)" if x == "elapsed" else "step (optimizer updates)")
    axes[0].set_title(title)
    return fig


# ----------------------------------------------------------------------------- the `attention` command


def _check_index(name: str, value: int | None, count: int, kind: str) -> None:
    if value is not None and not 1 <= value <= count:
        raise UserError(
            f"--{name} {value} is out of range: the {kind} attention has {count} {name}s, numbered 1..{count}"
        )


def write_attention_figures(
    maps,  # transformer.visualize.attention.AttentionMaps
    out: str | Path,
    kinds: Sequence[str] = ("encoder", "decoder", "cross"),
    layer: int | None = None,  # 1-based, as in the figure titles
    head: int | None = None,
) -> list[Path]:
    """One figure per kind: the layers x heads grid, the chosen layer's or head's row/column,
    or one large map when both are given. A single figure goes to `out` itself; several go to
    `out` with _encoder, _decoder, _cross before the suffix."""
    from transformer.visualize.attention import KEY_AXIS, QUERY_AXIS, TITLES

    out = output_path(out, "attention")
    for kind in kinds:
        n_layers, n_heads = maps.shape(kind)
        _check_index("layer", layer, n_layers, kind)
        _check_index("head", head, n_heads, kind)
    what = "translated by the model" if maps.translated else "forced"
    subtitle = f"source: {maps.source}\ntarget ({what}): {maps.target}"
    written = []
    for kind in kinds:
        query, key = maps.axes(kind)
        weights = maps.weights[kind]
        n_layers, n_heads = weights.shape[:2]
        layers = [layer] if layer is not None else list(range(1, n_layers + 1))
        heads = [head] if head is not None else list(range(1, n_heads + 1))
        selected = weights[[i - 1 for i in layers]][:, [h - 1 for h in heads]]
        masked = maps.forbidden(kind)
        note = "\ngrey: future positions, masked" if masked is not None else ""
        if layer is not None and head is not None:
            fig = attention_map(
                selected[0, 0],
                query,
                key,
                f"{TITLES[kind]}, layer {layer}, head {head}\n{subtitle}{note}",
                QUERY_AXIS[kind],
                KEY_AXIS[kind],
                masked,
            )
        else:
            fig = attention_grid(
                selected,
                query,
                key,
                f"{TITLES[kind]}\n{subtitle}{note}",
                QUERY_AXIS[kind],
                KEY_AXIS[kind],
                layers,
                heads,
                masked,
            )
        path = out if len(kinds) == 1 else out.with_name(f"{out.stem}_{kind}{out.suffix}")
        written.append(save(fig, path, "attention"))
    return written
