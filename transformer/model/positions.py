"""Positions: what the model adds to its token embeddings to tell positions apart, behind one interface.

The config key model.positions names the kind ("sinusoidal": the paper's fixed sinusoids). Every reader goes through
here: the model's embedding (module), the CTranslate2 export (ctranslate2_encodings), serve's /positions and the
plot (table). A new kind touches this file and the allowed values of model.positions in config.py, nothing else.
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


class PositionalEncoding(nn.Module):
    """Sinusoids: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), precomputed."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        # Not a parameter and not saved: it is a pure function of (d_model, max_positions).
        self.register_buffer("table", sinusoid_table(d_model, max_positions), persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        if offset + length > self.table.size(0):
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions ({self.table.size(0)})"
            )
        return self.table[offset : offset + length]  # (T, C)


def module(cfg: ModelConfig) -> nn.Module:
    """The model's positions: called as positions(length, offset) -> (length, d_model), added to the embeddings."""
    if cfg.positions == "sinusoidal":
        return PositionalEncoding(cfg.d_model, cfg.max_positions)
    raise ValueError(f"unknown model.positions {cfg.positions!r}")  # config.py admits only the kinds above


def table(kind: str, d_model: int, length: int) -> torch.Tensor:
    """(length, d_model): what each position adds to an embedding, for those who show it (serve, the plot)."""
    if kind == "sinusoidal":
        return sinusoid_table(d_model, length)
    raise UserError(f"model.positions {kind!r} adds no table of positions to the embeddings")


def ctranslate2_encodings(model: nn.Module) -> np.ndarray:
    """(max_positions, d_model) float32: the position encodings CTranslate2 adds, ours and not its own."""
    if model.cfg.positions == "sinusoidal":
        return model.positions.table.float().numpy()  # our interleaved sin/cos, not CTranslate2's own
    raise UserError(f"export: model.positions {model.cfg.positions!r} has no CTranslate2 equivalent")


def marian_encodings(model: nn.Module) -> torch.Tensor:
    """(max_positions, d_model): the table a transformers MarianMTModel loads as embed_positions (ours, in our
    column order; the export permutes the columns with the rest of the residual stream)."""
    if model.cfg.positions == "sinusoidal":
        return model.positions.table.detach()
    raise UserError(f"export hf: model.positions {model.cfg.positions!r} has no MarianMTModel equivalent")
