"""What incremental decoding keeps between search steps: each decoder layer's self-attention keys/values, one
row per hypothesis, and cross-attention's encoder keys/values and memory mask, once per source sentence.

Tensors are (rows, heads, positions, d_head), batch-first like the rest of the package (transformer/model/transformer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Keys/values of one attention layer, (R, H, T, Dh) each, for incremental decoding. Keys are kept as attention
    reads them: under rotary positions already turned by their positions' angles (model/positions.py's Rotation,
    applied once as a step writes them), so the cache never needs to know the kind of positions, and its length is
    the offset the next step's positions start from (DecoderCache.length).

    Self-attention K/V grow by one position per step. They live in buffers with spare positions (and, once rows
    have left, spare rows), so a step writes its position in place, and reordering rows (beam search, finished
    sentences leaving) moves only the rows that change, in place: torch.cat per step and index_select per reorder
    copied the whole cache twice a step (docs/benchmarks/log.md, "Decoding on a CPU"), and a copy of every row
    into a new buffer per step still read and wrote all of it, most of it rows that stay where they are."""

    SPARE = 8  # positions of room a new buffer gets beyond what it holds

    def __init__(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None):
        self.k, self.v = k, v  # the filled part: views of the buffers when built by append/keep_rows
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add new positions (R, H, t, Dh) after the ones held."""
        held = 0 if self.k is None else self.k.size(2)
        end, rows = held + k.size(2), k.size(0)
        if self._buffers is None or self._buffers[0].size(2) < end:
            size = end + max(self.SPARE, end)  # doubling: a long run without reorders re-buffers log(T) times
            self._buffers = (self._room(self.k, k, size), self._room(self.v, v, size))
        for buffer, new in zip(self._buffers, (k, v)):
            buffer[:rows, :, held:end] = new
        self.k, self.v = (buffer[:rows, :, :end] for buffer in self._buffers)

    @staticmethod
    def _room(old: torch.Tensor | None, new: torch.Tensor, size: int) -> torch.Tensor:
        rows, heads, _, d_head = new.shape
        buffer = new.new_empty(rows, heads, size, d_head)
        if old is not None:
            buffer[:, :, : old.size(2)] = old
        return buffer

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index`, in that order. On a CPU, when they fit the buffers: in place, copying only the rows
        whose content changes (through a copy of what they take, so no row is overwritten before it is read);
        otherwise one copy into new buffers with room to grow."""
        if self.k is None:
            return
        held, rows = self.k.size(2), index.numel()
        if self._in_place(index):
            moved = (index != torch.arange(rows)).nonzero().squeeze(1)  # row i takes row index[i]
            if moved.numel():
                taken = index.index_select(0, moved)
                for buffer in self._buffers:
                    filled = buffer[:, :, :held]
                    filled.index_copy_(0, moved, filled.index_select(0, taken))
            self.k, self.v = (buffer[:rows, :, :held] for buffer in self._buffers)
            return
        buffers = []
        for filled in (self.k, self.v):
            heads, d_head = filled.size(1), filled.size(3)
            buffer = filled.new_empty(rows, heads, held + self.SPARE, d_head)
            if filled.requires_grad:  # out= cannot record a gradient: gather, then copy
                buffer[:, :, :held] = filled.index_select(0, index)
            else:
                torch.index_select(filled, 0, index, out=buffer[:, :, :held])  # straight into the buffer
            buffers.append(buffer)
        self._buffers = (buffers[0], buffers[1])
        self.k, self.v = (buffer[:, :, :held] for buffer in self._buffers)

    def _in_place(self, index: torch.Tensor) -> bool:
        """Whether keep_rows(index) can move rows inside the buffers: on a CPU (the rows that change are found on
        the host, which on CUDA would wait for the device), without autograd, and no more rows than they hold."""
        return (
            self._buffers is not None
            and index.device.type == "cpu"
            and not self.k.requires_grad
            and index.numel() <= self._buffers[0].size(0)
        )


@dataclass
class DecoderCache:
    """Everything the decoder reads between steps: per-layer self-attention K/V, one row per hypothesis (grown
    by one position each step), and what cross-attention needs, the encoder output's K/V per layer and the
    memory mask, held once per source (set by Transformer.new_cache).

    Rows come in equal groups, one per source and in source order: rows b*g .. b*g + g-1 belong to source b,
    g = rows / sources (1 for greedy search, the beam size in beam search). Cross-attention reads each
    source's K/V once for its whole group, instead of from a copy per beam."""

    self_attn: list[KVCache]
    cross_attn: list[KVCache]
    memory_mask: torch.Tensor  # (B, 1, 1, S), per source
    length: int = 0  # target positions already consumed

    def keep_rows(self, index: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """Keep rows `index`, in that order: reordering beams, growing groups (a sentence's first step has one
        row, later steps `beam`), dropping finished sentences. `sources`: the sources that stay, in order,
        when some leave (`index` must then hold exactly their rows, grouped as above); None keeps them all."""
        for kv in self.self_attn:
            kv.keep_rows(index)
        if sources is not None:
            for kv in self.cross_attn:  # fixed size: a plain copy
                kv.k, kv.v = kv.k.index_select(0, sources), kv.v.index_select(0, sources)
            self.memory_mask = self.memory_mask.index_select(0, sources)


def by_source(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B*g, H, T, D) -> (B, H, g*T, D): a source's g rows become g*T queries against its one K/V."""
    rows, heads, length, d = x.shape
    return x.view(rows // group, group, heads, length, d).transpose(1, 2).reshape(rows // group, heads, -1, d)


def by_row(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H, g*T, D) -> (B*g, H, T, D): the inverse of by_source."""
    sources, heads, queries, d = x.shape
    return x.view(sources, heads, group, queries // group, d).transpose(1, 2).reshape(sources * group, heads, -1, d)
