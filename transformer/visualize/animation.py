"""The walk through one sentence drawn frame by frame (matplotlib, Agg) and written as a GIF, an MP4 or PNG frames."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from transformer.errors import UserError
from transformer.files import atomic_path, atomic_write, check_output_path, current_umask, refuse_directory
from transformer.visualize.plots import DPI, new_figure, require_matplotlib
from transformer.visualize.walkthrough import Frame

WIDTH, HEIGHT = 8.0, 5.0  # inches: 800 x 500 pixels at plots.DPI
COLOURS = 128  # a GIF's one palette: heat maps stay smooth, and the file small
FRAME_NAME = re.compile(r"frame_\d{3,}\.png")
TOP_ROWS = 6  # bars of a decoder step: walkthrough.TOP candidates and the chosen piece when it is not among them
LABEL_CHARS = 12  # a piece label longer than this is cut with an ellipsis
ORANGE, BLUE, INK, MUTED = "#e8710a", "#4a7fb5", "#1d2733", "#5f6b7a"

Update = Callable[[Frame], None]
# What a scene's builder returns: how a frame changes its panels, and the artists that change (drawn anew each frame
# over the rest, which is drawn once per scene).
Scene = tuple[Update, list]


# ----------------------------------------------------------------------------- output paths


def output_format(out: str | Path) -> str:
    """gif or mp4 by --out's suffix; png (a folder of frames) for a name without one, ending in a slash, or naming a
    folder."""
    text = str(out)
    if not text.strip():
        raise UserError("animate: --out is an empty name; give FILE.gif, FILE.mp4 or a folder for PNG frames")
    suffix = Path(text).suffix.lower()
    if suffix in (".gif", ".mp4"):
        refuse_directory(out, "animate")
        return suffix[1:]
    if not suffix or text.endswith(os.sep) or Path(text).is_dir():
        return "png"
    raise UserError(f"animate: cannot write {out}: give FILE.gif, FILE.mp4, or a folder name for PNG frames")


def check_output(out: str | Path, force: bool = False) -> tuple[Path, str]:
    """(the path, its format), refused in one line before anything is computed: an existing output without
    --force, a folder that holds anything but frames, a run's file or a checkpoint, an MP4 without ffmpeg."""
    require_matplotlib()
    kind = output_format(out)
    path = Path(out)
    if kind == "mp4" and shutil.which(_ffmpeg()) is None:
        raise UserError(
            "animate: writing .mp4 needs ffmpeg on PATH (e.g. apt install ffmpeg, or conda install ffmpeg); "
            "or write a .gif"
        )
    if not path.exists() and not path.is_symlink():
        return path, kind
    if not force:
        raise UserError(f"animate: {out} exists; add --force to replace it")
    if kind != "png":
        return check_output_path(path, command="animate"), kind
    if not path.is_dir():
        raise UserError(f"animate: {out} is a file; give a folder name for the PNG frames")
    strangers = [p.name for p in path.iterdir() if not FRAME_NAME.fullmatch(p.name)]
    if strangers:
        raise UserError(
            f"animate: {out} holds files that are not an animation's frames ({strangers[0]}); give another folder"
        )
    return path, kind


def _ffmpeg() -> str:
    import matplotlib

    return str(matplotlib.rcParams["animation.ffmpeg_path"])


# ----------------------------------------------------------------------------- drawing


def _short(piece: str) -> str:
    piece = piece if piece.strip() else repr(piece)  # a blank label would vanish from its tick
    return piece if len(piece) <= LABEL_CHARS else piece[: LABEL_CHARS - 1] + "…"


def _label_width(labels: Sequence[str], font: float) -> float:
    """Inches a column of labels takes at `font` points."""
    return 0.1 + 0.6 * font / 72 * max((len(_short(p)) for p in labels), default=1)


def _font(cell: float) -> float:
    """Piece labels' size (points) for cells of `cell` inches: as large as fits, 6..8."""
    return min(8.0, max(6.0, 0.8 * cell * 72))


def _cmaps():
    from matplotlib import colormaps

    # White: not computed yet in this frame. Weights below 0 are the decoder's masked cells: grey.
    signed = colormaps["RdBu_r"].with_extremes(bad="white")
    weights = colormaps["Blues"].with_extremes(bad="white", under="0.82")
    return signed, weights


