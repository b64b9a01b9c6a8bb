"""Parallel corpora in, token-bucketed Batches out: reading, checking, encoding, filtering, batching."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from transformer.batch import Batch
from transformer.config import DataConfig
from transformer.errors import UserError
from transformer.vocab import Vocab

Pair = tuple[list[int], list[int]]


def read_lines(path: str | Path) -> list[str]:
    """One sentence per line, UTF-8. Only '\\n' ends a line (str.splitlines would also split
    on U+2028, form feeds and other characters that occur inside real sentences)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data: no such file: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"data: {path} line {line} is not valid UTF-8 (byte {raw[e.start]:#04x})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise UserError(
            f"data: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; "
            "line N of one side must translate line N of the other"
        )
    if not src:
        raise UserError(f"data: {src_path} and {tgt_path} are empty")
    return src, tgt


def _hub_split(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """Load a split through Hugging Face `datasets` (rows {src: .., tgt: ..} or {"translation": {..}})."""
    try:
        import datasets
    except ImportError:
        raise UserError("data.source 'hub' needs the `datasets` package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=split)
    except Exception as e:  # network, unknown name, unknown split: all reach the user as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"data: cannot load {cfg.hub_name!r} split {split!r} from the hub: {first}") from None
    columns = ds.column_names
    if "translation" in columns:
        rows = ds["translation"]
        missing = {cfg.src_lang, cfg.tgt_lang} - set(rows[0] if rows else {})
        if missing:
            raise UserError(f"data: {cfg.hub_name!r} translations have languages {sorted(rows[0])}, "
                            f"not {sorted(missing)}; check data.src_lang, data.tgt_lang and data.hub_config")
        src = [r[cfg.src_lang] for r in rows]
        tgt = [r[cfg.tgt_lang] for r in rows]
    elif cfg.src_lang in columns and cfg.tgt_lang in columns:
        src, tgt = list(ds[cfg.src_lang]), list(ds[cfg.tgt_lang])
    else:
        raise UserError(
            f"data: {cfg.hub_name!r} has columns {columns}; expected '{cfg.src_lang}' and '{cfg.tgt_lang}' "
            "or a 'translation' column"
        )
    if not src:
        raise UserError(f"data: {cfg.hub_name!r} split {split!r} is empty")
    return src, tgt


def split_paths(cfg: DataConfig, split: str) -> tuple[Path, Path]:
    base = Path(cfg.dir)
    return base / f"{split}.{cfg.src_lang}", base / f"{split}.{cfg.tgt_lang}"


def load_split(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """Raw source and target sentences of one split, from local files or the hub."""
    if cfg.source == "hub":
        return _hub_split(cfg, split)
    return read_parallel(*split_paths(cfg, split))


@dataclass
class EncodedCorpus:
    pairs: list[Pair]
    kept: list[bool]        # per input line: whether its pair is in `pairs`
    dropped_long: int = 0
    dropped_blank: int = 0


def encode_corpus(vocab: Vocab, src: Sequence[str], tgt: Sequence[str], max_len: int) -> EncodedCorpus:
    """Encode both sides; drop pairs with a blank side or a side longer than max_len subwords."""
    src_ids, tgt_ids = vocab.encode(src), vocab.encode(tgt)
    out = EncodedCorpus([], [])
    for s, t in zip(src_ids, tgt_ids):
        if not s or not t:
            out.dropped_blank += 1
        elif len(s) > max_len or len(t) > max_len:
            out.dropped_long += 1
        else:
            out.pairs.append((s, t))
        out.kept.append(bool(s and t and len(s) <= max_len and len(t) <= max_len))
    return out


def pack_by_size(order: Sequence[int], sizes: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Cut `order` into consecutive batches whose count x largest size stays within max_tokens
    (a single item larger than that still gets a batch of its own)."""
    batches, current, longest = [], [], 0
    for i in order:
        if current and max(longest, sizes[i]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, sizes[i])
    if current:
        batches.append(current)
    return batches


def make_batches(
    pairs: Sequence[Pair], max_tokens: int, seed: int, epoch: int, shuffle: bool = True, pad_to_multiple: int = 1
) -> list[list[int]]:
    """Group pair indices into batches of at most max_tokens padded tokens (batch size x the
    longest side + special tokens), bucketed by length; deterministic given (seed, epoch)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(pairs)))
    if shuffle:
        rng.shuffle(order)  # random tie-breaking among equal lengths
    # Sorting by length keeps padding small; stable sort keeps the shuffle among ties.
    order.sort(key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))

    def padded(n: int) -> int:
        return -(-n // pad_to_multiple) * pad_to_multiple

    # + 1: EOS on the source side, BOS or EOS on the target side.
    batches = pack_by_size(order, [padded(max(len(s), len(t)) + 1) for s, t in pairs], max_tokens)
    if shuffle:
        rng.shuffle(batches)
    return batches


class BatchStream:
    """Endless stream of training Batches, epoch after epoch, resumable at (epoch, position).

    An update consumes a group of world_size x update_freq consecutive batches of the epoch's
    order; rank r takes group[r::world_size]. So 1 process with update_freq 8 and 8 processes
    with update_freq 1 see the same batches per update, and every rank knows the token count
    of the whole group without communicating. `position` counts this rank's batches, which is
    the same number on every rank.
    """

    def __init__(self, pairs: Sequence[Pair], cfg: DataConfig, seed: int, epoch: int = 0, batches_done: int = 0,
                 rank: int = 0, world_size: int = 1, update_freq: int = 1):
        """batches_done: batches of the epoch already consumed by all ranks together (what state() saves),
        so that a run may resume with another number of ranks or another update_freq."""
        if batches_done % (world_size * update_freq):
            raise UserError(f"data: cannot resume after {batches_done} batches of an epoch with updates of "
                            f"{world_size} ranks x update_freq {update_freq}")
        self.pairs, self.cfg, self.seed = pairs, cfg, seed
        self.rank, self.world_size, self.update_freq = rank, world_size, update_freq
        self.epoch, self.position = epoch, batches_done // world_size  # position: this rank's next batch
        self._batches = self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        batches = make_batches(self.pairs, self.cfg.max_tokens, self.seed, epoch,
                               pad_to_multiple=self.cfg.pad_to_multiple)
        group = self.world_size * self.update_freq
        if len(batches) < group:
            raise UserError(f"data: {len(batches)} batches per epoch cannot fill one update of "
                            f"{self.world_size} ranks x {self.cfg.max_tokens} tokens x update_freq {self.update_freq}")
        # An update never straddles two epochs; the few batches that do not fill a group are left out.
        return batches[: len(batches) - len(batches) % group]

    @property
    def batches_per_epoch(self) -> int:
        """Batches this rank sees per epoch."""
        return len(self._batches) // self.world_size

    @property
    def epochs_done(self) -> int:
        return self.epoch + (self.position >= self.batches_per_epoch)

    def _global_index(self, position: int) -> int:
        group, j = divmod(position, self.update_freq)
        return group * self.world_size * self.update_freq + j * self.world_size + self.rank

    def _roll_epoch(self) -> None:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._batches = self._epoch_batches(self.epoch)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        self._roll_epoch()
        indices = self._batches[self._global_index(self.position)]
        self.position += 1
        return Batch.from_pairs([self.pairs[i] for i in indices], self.cfg.pad_to_multiple)

    def next_update(self) -> tuple[list[Batch], int, int]:
        """This rank's update_freq batches, and the target and source token counts of the whole
        update across all ranks (for normalising the loss per target token)."""
        if self.position % self.update_freq != 0:
            raise RuntimeError("next_update() called in the middle of an update")
        self._roll_epoch()
        group_start = self._global_index(self.position) - self.rank
        group = self._batches[group_start: group_start + self.world_size * self.update_freq]
        n_tgt = sum(len(self.pairs[i][1]) + 1 for b in group for i in b)
        n_src = sum(len(self.pairs[i][0]) + 1 for b in group for i in b)
        return [next(self) for _ in range(self.update_freq)], n_tgt, n_src

    def state(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.position * self.world_size}


def eval_batches(pairs: Sequence[Pair], max_tokens: int, pad_to_multiple: int = 1) -> list[Batch]:
    """Fixed, unshuffled batches for validation."""
    return [Batch.from_pairs([pairs[i] for i in idx], pad_to_multiple)
            for idx in make_batches(pairs, max_tokens, 0, 0, shuffle=False, pad_to_multiple=pad_to_multiple)]
