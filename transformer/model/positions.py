"""Positions: what the model adds to its token embeddings to tell positions apart, behind one interface.

The config key model.positions names the kind: "sinusoidal", the paper's fixed sinusoids with sines and cosines
interleaved; "marian", the same sinusoids laid out as transformers' MarianMTModel computes them (all sines, then all
cosines: what an imported OPUS-MT model was trained with). Every reader goes through here: the model's embedding
(module), the CTranslate2 export (ctranslate2_encodings), the Hugging Face export (marian_encodings and
marian_order, the one owner of how our model dimension maps onto Marian's), serve's /positions and the plot
(table). A new kind touches this file and the allowed values of model.positions in config.py, nothing else.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from transformer.config import ModelConfig
from transformer.errors import UserError


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


class PositionalEncoding(nn.Module):
    """A fixed table of sinusoids of one kind (table()), precomputed: rows offset .. offset + length are added."""

    def __init__(self, d_model: int, max_positions: int, kind: str = "sinusoidal"):
        super().__init__()
        # Not a parameter and not saved: it is a pure function of (kind, d_model, max_positions).
        self.register_buffer("table", table(kind, d_model, max_positions), persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        if offset + length > self.table.size(0):
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions ({self.table.size(0)})"
            )
        return self.table[offset : offset + length]  # (T, C)


def module(cfg: ModelConfig) -> nn.Module:
    """The model's positions: called as positions(length, offset) -> (length, d_model), added to the embeddings."""
    return PositionalEncoding(cfg.d_model, cfg.max_positions, cfg.positions)


def table(kind: str, d_model: int, length: int) -> torch.Tensor:
    """(length, d_model): what each position adds to an embedding (the model, serve, the plot)."""
    if kind == "sinusoidal":
        return sinusoid_table(d_model, length)
    if kind == "marian":
        return marian_table(d_model, length)
    raise UserError(f"model.positions {kind!r} adds no table of positions to the embeddings")


def ctranslate2_encodings(model: nn.Module) -> np.ndarray:
    """(max_positions, d_model) float32: the position encodings CTranslate2 adds, ours and not its own."""
    if model.cfg.positions in ("sinusoidal", "marian"):
        return model.positions.table.float().numpy()  # our table, not CTranslate2's own
    raise UserError(f"export: model.positions {model.cfg.positions!r} has no CTranslate2 equivalent")


def marian_order(cfg: ModelConfig) -> torch.Tensor:
    """Our model dimension -> Marian's: indexing every residual-stream vector with this order gives Marian's layout,
    marian = ours[order]. "marian" positions are Marian's layout already (the identity); "sinusoidal" ones interleave
    sin at 2i and cos at 2i + 1 at the frequencies that Marian puts in column i and d/2 + i, so the order gathers the
    even columns, then the odd ones. Exporting permutes every weight with this order (inference/hf_export.py)."""
    if cfg.positions == "marian":
        return torch.arange(cfg.d_model)
    if cfg.positions == "sinusoidal":
        return torch.cat([torch.arange(0, cfg.d_model, 2), torch.arange(1, cfg.d_model, 2)])
    raise UserError(f"export hf: model.positions {cfg.positions!r} has no MarianMTModel equivalent")


def marian_encodings(model: nn.Module) -> torch.Tensor:
    """(max_positions, d_model): the table a transformers MarianMTModel loads as embed_positions (ours, in our
    column order; the export permutes the columns with the rest of the residual stream, marian_order)."""
    if model.cfg.positions in ("sinusoidal", "marian"):
        return model.positions.table.detach()
    raise UserError(f"export hf: model.positions {model.cfg.positions!r} has no MarianMTModel equivalent")