class Canvas:
    """One figure for every frame: a scene's panels are built when the scene starts, and each frame then changes
    only their data and words."""

    def __init__(self):
        self.fig = new_figure(WIDTH, HEIGHT, layout=None)
        self.scene: tuple | None = None  # what is drawn once: the scene, its legend and its note
        self.update: Update | None = None
        self.signed, self.weights = _cmaps()
        self.fits: dict[tuple, str] = {}  # fitted texts

    def axes(self, x: float, y: float, w: float, h: float, title: str = ""):
        """Axes at (x, y) inches from the bottom left, w x h inches, without ticks."""
        ax = self.fig.add_axes((x / WIDTH, y / HEIGHT, w / WIDTH, h / HEIGHT))
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_color("0.7")
        if title:
            ax.set_title(title, fontsize=8, pad=3, color=INK)
        return ax

    def image(self, ax, values: np.ndarray, limit: float | None):
        """A heat map: signed values on red-blue within ±limit, or (limit None) weights on white-blue within 0..1."""
        cmap, low, high = (self.weights, 0.0, 1.0) if limit is None else (self.signed, -limit, limit)
        return ax.imshow(
            np.ma.masked_invalid(values), cmap=cmap, vmin=low, vmax=high, aspect="auto", interpolation="nearest"
        )

    def labels(self, ax, rows: Sequence[str] | None, cols: Sequence[str] | None, font: float) -> None:
        """Piece labels on the rows and columns (None: that axis has none)."""
        if rows is not None:
            ax.set_yticks(range(len(rows)), [_short(p) for p in rows], fontsize=font, parse_math=False)
        if cols is not None:
            ax.set_xticks(range(len(cols)), [_short(p) for p in cols], fontsize=font, rotation=90, parse_math=False)
        ax.tick_params(length=0, pad=2)

    def cover(self):
        """A white rectangle on the figure (see place): hides what is not shown yet."""
        from matplotlib.patches import Rectangle

        return self.fig.add_artist(Rectangle((0, 0), 0, 0, transform=self.fig.transFigure, color="white", zorder=5))

    def place(self, rectangle, x: float, y: float, w: float, h: float) -> None:
        """Put a figure's rectangle at (x, y) inches from the bottom left, w x h inches."""
        rectangle.set_bounds(x / WIDTH, y / HEIGHT, max(w, 0) / WIDTH, max(h, 0) / HEIGHT)

    def text(self, x: float, y: float, words: str, **style):
        """Text at (x, y) inches from the bottom left."""
        return self.fig.text(x / WIDTH, y / HEIGHT, words, parse_math=False, **style)

    def colorbar(self, image, x: float, y: float, h: float) -> None:
        bar = self.fig.colorbar(image, cax=self.axes(x, y, 0.09, h))
        bar.ax.tick_params(labelsize=6, length=2, pad=1)
        bar.outline.set_edgecolor("0.7")

    def chrome(self) -> Scene:
        """The title, the caption, a note and the legend every frame has."""
        fig = self.fig
        title = self.text(0.15, HEIGHT - 0.1, "", fontsize=11, weight="bold", va="top", color=INK)
        caption = self.text(0.15, HEIGHT - 0.42, "", fontsize=8.5, va="top", color=MUTED)
        note = self.text(0.15, HEIGHT - 0.64, "", fontsize=8, va="top", color="#b3261e", style="italic")
        legend = self.text(0.15, 0.08, "", fontsize=7.5, va="bottom", color=INK, linespacing=1.3)
        fig.add_artist(_rule(fig, 0.72))

        def update(frame: Frame) -> None:
            for text, words, lines in (
                (title, frame.title, 1),
                (caption, frame.caption, 1),
                (note, frame.note, 1),
                (legend, frame.legend, 4),
            ):
                text.set_text(self.fitted(words, text.get_fontproperties(), lines))

        return update, [title, caption]  # a scene's legend and note stay: drawn with its panels

    def show(self, frame: Frame) -> None:
        """Draw `frame`: when its scene starts, the scene's panels are built and what stays is drawn once; then, as
        for every frame, what changes is updated and drawn over that."""
        canvas = self.fig.canvas
        if (frame.scene, frame.legend, frame.note) != self.scene:
            self.fig.clear()
            chrome, chrome_artists = self.chrome()
            body, body_artists = SCENES[frame.scene](self, frame)

            def update(f: Frame) -> None:
                chrome(f)
                body(f)

            self.scene, self.update = (frame.scene, frame.legend, frame.note), update
            self.changing = chrome_artists + body_artists
            for artist in self.changing:
                artist.set_animated(True)
            update(frame)
            canvas.draw()
            self.background = canvas.copy_from_bbox(self.fig.bbox)
        self.update(frame)
        canvas.restore_region(self.background)
        for artist in self.changing:
            self.fig.draw_artist(artist)

    def fitted(self, text: str, font, lines: int) -> str:
        """`text` wrapped to the frame's width in `font` (measured as drawn), in at most `lines` lines: the last one
        ends in an ellipsis where the text goes on. Remembered: a scene's legend comes back every frame."""
        key = (text, font.get_size_in_points(), font.get_weight(), lines)
        if key not in self.fits:
            self.fits[key] = _wrapped(text, lines, self.fig.canvas.get_renderer(), font)
        return self.fits[key]

    def pixels(self) -> np.ndarray:
        """The figure as shown last: (height, width, 3) uint8."""
        return np.asarray(self.fig.canvas.buffer_rgba())[..., :3].copy()


