"""The lexical shortlist: per source piece, the target pieces its translations hold, so that a search scores only
its candidates at each step (its source's pieces' lists, the most frequent target pieces, EOS) instead of the
whole vocabulary: the output projection over a few hundred rows instead of thousands. Marian's shortlist and
CTranslate2's vocabulary map (`use_vmap`) do the same; the file is CTranslate2's vmap format, so that one file
serves both engines. A batch's sentences share one projection onto the union of their candidates, but each
sentence's softmax is over its own (the others' get -inf), so that what it gets does not depend on its batch
mates; CTranslate2 gives every sentence the batch's union.

The lists come from co-occurrence in a parallel corpus, ranked by the Dice coefficient 2 c(s, t) / (c(s) + c(t))
(c: the sentence pairs holding a piece, or both), which needs no word aligner; a pair seen once is noise. What
it costs in BLEU and gains in speed is measured by evaluate and scripts/bench_models.py, with and without
--shortlist (docs/more-data.md, "A shortlist")."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from transformer.errors import UserError
from transformer.files import atomic_write
from transformer.run_dir import RunDir

FREQUENT = 100  # target pieces always scored: those in most sentences (function words, punctuation)
PER_PIECE = 50  # candidates kept per source piece
MIN_PAIRS = 2  # a (source, target) piece pair seen in fewer sentence pairs is not kept
CHUNK = 2**24  # piece-pair keys (128 MB) gathered before they are counted


@dataclass(frozen=True)
class Shortlist:
    """The candidates: `always` (sorted ids every batch scores) and per source id a list (CSR: the ids
    targets[starts[s]:starts[s + 1]])."""

    always: np.ndarray  # (A,) int64
    starts: np.ndarray  # (V + 1,) int64
    targets: np.ndarray  # (N,) int64

    @property
    def vocab_size(self) -> int:
        return len(self.starts) - 1

    def candidates(self, src: torch.Tensor, also: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the sorted target ids a batch of sources `src` (B, S) may produce (K,), which of them each source's
        own candidates are (B, K) bool), on src's device. A source's own: `always`, its pieces' lists, and its row
        of `also` (B, L): ids a forced prefix or a constraint needs, -1 for none."""
        rows = src.detach().cpu().numpy()
        extra = None if also is None else also.detach().cpu().numpy().astype(np.int64)
        own = []
        for b, row in enumerate(rows):
            pieces = np.unique(row)
            pieces = pieces[(pieces >= 0) & (pieces < self.vocab_size)].tolist()
            lists = [self.targets[self.starts[p] : self.starts[p + 1]] for p in pieces]
            needed = [] if extra is None else [extra[b][extra[b] >= 0]]
            own.append(np.unique(np.concatenate([self.always, *lists, *needed])))
        ids = np.unique(np.concatenate(own))
        on = np.zeros((len(rows), len(ids)), dtype=bool)
        for b, mine in enumerate(own):
            on[b, np.searchsorted(ids, mine)] = True
        return torch.from_numpy(ids).to(src.device), torch.from_numpy(on).to(src.device)


def build(
    pairs: Iterable[tuple[Sequence[int], Sequence[int]]],
    vocab_size: int,
    always: Sequence[int],
    frequent: int = FREQUENT,
    per_piece: int = PER_PIECE,
    min_pairs: int = MIN_PAIRS,
) -> Shortlist:
    """A shortlist from sentence pairs of ids: the `frequent` target pieces in most sentences and `always` (the
    specials a search needs) for every batch; per source piece the `per_piece` target pieces of highest Dice
    coefficient among those seen with it in at least `min_pairs` pairs."""
    src_count, tgt_count = np.zeros(vocab_size, np.int64), np.zeros(vocab_size, np.int64)
    counted = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (piece-pair keys, sentence pairs), merged so far
    keys, held, seen = [], 0, False
    for src, tgt in pairs:
        s, t = np.unique(np.asarray(src, np.int64)), np.unique(np.asarray(tgt, np.int64))
        src_count[s] += 1
        tgt_count[t] += 1
        keys.append((s[:, None] * vocab_size + t[None, :]).ravel())
        held, seen = held + keys[-1].size, True
        if held > CHUNK:  # counted as it goes: memory follows the distinct piece pairs, not the corpus
            counted, keys, held = merge_counts(counted, keys), [], 0
    if not seen:
        raise UserError("shortlist: the corpus holds no sentence pairs")
    pair_keys, together = merge_counts(counted, keys)
    kept = together >= min_pairs
    pair_keys, together = pair_keys[kept], together[kept]
    s, t = pair_keys // vocab_size, pair_keys % vocab_size
    dice = 2.0 * together / (src_count[s] + tgt_count[t])
    # Per source piece, best first: sorted by source, then by Dice descending (lexsort's last key is the first).
    order = np.lexsort((-dice, s))
    s, t = s[order], t[order]
    first = np.searchsorted(s, np.arange(vocab_size), side="left")
    rank = np.arange(len(s)) - first[s]  # a pair's place in its source piece's list
    s, t = s[rank < per_piece], t[rank < per_piece]
    starts = np.searchsorted(s, np.arange(vocab_size + 1), side="left").astype(np.int64)
    most = np.argsort(-tgt_count, kind="stable")[:frequent]
    most = most[tgt_count[most] > 0]
    return Shortlist(np.unique(np.concatenate([most, np.asarray(always, np.int64)])), starts, t.astype(np.int64))


