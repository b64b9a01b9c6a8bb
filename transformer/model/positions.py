"""Positions: how the model tells positions apart, each kind (model.positions) one class behind one interface.

A kind may add a table to the token embeddings (`add`), rotate each head's queries and keys inside self-attention
(`rotation`), or both; the model calls it once per pass, with the decoding offset (the positions a KV cache already
holds), and hands the rotation to every self-attention layer, which rotates the new keys once, before the cache
keeps them. The kinds:

- "sinusoidal": the paper's fixed sinusoids, PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...);
- "marian": the same sinusoids as transformers' MarianMTModel lays them out (all sines, then all cosines: what an
  imported OPUS-MT model was trained with);
- "learned": a trained table per side, nn.Embedding(max_positions, d_model) (the paper's Table 3 row E;
  fairseq's learned positional embeddings);
- "rotary": RoPE (Su et al. 2021): dimensions (2i, 2i+1) of each head's queries and keys rotated by the angle
  pos * 10000^(-2i/d_head), so that attention scores depend on relative positions; no table is added.

Every reader goes through the interface (Positions): the model (transformer.py), the CTranslate2 export
(`ctranslate2_options`, `ctranslate2_encodings`), the Hugging Face export (`marian_order`, `marian_encodings`),
serve's /positions and plot-positions (`view`, `settings_view`). A new kind is a class here (in KINDS) and its name
in config.py (PositionKind, with what it needs of the model's shape in `positions_problem`); nothing else names a
kind (tests/model/test_positions.py keeps it so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import nn

from transformer.config import ModelConfig, PositionKind, positions_problem
from transformer.errors import UserError

Side = Literal["source", "target"]


def sinusoid_table(d_model: int, length: int) -> torch.Tensor:
    """(length, d_model): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table