def _wrapped(text: str, lines: int, renderer, font) -> str:
    room = (WIDTH - 0.3) * DPI  # pixels

    def fits(line: str) -> bool:
        return renderer.get_text_width_height_descent(line, font, ismath=False)[0] <= room

    out: list[str] = []
    for word in text.split(" "):
        if out and fits(f"{out[-1]} {word}"):
            out[-1] = f"{out[-1]} {word}"
        elif len(out) < lines:
            out.append(word)
        else:  # cut: the last line ends in an ellipsis
            last = out[-1] + " …"
            while len(last) > 2 and not fits(last):
                last = last[:-3].rstrip() + " …"
            out[-1] = last
            break
    return "\n".join(out)


def _rule(fig, y: float):
    from matplotlib.lines import Line2D

    return Line2D([0.15 / WIDTH, 1 - 0.15 / WIDTH], [y / HEIGHT] * 2, color="0.85", linewidth=0.8)


TOP, BOTTOM = 4.05, 0.8  # inches: the panels' area, between the caption and the legend


def _embed_scene(c: Canvas, frame: Frame) -> Scene:
    """Three (pieces x d_model) maps side by side: embedding rows, position rows, their sum."""
    rows = frame.labels["source"]
    cell = min(0.24, (TOP - BOTTOM - 0.3) / len(rows))
    font = _font(cell)
    left = 0.2 + _label_width(rows, font)
    gap = 0.35
    width = (WIDTH - left - 0.2 - 2 * gap) / 3
    height = cell * len(rows)
    images, axes = {}, {}
    for i, name in enumerate(("embedded", "position_rows", "stream")):
        ax = c.axes(left + i * (width + gap), TOP - height, width, height, frame.words[name])
        axes[name] = ax
        images[name] = c.image(ax, frame.values[name], frame.limits["value"])
        ax.set_xlabel("dimension →", fontsize=7, color=MUTED, labelpad=2)
    c.labels(axes["embedded"], rows, None, font)
    for i, sign in enumerate("+="):
        x = left + (i + 1) * width + i * gap + gap / 2
        c.fig.text(x / WIDTH, (TOP - height / 2) / HEIGHT, sign, fontsize=14, ha="center", va="center", color=INK)

    # A kind that adds no rows (rotary) says so in their panel, once they are due.
    middle = axes["position_rows"]
    style = {"ha": "center", "va": "center", "fontsize": 8, "color": MUTED, "transform": middle.transAxes}
    empty = middle.text(0.5, 0.5, frame.words.get("no_rows", ""), **style)

    def update(f: Frame) -> None:
        for name, image in images.items():
            image.set_data(np.ma.masked_invalid(f.values[name]))
        empty.set_visible(bool(np.isfinite(f.values["position_rows"]).all()))

    return update, [*images.values(), *_frames(axes.values()), empty]


