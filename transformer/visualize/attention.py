"""Attention weights of every layer and head, collected from one forward pass for inspection and plotting."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from transformer.data.batch import causal_mask, padding_mask, prepare_sources, source_limit, target_mask
from transformer.data.vocab import AnyVocab
from transformer.errors import UserError
from transformer.inference.search import search
from transformer.inference.settings import SearchSettings
from transformer.model.transformer import Transformer, evaluating

KINDS = ("encoder", "decoder", "cross")

# Plot titles and axis names; queries are rows, keys are columns.
TITLES = {
    "encoder": "Encoder self-attention",
    "decoder": "Decoder self-attention (masked)",
    "cross": "Encoder-decoder attention",
}
QUERY_AXIS = {
    "encoder": "source token (query)",
    "decoder": "target token read by the decoder (query)",
    "cross": "target token read by the decoder (query)",
}
KEY_AXIS = {
    "encoder": "source token attended to (key)",
    "decoder": "target token attended to (key)",
    "cross": "source token attended to (key)",
}


@contextmanager
def recording(model: Transformer) -> Iterator[dict[str, list[list[torch.Tensor]]]]:
    """Switch every attention module to the explicit path that records its probabilities.

    Yields {kind: [one list per layer]}; each forward pass inside the block appends a
    (B, H, Tq, Tk) tensor to its layer's list. On exit the modules get back their previous
    `record` (None normally), so training and decoding keep the fused SDPA kernel.
    """
    modules = model.attention_modules()
    previous = {id(m): m.record for kind in KINDS for m in modules[kind]}
    records: dict[str, list[list[torch.Tensor]]] = {kind: [] for kind in KINDS}
    try:
        for kind in KINDS:
            for m in modules[kind]:
                m.record = []
                records[kind].append(m.record)
        yield records
    finally:
        for kind in KINDS:
            for m in modules[kind]:
                m.record = previous[id(m)]


@torch.no_grad()
def collect_attention(
    model: Transformer,
    src: torch.Tensor,  # (B, S) ids, EOS-terminated, right-padded with PAD_ID
    tgt_in: torch.Tensor,  # (B, T) ids, BOS-started, right-padded with PAD_ID
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One teacher-forced pass in eval mode -> (logits (B, T, V), {kind: (L, B, H, Tq, Tk)}).

    Padded keys get weight 0; padded query rows are whatever the model computed there.
    """
    src_mask, tgt_mask = padding_mask(src, model.pad_id), target_mask(tgt_in, model.pad_id)
    # Dropout off: the recorded probabilities are exactly the ones applied to V.
    with evaluating(model, inference=False), recording(model) as records:
        logits = model(src, tgt_in, src_mask, tgt_mask)
    weights = {}
    for kind, layers in records.items():
        # Exactly one call per module in a teacher-forced pass; anything else means the model changed.
        assert all(len(calls) == 1 for calls in layers), f"{kind}: expected one attention call per layer"
        weights[kind] = torch.stack([calls[0] for calls in layers])
    return logits, weights


@dataclass
class AttentionMaps:
    """Attention of one sentence pair: weights[kind] is (layers, heads, queries, keys), rows sum to 1."""

    source: str
    target: str  # the forced target, or the model's own translation
    source_pieces: list[str]  # source pieces + "</s>"
    target_pieces: list[str]  # "<s>" + target pieces: what the decoder reads
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    translated: bool = False  # True when `target` came from the model

    def axes(self, kind: str) -> tuple[list[str], list[str]]:
        """(query pieces, key pieces) of one kind: the row and column labels of its maps."""
        if kind == "encoder":
            return self.source_pieces, self.source_pieces
        if kind == "decoder":
            return self.target_pieces, self.target_pieces
        if kind == "cross":
            return self.target_pieces, self.source_pieces
        raise KeyError(kind)

    def forbidden(self, kind: str) -> np.ndarray | None:
        """(Tq, Tk) True where the mask forbids attention (future target positions), else None."""
        if kind != "decoder":
            return None  # one unpadded sentence: every source position is visible
        return ~causal_mask(len(self.target_pieces))[0, 0].numpy()  # (1, 1, T, T) -> (T, T)

    def shape(self, kind: str) -> tuple[int, int]:
        """(layers, heads) of one kind."""
        return self.weights[kind].shape[:2]


def source_ids(model: Transformer, vocab: AnyVocab, source: str, prefix: Sequence[int] = ()) -> torch.Tensor:
    """`source` as the model reads it: (1, S) ids, `prefix` (a multilingual model's language token: Translator.asking),
    its pieces and EOS, on the model's device; an empty sentence or one longer than the model accepts is a one-line
    error."""
    if not source.strip():
        raise UserError("the source sentence is empty")
    pieces = [*prefix, *vocab.encode([source])[0]]
    src, (truncated,) = prepare_sources([pieces], model.cfg.max_positions, model.specials)  # (1, S): pieces + EOS
    if truncated:
        raise UserError(
            f"the source sentence is {len(pieces)} pieces long; this model accepts at most "
            f"{source_limit(model.cfg.max_positions)}"
        )
    return src.to(next(model.parameters()).device)


def own_translation(model: Transformer, src: torch.Tensor, settings: SearchSettings) -> list[int]:
    """The model's best translation of one source (1, S), searched with `settings`: its ids without BOS and EOS."""
    return search(model, src, settings).hypotheses[0][0].tokens


def inspect_attention(
    model: Transformer,
    vocab: AnyVocab,
    source: str,
    target: str | None = None,
    settings: SearchSettings = SearchSettings(beam=1),
    prefix: Sequence[int] = (),
) -> AttentionMaps:
    """Attention weights for `source` (after `prefix`: source_ids) while the decoder reads `target`, or the model's
    own translation (its best, searched with `settings`: greedy by default) when no target is given."""
    src = source_ids(model, vocab, source, prefix)
    src_ids = src[0].tolist()
    translated = target is None
    if translated:
        tgt_ids = own_translation(model, src, settings)
        target = vocab.decode([tgt_ids])[0]
    else:
        tgt_ids = vocab.encode_target([target])[0]
    limit = model.cfg.max_positions - 1  # decoder positions, one of them BOS's
    if len(tgt_ids) > limit:
        raise UserError(f"the target sentence is {len(tgt_ids)} pieces long; this model accepts at most {limit}")
    tgt_ids = [model.specials.bos] + tgt_ids
    tgt_in = torch.tensor([tgt_ids], dtype=torch.long, device=src.device)
    _, weights = collect_attention(model, src, tgt_in)
    return AttentionMaps(
        source=source,
        target=target,
        source_pieces=vocab.pieces(src_ids),
        target_pieces=vocab.pieces(tgt_ids),
        # (L, B=1, H, Tq, Tk) -> (L, H, Tq, Tk)
        weights={kind: w[:, 0].float().cpu().numpy() for kind, w in weights.items()},
        translated=translated,
    )
