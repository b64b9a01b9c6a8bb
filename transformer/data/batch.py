"""The Batch: padded source/target tensors, the teacher-forcing shift, the only mask builders, and source
preparation for translation (EOS, the length limit, padding).

Mask convention everywhere: boolean, True = this query may attend to this key, shaped
(B|1, 1, T_query|1, T_key) so it broadcasts over attention heads. Two forms stand for one for the attention
kernels (scaled_dot_product_attention), built here too:
- `attention_bias(mask, dtype)`: the same mask additive, 0 = may attend and -inf = may not, in the queries' dtype;
  the model turns a boolean mask into it once per forward pass, not once per attention call.
- `CAUSAL`: causal masking with no tensor (SDPA's is_causal). What a teacher-forced pass over right-padded
  targets needs in decoder self-attention (Batch.tgt_mask says why); a mask tensor would rule out the flash kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from transformer.config import round_up
from transformer.data.vocab import OURS, PAD_ID, Specials

if TYPE_CHECKING:
    from transformer.data.store import Corpus


def padding_mask(tokens: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """(B, T) ids -> (B, 1, 1, T): True on real tokens, False on padding."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int, device=None) -> torch.Tensor:
    """(1, 1, T, T): position i may attend to positions <= i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def target_mask(tgt_in: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """(B, T) decoder input ids -> (B, 1, T, T): causal and key padding together, what a teacher-forced pass uses.
    Column 0 is the decoder's start, real even where its id is the padding id (a Marian vocabulary's is)."""
    keys = padding_mask(tgt_in, pad_id).clone()
    keys[..., 0] = True
    return keys & causal_mask(tgt_in.size(1), tgt_in.device)


class Causal:
    """The type of CAUSAL: position i may attend to positions <= i, with no mask tensor (square attention only)."""

    def __repr__(self) -> str:
        return "CAUSAL"


CAUSAL = Causal()


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask -> the additive mask scaled_dot_product_attention takes as it is: 0 where True, -inf where
    False, in `dtype`, which must be the queries' (SDPA refuses a float mask of another dtype, and converts a
    boolean one at every call). Its rows sit in a buffer whose last dimension is padded to a multiple of 8, the
    alignment CUDA's memory-efficient kernel needs: it pads a copy of any other mask at every call. A mask that is
    already additive comes back as it is."""
    if mask.is_floating_point():
        return mask
    length = mask.size(-1)
    buffer = torch.zeros(*mask.shape[:-1], round_up(length, 8), dtype=dtype, device=mask.device)
    return buffer[..., :length].masked_fill_(~mask, float("-inf"))


def pad_sequences(seqs: Sequence[Sequence[int]], pad_to_multiple: int = 1, pad_id: int = PAD_ID) -> torch.Tensor:
    """Right-pad lists of ids into a (B, T) LongTensor, T rounded up to a multiple."""
    longest = round_up(max(len(s) for s in seqs), pad_to_multiple)
    out = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def source_limit(max_positions: int) -> int:
    """The most subwords a source may hold before its EOS: the bound training enforces (data.max_len + 2 <=
    model.max_positions), so translation never feeds the encoder a longer source than it could have seen."""
    return max_positions - 2


def prepare_sources(
    sources: Sequence[Sequence[int]], max_positions: int, specials: Specials = OURS
) -> tuple[torch.Tensor, list[bool]]:
    """Subword ids per sentence (no EOS) -> (src (B, S): each cut to source_limit(max_positions), EOS
    appended, right-padded with PAD; which sentences were cut). The one place translation builds sources."""
    limit = source_limit(max_positions)
    truncated = [len(s) > limit for s in sources]
    return pad_sequences([list(s[:limit]) + [specials.eos] for s in sources], pad_id=specials.pad), truncated