def _frames(axes) -> list:
    """The axes' spines: drawn again over the images that change, which would cover half their width."""
    return [spine for ax in axes for spine in ax.spines.values()]


def _square(c: Canvas, n: int, room: float) -> tuple[float, float]:
    """(cell, label font) for an n x n map in at most `room` inches, with its column labels below it."""
    cell = min(0.2, room / n)
    return cell, _font(cell)


def _scores_scene(c: Canvas, frame: Frame) -> Scene:
    """Q and K, then the score matrix beside them."""
    rows = frame.labels["source"]
    n = len(rows)
    font = _font(min(0.2, 2.4 / n))
    label = _label_width(rows, font)
    cell, font = _square(c, n, min(TOP - BOTTOM - label, 2.8))
    side = cell * n
    left = 0.2 + label
    qk_width = (WIDTH - left - 0.3 - label - side - 0.7) / 2
    y = TOP - side
    q = c.axes(left, y, qk_width, side, frame.words["q"])
    k = c.axes(left + qk_width + 0.3, y, qk_width, side, frame.words["k"])
    for ax in (q, k):
        ax.set_xlabel("dimension →", fontsize=7, color=MUTED, labelpad=2)
    c.labels(q, rows, None, font)
    x = left + 2 * qk_width + 0.3 + label + 0.1
    scores = c.axes(x, y, side, side, frame.words["scores"])
    c.labels(scores, rows, rows, font)
    images = {
        "q": c.image(q, frame.values["q"], frame.limits["qk"]),
        "k": c.image(k, frame.values["k"], frame.limits["qk"]),
        "scores": c.image(scores, frame.values["scores"], frame.limits["scores"]),
    }
    c.colorbar(images["scores"], x + side + 0.08, y, side)

    def update(f: Frame) -> None:
        for name, image in images.items():
            image.set_data(np.ma.masked_invalid(f.values[name]))
        scores.title.set_text(f.words["scores"])

    return update, [*images.values(), *_frames((q, k, scores)), scores.title]


def _softmax_scene(c: Canvas, frame: Frame) -> Scene:
    """The scaled scores, their softmax, V, and Z = weights V."""
    rows = frame.labels["source"]
    n = len(rows)
    font = _font(min(0.2, 2.0 / n))
    label = _label_width(rows, font)
    cell, font = _square(c, n, min(TOP - BOTTOM - label, 2.0))
    side = cell * n
    left = 0.2 + label
    y = TOP - side
    scaled = c.axes(left, y, side, side, frame.words["scaled"])
    weights = c.axes(left + side + 0.5, y, side, side, frame.words["weights"])
    c.labels(scaled, rows, rows, font)
    c.labels(weights, None, rows, font)
    rest = left + 2 * side + 0.5 + 0.55
    width = (WIDTH - rest - 0.2 - 0.3) / 2
    v = c.axes(rest, y, width, side, frame.words["v"])
    z = c.axes(rest + width + 0.3, y, width, side, frame.words["z"])
    for ax in (v, z):
        ax.set_xlabel("dimension →", fontsize=7, color=MUTED, labelpad=2)
    images = {
        "scaled": c.image(scaled, frame.values["scaled"], frame.limits["scaled"]),
        "weights": c.image(weights, frame.values["weights"], None),
        "v": c.image(v, frame.values["v"], frame.limits["vz"]),
        "z": c.image(z, frame.values["z"], frame.limits["vz"]),
    }
    c.colorbar(images["scaled"], left + side + 0.06, y, side)
    c.colorbar(images["weights"], left + 2 * side + 0.56, y, side)

    def update(f: Frame) -> None:
        for name, image in images.items():
            image.set_data(np.ma.masked_invalid(f.values[name]))

    return update, [*images.values(), *_frames((scaled, weights, v, z))]


