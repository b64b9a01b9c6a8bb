"""Word alignments (`--alignments`): which source word each output word came from, read from one decoder layer's
cross-attention (fairseq's --print-alignment, CTranslate2's return_attention, Marian's --alignment).

For each output piece, the attention of the decoder step that emitted it (its query reads the piece before it),
averaged over the heads of the chosen layer, picks the source piece it attends to most; the source's EOS is never
picked. Pieces map to words (a word starts at a piece that begins with "▁", SentencePiece's space, which is how
whitespace splits the input line and the translation), and each (source word, output word) pair is kept once:
`i-j` in Pharaoh format, both counted from 0. The default layer is the last, as fairseq's and CTranslate2's;
Garg et al. (2019) found the penultimate the best aligned of a 6-layer Transformer (`--alignment-layer 5`), but
on a 2-layer copy-task model the first layer's attention is nowhere near the diagonal while the last's is.

Computed after the search, in one teacher-forced pass over the returned hypotheses (batched) with that layer
alone on the explicit attention path that records its weights: the search itself is unchanged and costs nothing
more. For an ensemble, the first model's attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transformer.data.batch import pad_sequences, padding_mask, prepare_sources, target_mask
from transformer.inference.ensemble import Ensemble
from transformer.model.transformer import evaluating

WORD_START = "\u2581"  # SentencePiece's "▁"


def default_layer(decoder_layers: int) -> int:
    """The decoder layer (from 1) alignments come from when none is asked for: the last."""
    return decoder_layers


def piece_alignments(
    model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], layer: int, max_tokens: int = 4096
) -> list[list[int]]:
    """Per (source ids without EOS, output ids without BOS/EOS) pair: for each output piece, the index of the
    source piece its step attended to most in decoder layer `layer` (from 1), heads averaged, EOS excluded."""
    model = model.models[0] if isinstance(model, Ensemble) else model  # an ensemble: its first member
    attention = model.decoder_layers[layer - 1].cross_attn
    device, specials = next(model.parameters()).device, model.specials
    out: list[list[int]] = [[] for _ in pairs]
    todo = [i for i, (src, tgt) in enumerate(pairs) if len(src) and len(tgt)]
    previous = attention.record
    try:
        with evaluating(model):
            for chunk in _chunks(todo, [len(pairs[i][0]) + len(pairs[i][1]) + 2 for i in todo], max_tokens):
                src, _ = prepare_sources([pairs[i][0] for i in chunk], model.cfg.max_positions, specials)
                tgt_in = pad_sequences([[specials.bos, *pairs[i][1]] for i in chunk], pad_id=specials.pad)
                src, tgt_in = src.to(device), tgt_in.to(device)
                attention.record = []
                model(src, tgt_in, padding_mask(src, specials.pad), target_mask(tgt_in, specials.pad))
                weights = attention.record[0].float().mean(dim=1)  # (B, H, T, S) -> (B, T, S)
                # The source's EOS (and padding) never: the rows' last real position is EOS.
                lengths = (src != specials.pad).sum(dim=1)
                keys = torch.arange(src.size(1), device=device)[None, :] < (lengths - 1)[:, None]
                best = weights.masked_fill(~keys[:, None, :], -1.0).argmax(dim=2).cpu()  # (B, T)
                for row, i in enumerate(chunk):
                    out[i] = best[row, : len(pairs[i][1])].tolist()
    finally:
        attention.record = previous
    return out


def _chunks(indices: list[int], sizes: list[int], max_tokens: int) -> list[list[int]]:
    chunks, current, tokens = [], [], 0
    for i, size in zip(indices, sizes):
        if current and tokens + size > max_tokens:
            chunks.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += size
    return chunks + ([current] if current else [])


def word_index(pieces: Sequence[str]) -> list[int]:
    """Per piece, the number of the word it belongs to (from 0)."""
    words, word = [], -1
    for i, piece in enumerate(pieces):
        if i == 0 or piece.startswith(WORD_START):
            word += 1
        words.append(word)
    return words


def word_alignments(
    source_pieces: Sequence[str], target_pieces: Sequence[str], links: Sequence[int]
) -> list[tuple[int, int]]:
    """Piece links (per target piece, its source piece) -> sorted (source word, target word) pairs, each once."""
    source_words, target_words = word_index(source_pieces), word_index(target_pieces)
    return sorted({(source_words[s], target_words[t]) for t, s in enumerate(links) if s < len(source_words)})


def pharaoh(pairs: Sequence[tuple[int, int]]) -> str:
    """Pairs as `i-j i-j ...`."""
    return " ".join(f"{i}-{j}" for i, j in pairs)
