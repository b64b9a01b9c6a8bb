"""Ensembles: several trained models of one vocabulary searched as one model (fairseq, Marian, Sockeye and
OpenNMT-py offer the same); search.EnsembleDecoder averages their log-probabilities at each step, each member
with its own encoder output and KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from transformer.data.vocab import AnyVocab
from transformer.errors import UserError
from transformer.model.transformer import Transformer


class Ensemble(nn.Module):
    """The members in the order given. `cfg` is the first member's model config with the smallest max_positions
    of all (a source or an output must fit every member); the other settings of the members may differ."""

    def __init__(self, models: Sequence[Transformer]):
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        self.models = nn.ModuleList(models)
        self.cfg = replace(models[0].cfg, max_positions=min(m.cfg.max_positions for m in models))
        self.pad_id, self.specials = models[0].pad_id, models[0].specials  # one vocabulary, so one set of ids
        # nn.Module starts in training mode; evaluating() puts back the mode it found, which would switch members
        # loaded for inference into training (dropout on) for whoever runs them outside a search.
        self.train(models[0].training)

    def __len__(self) -> int:
        return len(self.models)


def check_vocabularies(vocabs: Sequence[AnyVocab], names: Sequence[str]) -> None:
    """A one-line UserError unless every member has the first one's vocabulary, piece for piece: an id must mean
    the same piece to every member for their log-probabilities to be averaged."""
    first = [vocabs[0].pieces([i])[0] for i in range(len(vocabs[0]))]
    for vocab, name in zip(vocabs[1:], names[1:]):
        if len(vocab) != len(first):
            raise UserError(
                f"ensemble: {name} has a vocabulary of {len(vocab)} pieces and {names[0]} one of {len(first)}; "
                "the models of an ensemble must share one vocabulary"
            )
        pieces = [vocab.pieces([i])[0] for i in range(len(vocab))]
        if pieces != first:
            i = next(i for i, (a, b) in enumerate(zip(first, pieces)) if a != b)
            raise UserError(
                f"ensemble: the vocabularies differ: piece {i} is {pieces[i]!r} in {name} and {first[i]!r} in "
                f"{names[0]}; the models of an ensemble must share one vocabulary"
            )