def _heads_scene(c: Canvas, frame: Frame) -> Scene:
    """Every head's weights of the layer, in rows of up to 8, the followed one outlined."""
    from matplotlib.patches import Rectangle

    heads = frame.values["heads"]
    rows = frame.labels["source"]
    count, n = heads.shape[0], heads.shape[1]
    per_row = min(count, 8)
    lines = -(-count // per_row)
    gap = 0.18
    side = min(1.9, (WIDTH - 1.3 - (per_row - 1) * gap) / per_row, (TOP - BOTTOM - 0.9) / lines - 0.3)
    font = _font(side / n)
    label = _label_width(rows, font) if side / n >= 0.08 else 0.1
    left = 0.2 + label
    for h in range(count):
        x = left + (h % per_row) * (side + gap)
        y = TOP - (h // per_row + 1) * side - (h // per_row) * 0.35
        ax = c.axes(x, y, side, side, frame.words[f"head{h + 1}"])
        c.image(ax, heads[h], None)
        if h == frame.current:
            ax.add_patch(Rectangle((-0.5, -0.5), n, n, fill=False, edgecolor=ORANGE, linewidth=2.5, clip_on=False))
        if h == 0 and side / n >= 0.08:
            c.labels(ax, rows, rows, font)
    return (lambda f: None), []


def _join_scene(c: Canvas, frame: Frame) -> Scene:
    """The heads' outputs side by side, then times W_O."""
    rows = frame.labels["source"]
    n = len(rows)
    cell = min(0.2, (TOP - BOTTOM - 0.3) / n)
    font = _font(cell)
    left = 0.2 + _label_width(rows, font)
    gap = 0.5
    width = (WIDTH - left - 0.2 - gap) / 2
    height = cell * n
    joined = c.axes(left, TOP - height, width, height, frame.words["joined_heads"])
    output = c.axes(left + width + gap, TOP - height, width, height, frame.words["output"])
    c.labels(joined, rows, None, font)
    c.image(joined, frame.values["joined_heads"], frame.limits["joined_heads"])
    c.image(output, frame.values["output"], frame.limits["output"])
    columns = frame.values["joined_heads"].shape[1]
    edges = [0, *frame.values["head_starts"].tolist(), columns]
    for start in edges[1:-1]:
        joined.axvline(start - 0.5, color="white", linewidth=3)
    middles = [(a + b - 1) / 2 for a, b in zip(edges, edges[1:])]
    joined.set_xticks(middles, [f"head {h}" for h in range(1, len(middles) + 1)], fontsize=7, color=MUTED)
    joined.tick_params(length=0, pad=2)
    output.set_xlabel("dimension →", fontsize=7, color=MUTED, labelpad=2)
    c.fig.text(
        (left + width + gap / 2) / WIDTH, (TOP - height / 2) / HEIGHT, "→", fontsize=14, ha="center", va="center"
    )
    return (lambda f: None), []


def _step_scene(c: Canvas, frame: Frame) -> Scene:
    """A decoder step: masked self-attention, attention over the source, the next piece's candidates."""
    from matplotlib.patches import Rectangle

    read, source = frame.labels["read"], frame.labels["source"]
    t, s = len(read), len(source)
    bars_left, bars_width = WIDTH - 1.45, 1.25
    font = _font(min(0.2, 2.4 / max(t, s)))
    label = _label_width(read, font)
    room = bars_left - 1.0 - 0.2 - label - 0.3
    cell = min(0.2, room / (t + s), (TOP - BOTTOM - _label_width(read + source, font)) / max(t, s))
    font = _font(cell)
    left, bottom = 0.2 + label, TOP - t * cell
    self_ax = c.axes(left, bottom, t * cell, t * cell, frame.words["self"])
    cross_ax = c.axes(left + t * cell + 0.3, bottom, s * cell, t * cell, frame.words["cross"])
    c.labels(cross_ax, None, source, font)
    self_image = c.image(self_ax, frame.values["self"], None)
    cross_image = c.image(cross_ax, frame.values["cross"], None)
    outlines = [
        ax.add_patch(Rectangle((-0.5, -0.5), width, 1, fill=False, edgecolor=ORANGE, linewidth=2, clip_on=False))
        for ax, width in ((self_ax, t), (cross_ax, s))
    ]
    # The pieces read label the rows and columns, drawn once with the scene; two white covers hide those not read
    # yet (redrawing the labels each frame cost more than the rest of the frame).
    middle = [(i + 0.5) * cell for i in range(t)]
    style = {"fontsize": font, "color": INK}
    for y, piece in zip(middle, read):
        c.text(left - 0.04, TOP - y, _short(piece), ha="right", va="center", **style)
    for x, piece in zip(middle, read):
        c.text(left + x, bottom - 0.04, _short(piece), ha="center", va="top", rotation=90, **style)
    rows_cover, cols_cover = (c.cover() for _ in range(2))
    labels_end = max(BOTTOM - 0.05, bottom - _label_width(read, font) - 0.05)  # below the column labels
    bars_ax = c.axes(bars_left, TOP - 1.9, bars_width, 1.9, frame.words["top"])
    bars = bars_ax.barh(range(TOP_ROWS), [0] * TOP_ROWS, height=0.7, color=BLUE)
    values = [bars_ax.text(0, i, "", fontsize=7, va="center", color=INK) for i in range(TOP_ROWS)]
    style = {"fontsize": font, "va": "center", "ha": "right", "color": INK, "parse_math": False}
    names = [bars_ax.text(-0.04, i, "", **style) for i in range(TOP_ROWS)]
    bars_ax.set_xlim(0, 1.25)
    bars_ax.set_ylim(TOP_ROWS - 0.4, -0.6)
    bars_ax.set_xlabel("probability", fontsize=7, color=MUTED, labelpad=2)
    future = np.triu(np.ones((t, t), dtype=bool), 1)

    def update(f: Frame) -> None:
        filled = np.isfinite(f.values["self"]).all(axis=1)
        shown = np.where(future & filled[:, None], -1.0, f.values["self"])  # below vmin: the grey of masked cells
        self_image.set_data(np.ma.masked_invalid(shown))
        cross_image.set_data(np.ma.masked_invalid(f.values["cross"]))
        done = int(filled.sum()) * cell  # inches of rows (down from the top) and of columns (rightwards) read
        c.place(rows_cover, 0.02, bottom, left - 0.03, t * cell - done)
        c.place(cols_cover, left + done, labels_end, t * cell - done + 0.01, bottom - 0.01 - labels_end)
        for outline in outlines:
            outline.set_visible(f.current is not None)
            outline.set_y((f.current or 0) - 0.5)
        probs, pieces, chosen = f.values["top"], f.labels["top"], int(f.values["chosen"][0])
        for i, (bar, value, name) in enumerate(zip(bars, values, names)):
            here = i < len(probs)
            bar.set_visible(here)
            bar.set_width(float(probs[i]) if here else 0.0)
            bar.set_color(ORANGE if i == chosen else BLUE)
            value.set_text(f"{probs[i]:.2f}" if here else "")
            value.set_x(float(probs[i]) + 0.03 if here else 0)
            name.set_text(_short(pieces[i]) if here else "")
            name.set_weight("bold" if i == chosen else "normal")

    changing = [self_image, cross_image, *_frames((self_ax, cross_ax)), *outlines, rows_cover, cols_cover]
    return update, [*changing, *bars, *values, *names]


SCENES: dict[str, Callable[[Canvas, Frame], Scene]] = {
    "embed": _embed_scene,
    "scores": _scores_scene,
    "softmax": _softmax_scene,
    "heads": _heads_scene,
    "join": _join_scene,
    "step": _step_scene,
}


def drawn(frames: Sequence[Frame]) -> Iterator[Canvas]:
    """The canvas with each frame drawn on it in turn."""
    canvas = Canvas()
    for frame in frames:
        canvas.show(frame)
        yield canvas


def render(frames: Sequence[Frame]) -> list[np.ndarray]:
    """Each frame as (height, width, 3) uint8 pixels."""
    return [canvas.pixels() for canvas in drawn(frames)]


# ----------------------------------------------------------------------------- writing


def gif_bytes(images: Sequence[np.ndarray], durations_ms: Sequence[int]) -> bytes:
    """A looping GIF of the images, each shown its duration, in one palette drawn from all of them (one palette: a
    colour never flickers between frames)."""
    import io

    frames = _indexed(images, _palette(images))
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=list(durations_ms), loop=0)
    return buffer.getvalue()


def _palette(images: Sequence[np.ndarray]) -> np.ndarray:
    """(COLOURS, 3): a median cut of every 4th pixel of every image, and the page's white exactly."""
    from PIL import Image

    sample = np.concatenate([im[::4, ::4].reshape(-1, 3) for im in images])[None]  # (1, N, 3)
    cut = Image.fromarray(sample).quantize(COLOURS - 1, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    colours = np.array(cut.getpalette()[: 3 * (COLOURS - 1)]).reshape(-1, 3)
    return np.concatenate([colours, [[255, 255, 255]]])


def _indexed(images: Sequence[np.ndarray], palette: np.ndarray) -> list:
    """Each image in `palette`, every pixel its nearest colour. Not Pillow's quantize(palette=): it looks colours up
    in cells 8 values wide, where a near-white of the cut beats white itself and greys the page."""
    from PIL import Image

    nearest = np.full(1 << 24, 255, dtype=np.uint8)  # by 0xRRGGBB; 255: not looked up yet (COLOURS < 256)
    out = []
    for im in images:
        packed = (im[..., 0].astype(np.int32) << 16) | (im[..., 1].astype(np.int32) << 8) | im[..., 2]
        new = np.unique(packed[nearest[packed] == 255])
        if new.size:
            rgb = np.stack([new >> 16, (new >> 8) & 255, new & 255], axis=1)
            nearest[new] = ((rgb[:, None, :] - palette[None]) ** 2).sum(axis=-1).argmin(axis=1)
        frame = Image.frombytes("P", (im.shape[1], im.shape[0]), nearest[packed].tobytes())
        frame.putpalette(palette.astype(np.uint8).ravel().tolist())
        out.append(frame)
    return out


# A GIF's frame lasts whole hundredths of a second (browsers slow anything under 2), at most 655 s.
MIN_FPS, MAX_FPS = 0.1, 50


def check_fps(fps: float) -> None:
    if not MIN_FPS <= fps <= MAX_FPS:
        raise UserError(f"animate: --fps must be between {MIN_FPS:g} and {MAX_FPS:g}, got {fps:g}")


def durations(frames: Sequence[Frame], fps: float) -> list[int]:
    return [round(1000 * frame.hold / fps) for frame in frames]


def animation_gif(frames: Sequence[Frame], fps: float) -> bytes:
    return gif_bytes(render(frames), durations(frames, fps))


def write_animation(frames: Sequence[Frame], out: str | Path, fps: float, force: bool = False) -> Path:
    """Write the frames to `out` as its name asks (output_format), never half-written: a GIF or MP4 through a
    temporary file renamed into place, a folder of PNGs filled beside it and then put in its place."""
    check_fps(fps)
    path, kind = check_output(out, force)
    if kind == "gif":
        data = animation_gif(frames, fps)
        atomic_write(path, lambda f: f.write(data))
    elif kind == "mp4":
        _write_mp4(frames, path, fps)
    else:
        _write_pngs(frames, path)
    return path


def _write_mp4(frames: Sequence[Frame], path: Path, fps: float) -> None:
    from matplotlib.animation import FFMpegWriter

    # ffmpeg reads the raw frames from a pipe; -f: the temporary file's name says nothing of the format.
    writer = FFMpegWriter(fps=fps, codec="h264", extra_args=["-pix_fmt", "yuv420p", "-f", "mp4"])
    canvas = Canvas()
    with atomic_path(path) as tmp, writer.saving(canvas.fig, str(tmp), DPI):
        for frame in frames:
            canvas.show(frame)
            for _ in range(frame.hold):
                writer.grab_frame()


def _write_pngs(frames: Sequence[Frame], path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        os.chmod(staging, 0o777 & ~current_umask())
        for i, canvas in enumerate(drawn(frames), 1):
            Image.fromarray(canvas.pixels()).save(staging / f"frame_{i:03d}.png")
        aside = None
        if path.exists():  # check_output let it be replaced: a folder of frames alone
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, aside / path.name)
        os.replace(staging, path)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