@dataclass
class Batch:
    """src (B, S) = ids + EOS; tgt_in (B, T) = BOS + ids; tgt_out (B, T) = ids + EOS; the special ids are the
    vocabulary's (`specials`: ours unless given; a Marian vocabulary's BOS is its PAD)."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    n_src_tokens: int  # real (non-pad) tokens, counted on the host so no device sync is needed
    n_tgt_tokens: int
    pad_id: int = PAD_ID

    @classmethod
    def from_pairs(
        cls, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_to_multiple: int = 1, specials: Specials = OURS
    ) -> Batch:
        bos, eos, pad = specials.bos, specials.eos, specials.pad
        src = pad_sequences([list(s) + [eos] for s, _ in pairs], pad_to_multiple, pad)
        # Shift by one: the decoder reads BOS y1 .. yn and must predict y1 .. yn EOS. (Built
        # separately, not as slices of one BOS..EOS row, which would leave EOS in shorter tgt_in rows.)
        tgt_in = pad_sequences([[bos] + list(t) for _, t in pairs], pad_to_multiple, pad)
        tgt_out = pad_sequences([list(t) + [eos] for _, t in pairs], pad_to_multiple, pad)
        n_src = sum(len(s) + 1 for s, _ in pairs)
        n_tgt = sum(len(t) + 1 for _, t in pairs)
        return cls(src, tgt_in, tgt_out, n_src, n_tgt, pad)

    @classmethod
    def from_corpus(
        cls, corpus: Corpus, indices: np.ndarray, pad_to_multiple: int = 1, specials: Specials = OURS
    ) -> Batch:
        """The same Batch as from_pairs, gathered straight from a corpus's flat token arrays (which may be
        memory-mapped): no Python list per sentence."""
        return cls.from_corpora([(corpus, indices)], pad_to_multiple, specials)

    @classmethod
    def from_corpora(
        cls, parts: Sequence[tuple[Corpus, np.ndarray]], pad_to_multiple: int = 1, specials: Specials = OURS
    ) -> Batch:
        """from_corpus of several corpora at once: the rows of each (corpus, indices), in that order."""
        parts = [(corpus, np.asarray(indices, dtype=np.int64)) for corpus, indices in parts]
        src_len = np.concatenate([corpus.src_lengths[indices] for corpus, indices in parts])
        tgt_len = np.concatenate([corpus.tgt_lengths[indices] for corpus, indices in parts])
        src_width = round_up(int(src_len.max()) + 1, pad_to_multiple)
        tgt_width = round_up(int(tgt_len.max()) + 1, pad_to_multiple)

        def gathered(side: str, width: int) -> np.ndarray:
            blocks = [
                _gather(
                    getattr(c, f"{side}_tokens"),
                    getattr(c, f"{side}_offsets")[i],
                    getattr(c, f"{side}_lengths")[i],
                    width,
                    specials.pad,
                )
                for c, i in parts
            ]
            return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)

        src, tgt_out = gathered("src", src_width), gathered("tgt", tgt_width)
        tgt_in = np.empty_like(tgt_out)  # the shift, from the one gather: the corpus is read once per side
        tgt_in[:, 0] = specials.bos
        tgt_in[:, 1:] = tgt_out[:, :-1]  # tgt_width > longest target, so every last id moves in
        rows = np.arange(len(src_len))
        src[rows, src_len] = specials.eos
        tgt_out[rows, tgt_len] = specials.eos
        return cls(
            torch.from_numpy(src),
            torch.from_numpy(tgt_in),
            torch.from_numpy(tgt_out),
            int(src_len.sum()) + len(src_len),
            int(tgt_len.sum()) + len(tgt_len),
            specials.pad,
        )

    @property
    def src_mask(self) -> torch.Tensor:
        return padding_mask(self.src, self.pad_id)

    @property
    def tgt_mask(self) -> Causal:
        """CAUSAL: decoder self-attention in a teacher-forced pass needs no key-padding mask. Targets are
        right-padded, so a real position i attends only to positions <= i, all of them real: target_mask's padding
        part changes nothing there, and the outputs at padded positions, which it would change, are never scored
        (their targets are PAD, ignored by the loss). target_mask(tgt_in) is the explicit equivalent."""
        return CAUSAL

    def __len__(self) -> int:
        return self.src.size(0)

    def to(self, device, non_blocking: bool = False) -> Batch:
        src, tgt_in, tgt_out = (t.to(device, non_blocking=non_blocking) for t in (self.src, self.tgt_in, self.tgt_out))
        return Batch(src, tgt_in, tgt_out, self.n_src_tokens, self.n_tgt_tokens, self.pad_id)

    def pin_memory(self) -> Batch:
        pinned = (t.pin_memory() for t in (self.src, self.tgt_in, self.tgt_out))
        return Batch(*pinned, self.n_src_tokens, self.n_tgt_tokens, self.pad_id)


def _gather(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int, pad_id: int) -> np.ndarray:
    """(B, width) int64 filled with pad_id, row b holding tokens[starts[b]:starts[b] + lengths[b]] from column 0."""
    out = np.full((len(starts), width), pad_id, dtype=np.int64)
    column = np.arange(width)[None, :]  # (1, W): offset into each sentence
    inside = (column >= 0) & (column < lengths[:, None])  # (B, W)
    out[inside] = tokens[(starts[:, None] + column)[inside]]  # one gather; reads only these tokens
    return out
