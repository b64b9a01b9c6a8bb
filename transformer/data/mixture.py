"""Several corpora as one run's training pairs: each drawn its weight times its size per epoch (2: every pair
twice; 0.5: a random half, another each epoch), as a pure function of (seed, epoch), so that a resumed run draws
what the uninterrupted one drew. One corpus of weight 1 draws every pair once: the epoch training always had."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from transformer.data.batch import Batch
from transformer.data.store import Corpus
from transformer.data.vocab import OURS, Specials


@dataclass(frozen=True)
class Part:
    """One corpus of a mixture: its name (logs), its pairs, its weight and what identifies its pairs' order (its
    store's train_order)."""

    name: str
    corpus: Corpus
    weight: float = 1.0
    order: str = ""


class Mixture:
    """The corpora a run trains on, numbered one after the other: pair i of part k is mixture index starts[k] + i."""

    def __init__(self, parts: Sequence[Part]):
        self.parts = [p for p in parts if p.weight > 0] or list(parts)  # weight 0: none of its pairs are drawn
        self.starts = np.cumsum([0] + [len(p.corpus) for p in self.parts])

    @classmethod
    def of(cls, corpus: Corpus) -> Mixture:
        """A corpus alone, every pair once an epoch."""
        return cls([Part("main", corpus)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @cached_property
    def src_lengths(self) -> np.ndarray:
        return _joined([p.corpus.src_lengths for p in self.parts])

    @cached_property
    def tgt_lengths(self) -> np.ndarray:
        return _joined([p.corpus.tgt_lengths for p in self.parts])

    @property
    def every_pair_once(self) -> bool:
        return all(p.weight == 1.0 for p in self.parts)

    def drawn(self, seed: int, epoch: int) -> np.ndarray | None:
        """The mixture indices epoch `epoch` draws (a pair drawn twice is there twice), or None where every pair is
        drawn once (the whole mixture, in order). A random stream of its own: make_batches's is (seed, epoch)."""
        if self.every_pair_once:
            return None
        rng = np.random.Generator(np.random.PCG64([seed, epoch, 1]))
        drawn = []
        for start, part in zip(self.starts, self.parts):
            n = len(part.corpus)
            whole, fraction = divmod(part.weight, 1.0)
            picked = [np.tile(np.arange(n), int(whole))]
            if fraction:
                picked.append(np.sort(rng.choice(n, size=int(round(fraction * n)), replace=False)))
            drawn.append(start + np.concatenate(picked))
        return np.concatenate(drawn).astype(np.int64)

    def batch(self, indices: np.ndarray, pad_to_multiple: int = 1, specials: Specials = OURS) -> Batch:
        """The Batch of these mixture indices (grouped by corpus: from_corpora's rows)."""
        if len(self.parts) == 1:
            return Batch.from_corpus(self.parts[0].corpus, indices, pad_to_multiple, specials)
        indices = np.asarray(indices, dtype=np.int64)
        part_of = np.searchsorted(self.starts, indices, side="right") - 1
        parts = [
            (p.corpus, indices[part_of == k] - self.starts[k]) for k, p in enumerate(self.parts) if (part_of == k).any()
        ]
        return Batch.from_corpora(parts, pad_to_multiple, specials)

    @cached_property
    def train_order(self) -> str:
        """What an epoch's batches are made from: a corpus alone, its store's train_order (what runs recorded
        before mixtures); several, a hash of each one's name, weight and order."""
        if len(self.parts) == 1 and self.parts[0].weight == 1.0:
            return self.parts[0].order
        record = [(p.name, p.weight, p.order) for p in self.parts]
        return hashlib.sha256(json.dumps(record).encode("utf-8")).hexdigest()

    def shares(self) -> list[dict]:
        """Per corpus: its pairs, tokens (both sides), the pairs an epoch draws of it and their share of the epoch's
        pairs and target tokens."""
        rows = []
        for p in self.parts:
            tokens = int(p.corpus.src_lengths.sum()) + int(p.corpus.tgt_lengths.sum())
            drawn = p.weight * len(p.corpus)
            rows.append(
                {
                    "name": p.name,
                    "pairs": len(p.corpus),
                    "tokens": tokens,
                    "weight": p.weight,
                    "drawn": drawn,
                    "drawn_tgt": p.weight * int(p.corpus.tgt_lengths.sum()),
                }
            )
        pairs, tgt = sum(r["drawn"] for r in rows), sum(r["drawn_tgt"] for r in rows)
        for r in rows:
            r["share"] = r["drawn"] / pairs if pairs else 0.0
            r["tgt_share"] = r.pop("drawn_tgt") / tgt if tgt else 0.0
        return rows


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