def merge_counts(counted: tuple[np.ndarray, np.ndarray], keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct keys, their counts) of `counted`'s and `keys`' together."""
    new, counts = np.unique(np.concatenate(keys) if keys else np.zeros(0, np.int64), return_counts=True)
    merged, where = np.unique(np.concatenate([counted[0], new]), return_inverse=True)
    total = np.bincount(where, weights=np.concatenate([counted[1], counts]), minlength=len(merged))
    return merged, total.astype(np.int64)


def save(shortlist: Shortlist, pieces: Sequence[str], path: str | Path) -> None:
    """Write `shortlist` as CTranslate2's vmap text: a line per source piece, `piece<TAB>target target ...`, and one
    for the pieces every batch scores, under the empty key."""
    lines = ["\t" + " ".join(pieces[i] for i in shortlist.always)]
    for s in range(shortlist.vocab_size):
        ids = shortlist.targets[shortlist.starts[s] : shortlist.starts[s + 1]]
        if len(ids):
            lines.append(pieces[s] + "\t" + " ".join(pieces[i] for i in ids))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def load(path: str | Path, piece_ids: dict[str, int], always: Sequence[int]) -> Shortlist:
    """Read a vmap file written by save (or by hand) against a vocabulary's {piece: id}; `always`: the specials a
    search needs, added. A piece the vocabulary lacks is a one-line error naming it (a list for another model)."""
    path = Path(path)
    by_source: dict[int, list[int]] = {}
    fixed = list(always)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(no_shortlist(path.parent)) from None

    def ids(words: list[str], number: int) -> list[int]:
        missing = [w for w in words if w not in piece_ids]
        if missing:
            raise UserError(f"{path}, line {number}: {missing[0]!r} is not a piece of this model's vocabulary")
        return [piece_ids[w] for w in words]

    # Split as CTranslate2 reads the file: lines at "\n", pieces at " " (a piece may hold any other space).
    seen: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        key, tab, values = line.partition("\t")
        if not tab or " " in key:
            raise UserError(f"{path}, line {number}: expected 'piece<TAB>piece piece ...' (one source piece a line)")
        if key in seen:  # CTranslate2 would keep the last line and we the union: refused, so both read one list
            raise UserError(f"{path}, line {number}: {key!r} has a line already (line {seen[key]}); merge the two")
        seen[key] = number
        targets = ids([v for v in values.split(" ") if v], number)
        if key == "":
            fixed += targets
        else:
            by_source[ids([key], number)[0]] = targets
    vocab_size = max(piece_ids.values()) + 1
    starts, targets = [0], []
    for s in range(vocab_size):
        targets += by_source.get(s, [])
        starts.append(len(targets))
    return Shortlist(
        np.unique(np.asarray(fixed, np.int64)), np.asarray(starts, np.int64), np.asarray(targets, np.int64)
    )


def of_run(checkpoint: str | Path, vocab, specials) -> Shortlist:
    """The shortlist.txt beside `checkpoint` (a run directory or a checkpoint file in one), read against `vocab`;
    a missing one is a one-line error that names the command writing it."""
    from transformer.model.checkpoint import resolve_checkpoint

    pieces = vocab.pieces(range(len(vocab)))
    path = resolve_checkpoint(checkpoint).parent / RunDir.SHORTLIST
    return load(path, {piece: i for i, piece in enumerate(pieces)}, [specials.eos, specials.unk])


def no_shortlist(directory: Path) -> str:
    return f"--shortlist: {directory} holds no {RunDir.SHORTLIST}; write one with `transformer shortlist {directory}`"


class ShortlistOutput:
    """A model's output projection over a shortlist: its weight and bias as trained (kept before a CPU weight format
    packs or quantizes them), and per batch the rows of the batch's candidates, in the dtype the decoder's states
    come in."""

    def __init__(self, shortlist: Shortlist, weight: torch.Tensor, bias: torch.Tensor | None):
        if weight.size(0) != shortlist.vocab_size:
            raise UserError(
                f"--shortlist: the list is for a vocabulary of {shortlist.vocab_size} pieces, the model has "
                f"{weight.size(0)}; write it again with `transformer shortlist`"
            )
        self.shortlist, self.weight, self.bias = shortlist, weight.detach(), None if bias is None else bias.detach()

    def restrict(self, src: torch.Tensor, like: torch.nn.Module, dtype: torch.dtype, also=None):
        """-> (the batch's candidates' ids (K,), the projection of states (R, C) in `dtype` onto them, (R, K), each
        id's column among them (V,), -1 off the list, and per source the columns off its own list (B, K) bool).
        The projection takes the layout of the model's own output projection `like` (weight_formats.py), so that a
        list of every piece gives the same logits; an int8 one's rows are multiplied as floats. `also`: None, or a
        function giving each source's ids its list must keep (B, L), -1 padded."""
        from transformer.inference.weight_formats import InputMajorLinear, PackedLinear

        ids, on = self.shortlist.candidates(src, None if also is None else also())
        off = ~on
        columns = torch.full((self.shortlist.vocab_size,), -1, dtype=torch.long, device=ids.device)
        columns[ids] = torch.arange(len(ids), device=ids.device)
        weight = self.weight.index_select(0, ids.to(self.weight.device)).to(dtype)
        bias = None if self.bias is None else self.bias.index_select(0, ids.to(self.bias.device)).to(dtype)
        rows = SimpleNamespace(in_features=weight.size(1), out_features=len(ids), weight=weight, bias=bias)
        if isinstance(like, PackedLinear):  # packed once per batch, as the full projection is once per model
            return ids, PackedLinear(rows, dtype), columns, off
        if isinstance(like, InputMajorLinear):
            return ids, InputMajorLinear(rows), columns, off
        return ids, lambda states: F.linear(states, weight, bias), columns, off


def coverage(shortlist: Shortlist, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[float, float]:
    """-> (the share of the reference pieces that are among their own sentence's candidates, the mean candidates a
    sentence has): what a list leaves out, on pairs it was not built from."""
    held = total = candidates = 0
    for src, tgt in pairs:
        allowed = shortlist.candidates(torch.as_tensor(np.asarray(src, np.int64)[None, :]))[0].numpy()
        held += int(np.isin(np.asarray(tgt, np.int64), allowed).sum())
        total += len(tgt)
        candidates += len(allowed)
    return held / max(total, 1), candidates / max(len(pairs), 1)


def write_shortlist(
    run: str,
    src: str | None,
    tgt: str | None,
    frequent: int = FREQUENT,
    per_piece: int = PER_PIECE,
    min_pairs: int = MIN_PAIRS,
) -> Path:
    """The `shortlist` command: RUN/shortlist.txt from the run's training pairs (or --src/--tgt), and what it keeps
    of the run's validation references, printed."""
    from transformer.data.corpus import load_split, read_parallel
    from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint, resolve_checkpoint

    checkpoint = resolve_checkpoint(run)
    model, vocab, cfg = model_from_checkpoint(load_checkpoint(checkpoint))
    if (src is None) != (tgt is None):
        raise UserError("shortlist: --src and --tgt go together (a parallel corpus), or neither (the run's own)")
    where = f"{src} and {tgt}" if src else f"the run's {cfg.data.train_split} split ({cfg.data.dir})"
    print(f"shortlist: counting the pieces of {where}", file=sys.stderr)
    sources, targets = read_parallel(src, tgt) if src else load_split(cfg.data, cfg.data.train_split)
    specials = model.specials
    table = build(
        zip(vocab.encode(sources), vocab.encode_target(targets)),
        len(vocab),
        [specials.eos, specials.unk],
        frequent,
        per_piece,
        min_pairs,
    )
    path = checkpoint.parent / RunDir.SHORTLIST
    save(table, vocab.pieces(range(len(vocab))), path)
    valid_src, valid_tgt = load_split(cfg.data, cfg.data.valid_split)
    kept, size = coverage(table, list(zip(vocab.encode(valid_src), vocab.encode_target(valid_tgt))))
    print(
        f"wrote {path}: {int((np.diff(table.starts) > 0).sum())} source pieces with lists of up to {per_piece}, "
        f"{len(table.always)} pieces always; on the {cfg.data.valid_split} split a sentence has {size:.0f} "
        f"candidates of {len(vocab)}, which hold {100 * kept:.1f}% of its reference's pieces"
    )
    return path