def marian_table(d_model: int, length: int) -> torch.Tensor:
    """(length, d_model): the same frequencies with the sines in the first half and the cosines in the second,
    computed as MarianSinusoidalPositionalEmbedding computes them (in float64, then rounded to float32), so that an
    imported model adds the very table it was trained with: float32 arithmetic differs by up to ~3e-5 at position
    500, more than the 1e-4 the logits are held to."""
    j = np.arange(d_model)
    angle = np.arange(length)[:, None] / np.power(10000, 2 * (j // 2) / d_model)[None, :]  # (P, C) float64
    half = (d_model + 1) // 2
    table = torch.empty(length, d_model)
    table[:, :half] = torch.from_numpy(np.sin(angle[:, 0::2])).float()
    table[:, half:] = torch.from_numpy(np.cos(angle[:, 1::2])).float()
    return table


class Rotation:
    """RoPE's rotation of queries or keys (B, H, T, Dh) at T consecutive positions: each pair of dimensions
    (2i, 2i+1) turned by its angle, (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos). Built once per pass from
    cos and sin (T, Dh), each angle's value repeated for both dimensions of its pair."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cos.dtype != x.dtype:  # autocast's bf16 queries: rotate in their dtype, as SDPA needs one dtype
            self.cos, self.sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        pairs = x.unflatten(-1, (-1, 2))  # (B, H, T, Dh/2, 2)
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (x0, x1) -> (-x1, x0)
        return x * self.cos + turned * self.sin


@dataclass(frozen=True)
class View:
    """What a kind has to show of positions 0 .. length-1 (serve's /positions, plot-positions): its tables
    (name -> (length, columns) tensor; none when it has nothing to draw) and the words that say what they are."""

    kind: str
    title: str
    note: str  # one or two sentences: what the tables are, or why there is none
    columns: str  # what a table's columns are
    values: str  # what a table's values are
    tables: dict[str, torch.Tensor]
    adds_table: bool  # True when the tables are what is added to the embeddings


class Positions(nn.Module):
    """The interface every kind implements. Called as positions(x, side, offset) on the scaled token embeddings
    x (B, T, C) of one side at positions offset .. offset + T - 1: -> (x with what the kind adds, the Rotation that
    side's self-attention applies to queries and keys, or None). The defaults add nothing, rotate nothing and
    export nowhere; a kind overrides what it does."""

    name: ClassVar[str]
    # True when the kind's table is weights a model learns: it cannot be shown without a trained model.
    learned: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model, self.n_heads, self.max_positions = cfg.d_model, cfg.n_heads, cfg.max_positions

    def forward(self, x: torch.Tensor, side: Side, offset: int = 0) -> tuple[torch.Tensor, Rotation | None]:
        length = x.size(1)
        if offset + length > self.max_positions:
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions ({self.max_positions})"
            )
        return self.add(x, side, offset), self.rotation(length, offset)

    def add(self, x: torch.Tensor, side: Side, offset: int) -> torch.Tensor:
        return x

    def rotation(self, length: int, offset: int) -> Rotation | None:
        return None

    def view(self, length: int, d_model: int | None = None, names: tuple[str, str] = ("d_model", "n_heads")) -> View:
        """What this kind shows of positions 0 .. length-1: this model's own, or at another width (d_model) the same
        kind's for a model of that width (settings_view; `names` as there)."""
        if d_model is not None and d_model != self.d_model:
            return settings_view(self.name, d_model, self.n_heads, length, names)
        if length < 1:
            raise UserError(f"positions: the length must be at least 1, got {length}")
        return self.show(length)

    def show(self, length: int) -> View:
        note = f"model.positions {self.name!r} adds no table to the embeddings and has none to show"
        return View(self.name, f"{self.name} positions", note, "", "", {}, False)

    # --- exports: what another runtime needs to compute the same function, or a one-line refusal

    def ctranslate2_options(self) -> dict:
        """Keyword arguments of CTranslate2's TransformerEncoderSpec and TransformerDecoderSpec (e.g. rotary_dim)."""
        raise UserError(f"export ctranslate2: model.positions {self.name!r} has no CTranslate2 equivalent")

    def ctranslate2_encodings(self, side: Side) -> np.ndarray | None:
        """(max_positions, d_model) float32: the table CTranslate2 adds on that side (ours, never its own), or None
        when it adds none."""
        raise UserError(f"export ctranslate2: model.positions {self.name!r} has no CTranslate2 equivalent")

    def marian_order(self) -> torch.Tensor:
        """Our model dimension -> Marian's: indexing every residual-stream vector with this order gives Marian's
        layout, marian = ours[order]. Exporting permutes every weight with it (inference/hf_export.py)."""
        raise UserError(
            f"export hf: model.positions {self.name!r} has no MarianMTModel equivalent (MarianMTModel adds "
            "sinusoids: model.positions sinusoidal or marian)"
        )

    def marian_encodings(self) -> torch.Tensor:
        """(max_positions, d_model): the table a MarianMTModel loads as embed_positions, in our column order."""
        raise UserError(f"export hf: model.positions {self.name!r} has no MarianMTModel equivalent")


class FixedTable(Positions):
    """A table that is a pure function of (d_model, max_positions), precomputed, added on both sides."""

    title: ClassVar[str]
    formula: ClassVar[str]  # the table's definition, as the view's note states it
    columns: ClassVar[str]

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        # Not a parameter and not saved: it is a pure function of (kind, d_model, max_positions).
        self.register_buffer("table", self.make_table(cfg.d_model, cfg.max_positions), persistent=False)

    @staticmethod
    def make_table(d_model: int, length: int) -> torch.Tensor:
        raise NotImplementedError

    def add(self, x: torch.Tensor, side: Side, offset: int) -> torch.Tensor:
        return x + self.table[offset : offset + x.size(1)]

    def show(self, length: int) -> View:
        note = (
            f"{self.formula}: the table added to the embeddings (d_model {self.d_model}), positions 0 to {length - 1}."
        )
        tables = {"source and target": self.make_table(self.d_model, length)}
        return View(
            self.name, f"{self.title}, d_model = {self.d_model}", note, self.columns, "PE(position, i)", tables, True
        )

    def ctranslate2_options(self) -> dict:
        return {}

    def ctranslate2_encodings(self, side: Side) -> np.ndarray:
        return self.table.float().numpy()

    def marian_encodings(self) -> torch.Tensor:
        return self.table.detach()


class Sinusoidal(FixedTable):
    name = "sinusoidal"
    title = "Sinusoidal positional encoding"
    formula = "PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(…)"
    columns = "encoding dimension i (even: sin, odd: cos; frequency falls from left to right)"
    make_table = staticmethod(sinusoid_table)

    def marian_order(self) -> torch.Tensor:
        """Sin at 2i and cos at 2i + 1 sit at the frequency that Marian puts in columns i and d/2 + i: the even
        columns, then the odd ones."""
        return torch.cat([torch.arange(0, self.d_model, 2), torch.arange(1, self.d_model, 2)])


class Marian(FixedTable):
    name = "marian"
    title = "Sinusoidal positional encoding (MarianMTModel's layout)"
    formula = "PE(pos, i) = sin(pos / 10000^(2i/d)) for i < d/2, PE(pos, d/2 + i) = cos(…)"
    columns = "encoding dimension (first half: sin, second half: cos; frequency falls within each)"
    make_table = staticmethod(marian_table)

    def marian_order(self) -> torch.Tensor:
        return torch.arange(self.d_model)  # Marian's layout already


class Learned(Positions):
    """A trained table per side, source and target (fairseq's LearnedPositionalEmbedding, one per stack),
    initialised N(0, d^-1/2) as fairseq does: it is added to the embeddings scaled by sqrt(d)."""

    name = "learned"
    learned = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.source = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.target = nn.Embedding(cfg.max_positions, cfg.d_model)
        for table in (self.source, self.target):
            nn.init.normal_(table.weight, mean=0.0, std=cfg.d_model**-0.5)

    def add(self, x: torch.Tensor, side: Side, offset: int) -> torch.Tensor:
        table = self.source if side == "source" else self.target
        return x + table.weight[offset : offset + x.size(1)]

    def show(self, length: int) -> View:
        if length > self.max_positions:
            raise UserError(f"positions: this model's learned tables hold {self.max_positions} positions, not {length}")
        note = (
            f"Learned positions: a trained table per side added to the embeddings (d_model {self.d_model}), "
            f"positions 0 to {length - 1}."
        )
        tables = {side: getattr(self, side).weight[:length].detach().float() for side in ("source", "target")}
        title = f"Learned positional embeddings, d_model = {self.d_model}"
        return View(self.name, title, note, "dimension i", "the learned value", tables, True)

    def ctranslate2_options(self) -> dict:
        return {}

    def ctranslate2_encodings(self, side: Side) -> np.ndarray:
        return getattr(self, side).weight.detach().float().numpy()  # CTranslate2 adds encodings[pos]: any table


class Rotary(Positions):
    """RoPE (Su et al. 2021) on every self-attention layer (cross-attention compares a target with source
    positions: left alone, as in Eole's encoder-decoders), pairs interleaved as in the paper (CTranslate2's
    rotary_interleave); nothing is added to the embeddings."""

    name = "rotary"
    BASE = 10000.0

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.d_head = cfg.d_model // cfg.n_heads
        angle = self.angles(self.d_head, cfg.max_positions).repeat_interleave(2, dim=1)  # (P, Dh)
        # cos and sin, not the angles: a model cast to bf16 keeps values in [-1, 1], not angles in the hundreds.
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    @classmethod
    def angles(cls, d_head: int, length: int) -> torch.Tensor:
        """(length, d_head/2) float64: pos * BASE^(-2i/d_head)."""
        inv_freq = cls.BASE ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        return torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]

    def rotation(self, length: int, offset: int) -> Rotation:
        return Rotation(self.cos[offset : offset + length], self.sin[offset : offset + length])

    def show(self, length: int) -> View:
        note = (
            "Rotary positions add no table to the embeddings: each self-attention layer rotates every head's "
            f"queries and keys, dimensions (2i, 2i+1) by the angle pos · 10000^(-2i/{self.d_head}), so that their "
            "dot product depends on the distance between positions. Shown: the cosine of each angle."
        )
        tables = {"cos": self.angles(self.d_head, length).cos().float()}
        columns = "pair i of each head's dimensions (frequency falls from left to right)"
        title = f"Rotary positions, head size {self.d_head}"
        return View(self.name, title, note, columns, "cos(pos · 10000^(-2i/d_head))", tables, False)

    def ctranslate2_options(self) -> dict:
        return {"rotary_dim": self.d_head, "rotary_interleave": True, "rotary_base": self.BASE}

    def ctranslate2_encodings(self, side: Side) -> None:
        return None


# model.positions -> its class. Every value of config.PositionKind has one (a test checks).
KINDS: dict[str, type[Positions]] = {kind.name: kind for kind in (Sinusoidal, Marian, Learned, Rotary)}


def module(cfg: ModelConfig) -> Positions:
    """The model's positions, of the kind model.positions names."""
    return KINDS[cfg.positions](cfg)


def settings_view(kind: PositionKind, d_model: int, n_heads: int, length: int, names: tuple[str, str]) -> View:
    """What a kind shows of `length` positions for a model of that width and head count, without a model (serve's
    /positions at another width, plot-positions). A learned kind has nothing to show before training; `names`: how
    the caller's user gives d_model and n_heads, for the one-line error."""
    problem = positions_problem(kind, d_model, n_heads, names)
    if problem is not None:
        raise UserError(problem)
    if length < 1:
        raise UserError(f"positions: the length must be at least 1, got {length}")
    if KINDS[kind].learned:
        raise UserError(f"model.positions {kind!r} is a table a model learns: only a trained model's own can be shown")
    return KINDS[kind](ModelConfig(d_model=d_model, n_heads=n_heads, max_positions=length, positions=kind)).show(length)
