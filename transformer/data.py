"""Parallel corpora in, token-bucketed Batches out: streaming reads (local files, `datasets`), split names, the
length filter, numpy batching over encoded corpora, and the resumable batch stream with its prefetching thread."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, islice
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from transformer.batch import Batch, round_up
from transformer.config import DataConfig
from transformer.errors import UserError

Pair = tuple[list[int], list[int]]
Chunk = tuple[list[str], list[str]]  # source lines, target lines

CHUNK_LINES = 50_000  # pairs read and encoded at a time: memory stays flat whatever the corpus size
# Where a config says "valid", a dataset may call the split "validation" or "dev" (and so on).
SPLIT_ALIASES = {"valid": ("validation", "dev", "val"), "validation": ("valid", "dev", "val"),
                 "dev": ("validation", "valid"), "test": ("testing",)}


# --------------------------------------------------------------------------- reading local files

def _decode(raw: bytes, path: Path, first_line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        raise UserError(f"data: {path} line {line} is not valid UTF-8 (byte {raw[e.start]:#04x})") from None


def iter_lines(path: str | Path, block_bytes: int = 1 << 24) -> Iterator[str]:
    """The lines of a UTF-8 file, streamed. Only '\\n' ends a line (str.splitlines would also split on U+2028,
    form feeds and other characters that occur inside real sentences); a final '\\r' and a leading BOM go."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data: no such file: {path}")
    line_no, pending, first = 1, b"", True
    with path.open("rb") as f:
        while True:
            block = f.read(block_bytes)
            if not block:
                break
            data = pending + block
            cut = data.rfind(b"\n")
            if cut < 0:
                pending = data
                continue
            complete, pending = data[:cut], data[cut + 1:]
            text = _decode(complete, path, line_no)
            if first and text.startswith("\ufeff"):
                text = text[1:]
            first = False
            lines = text.split("\n")
            line_no += len(lines)
            yield from (line[:-1] if line.endswith("\r") else line for line in lines)
    if pending:
        text = _decode(pending, path, line_no)
        if first and text.startswith("\ufeff"):
            text = text[1:]
        if text:
            yield text[:-1] if text.endswith("\r") else text


def read_lines(path: str | Path) -> list[str]:
    """All lines of a (small) UTF-8 file: translation inputs, test sets."""
    return list(iter_lines(path))


def count_lines(path: str | Path) -> int:
    """Lines of a file as iter_lines yields them, counted on bytes (fast: no decoding)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data: no such file: {path}")
    count, last = 0, b"\n"
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    """Both sides of a (small) parallel file pair, checked like a training corpus."""
    _check_parallel(src_path, tgt_path)
    return read_lines(src_path), read_lines(tgt_path)


def _check_parallel(src_path: str | Path, tgt_path: str | Path) -> int:
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    if n_src != n_tgt:
        raise UserError(f"data: {src_path} has {n_src} lines but {tgt_path} has {n_tgt}; "
                        "line N of one side must translate line N of the other")
    if not n_src:
        raise UserError(f"data: {src_path} and {tgt_path} are empty")
    return n_src


def _chunks_of(pairs: Iterator[tuple[str, str]], size: int) -> Iterator[Chunk]:
    while batch := list(islice(pairs, size)):
        src, tgt = zip(*batch)
        yield list(src), list(tgt)


# --------------------------------------------------------------------------- splits: local or hub

@dataclass(frozen=True)
class RawSplit:
    """One split of a parallel corpus, ready to be streamed (possibly more than once) in chunks of pairs."""

    name: str                                  # the split's name in the corpus ("validation" for a "valid" key)
    chunks: Callable[[], Iterator[Chunk]]      # a new stream of (source lines, target lines) chunks per call
    fingerprint: dict                          # what identifies the input: paths, sizes, mtimes / dataset files
    count: Callable[[], int]                   # pairs the stream yields; checks that the sides agree (reads
                                               # the files: called before streaming, never for a reused store)

    @cached_property
    def n_pairs(self) -> int:
        return self.count()


def split_paths(cfg: DataConfig, split: str) -> tuple[Path, Path]:
    base = Path(cfg.dir)
    return base / f"{split}.{cfg.src_lang}", base / f"{split}.{cfg.tgt_lang}"


def _candidates(split: str) -> tuple[str, ...]:
    return (split,) + SPLIT_ALIASES.get(split, ())


def resolve_split(cfg: DataConfig, split: str, log: Optional[Callable[[str], None]] = None) -> str:
    """The corpus's own name for `split`: the name itself, else an alias ("valid" -> "validation" or "dev").
    Cheap (no data is read), so every split can be checked before any expensive work."""
    if cfg.source == "hub":
        available = _hub_split_names(cfg)
    else:
        available = [s for s in _candidates(split) if all(p.is_file() for p in split_paths(cfg, s))]
    for name in _candidates(split):
        if name in available:
            if name != split and log is not None:
                log(f"data: split '{split}' not found; using '{name}'")
            return name
    if cfg.source == "hub":
        raise UserError(f"data: {cfg.hub_name!r} has no split {split!r} (its splits: {', '.join(available)}); "
                        "set data.train_split / data.valid_split / data.test_split")
    src, tgt = split_paths(cfg, split)
    missing = src if not src.is_file() else tgt
    raise UserError(f"data: no such file: {missing} (split {split!r} in data.dir {cfg.dir!r})")


def open_split(cfg: DataConfig, split: str, limit: int = 0, log: Optional[Callable[[str], None]] = None) -> RawSplit:
    """A split by its config name (resolved through aliases), its first `limit` pairs when limit > 0."""
    name = resolve_split(cfg, split, log)
    if cfg.source == "hub":
        return _open_hub_split(cfg, name, limit)
    src_path, tgt_path = split_paths(cfg, name)

    def count() -> int:
        n = _check_parallel(src_path, tgt_path)
        return min(n, limit) if limit else n

    def chunks() -> Iterator[Chunk]:
        src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
        pairs = zip(src_lines, tgt_lines)
        yield from _chunks_of(islice(pairs, limit) if limit else pairs, CHUNK_LINES)

    files = [{"path": str(p.resolve()), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
             for p in (src_path, tgt_path)]
    return RawSplit(name, chunks, {"source": "local", "files": files, "limit": limit}, count)


def load_split(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """All raw sentences of a (small) split, e.g. the test set that `evaluate` translates."""
    raw = open_split(cfg, split)
    src, tgt = [], []
    for s, t in raw.chunks():
        src += s
        tgt += t
    return src, tgt


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError("data.source 'hub' needs the `datasets` package: pip install 'transformer[hub]' "
                        "(or pip install datasets)") from None
    return datasets


def _hub_error(cfg: DataConfig, what: str, e: Exception) -> UserError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(f"data: cannot load {what} of {cfg.hub_name!r} through `datasets`: {first}")


def _hub_split_names(cfg: DataConfig) -> list[str]:
    datasets = _datasets()
    try:
        return list(datasets.get_dataset_split_names(cfg.hub_name, cfg.hub_config))
    except Exception as e:  # network, unknown name or config: all reach the user as one line
        raise _hub_error(cfg, "the split names", e) from None


def _open_hub_split(cfg: DataConfig, name: str, limit: int) -> RawSplit:
    """A `datasets` split (rows {src: .., tgt: ..} or {"translation": {..}}); `datasets` caches it on disk as
    memory-mapped Arrow, which is streamed here in chunks."""
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=name)
    except Exception as e:
        raise _hub_error(cfg, f"split {name!r}", e) from None
    columns = ds.column_names
    if "translation" not in columns and not {cfg.src_lang, cfg.tgt_lang} <= set(columns):
        raise UserError(f"data: {cfg.hub_name!r} has columns {columns}; expected '{cfg.src_lang}' and "
                        f"'{cfg.tgt_lang}' or a 'translation' column")
    if "translation" in columns and len(ds):
        languages = set(ds[0]["translation"])
        if not {cfg.src_lang, cfg.tgt_lang} <= languages:
            raise UserError(f"data: {cfg.hub_name!r} translations have languages {sorted(languages)}, not "
                            f"{cfg.src_lang!r} and {cfg.tgt_lang!r}; check data.src_lang, data.tgt_lang and "
                            "data.hub_config")
    if not len(ds):
        raise UserError(f"data: {cfg.hub_name!r} split {name!r} is empty")
    n = min(len(ds), limit) if limit else len(ds)

    def chunks() -> Iterator[Chunk]:
        part = ds.select(range(n)) if n < len(ds) else ds
        for rows in part.iter(batch_size=CHUNK_LINES):
            if "translation" in rows:
                pairs = rows["translation"]
                src, tgt = [p[cfg.src_lang] for p in pairs], [p[cfg.tgt_lang] for p in pairs]
            else:
                src, tgt = rows[cfg.src_lang], rows[cfg.tgt_lang]
            yield [s or "" for s in src], [t or "" for t in tgt]  # a missing side counts as blank

    files = []
    for entry in ds.cache_files:
        p = Path(entry["filename"])
        files.append({"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns})
    fingerprint = {"source": "hub", "hub_name": cfg.hub_name, "hub_config": cfg.hub_config, "split": name,
                   "rows": len(ds), "files": files, "limit": limit}
    return RawSplit(name, chunks, fingerprint, lambda: n)


# --------------------------------------------------------------------------- filtering and batching on lengths

def keep_mask(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kept, dropped as blank, dropped as too long), boolean per pair: the training filter."""
    blank = (src_len == 0) | (tgt_len == 0)
    long = ~blank & ((src_len > max_len) | (tgt_len > max_len))
    return ~blank & ~long, blank, long


def pack_by_size(order: Sequence[int], sizes: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Cut `order` into consecutive batches whose count x largest size stays within max_tokens
    (a single item larger than that still gets a batch of its own). For translation inputs."""
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


@dataclass(frozen=True)
class Batches:
    """An epoch's batches without Python lists: batch i holds pair indices order[starts[i]:ends[i]]."""

    order: np.ndarray   # (N,) pair indices, length-sorted
    starts: np.ndarray  # (n_batches,)
    ends: np.ndarray    # (n_batches,)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.order[self.starts[i]:self.ends[i]]

    def take(self, n: int) -> "Batches":
        """The first n batches."""
        return Batches(self.order, self.starts[:n], self.ends[:n])


def _length_sorted(size: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """Pair indices sorted by padded size, then source and target length; `tie` (a permutation) breaks ties."""
    if max(int(size.max()), int(src_len.max()), int(tgt_len.max())) < 1 << 11:
        # One int64 key and a stable sort: about twice as fast as lexsort on millions of pairs.
        key = (size.astype(np.int64) << 22) | (src_len.astype(np.int64) << 11) | tgt_len.astype(np.int64)
        return tie[np.argsort(key[tie], kind="stable")]
    return tie[np.lexsort((tgt_len[tie], src_len[tie], size[tie]))]


def _cut(sorted_size: np.ndarray, max_tokens: int) -> np.ndarray:
    """Batch start positions in a size-sorted order: the greedy packing of pack_by_size (the pair about to join a
    batch is its largest), computed per run of equal sizes (a few hundred) instead of per pair (millions)."""
    n = len(sorted_size)
    run_starts = np.flatnonzero(np.r_[True, sorted_size[1:] != sorted_size[:-1]])
    starts: list[np.ndarray] = []
    open_start, open_count = 0, 0  # the last batch, still filling up, carried into the next run
    for a, b in zip(run_starts.tolist(), np.r_[run_starts[1:], n].tolist()):
        cap = max(1, max_tokens // int(sorted_size[a]))  # pairs per batch when pairs of this size are the largest
        if open_count:
            taken = min(max(cap - open_count, 0), b - a)
            if open_count + taken < cap:   # the whole run fits and the batch stays open
                open_count += taken
                continue
            starts.append(np.array([open_start]))
            a += taken
        if a == b:
            open_count = 0
            continue
        batch_starts = np.arange(a, b, cap)                 # the rest of the run in batches of cap pairs
        starts.append(batch_starts[:-1])
        open_start, open_count = int(batch_starts[-1]), b - int(batch_starts[-1])  # the last may take more
    if open_count:
        starts.append(np.array([open_start]))
    return np.concatenate(starts).astype(np.int64)


def make_batches(src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, seed: int, epoch: int,
                 shuffle: bool = True, pad_to_multiple: int = 1) -> Batches:
    """Batches of at most max_tokens padded tokens (batch size x the longest side + EOS, rounded up to
    pad_to_multiple), bucketed by length; a pure function of (lengths, seed, epoch).

    Pairs are sorted by that padded size (then source and target length, ties broken at random), and the
    order is cut greedily: vectorised, so an epoch of millions of pairs is batched in about a second."""
    n = len(src_len)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Batches(empty, empty, empty)
    src_len, tgt_len = np.asarray(src_len, dtype=np.int64), np.asarray(tgt_len, dtype=np.int64)
    size = round_up(np.maximum(src_len, tgt_len) + 1, pad_to_multiple)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    tie = rng.permutation(n) if shuffle else np.arange(n)
    order = _length_sorted(size, src_len, tgt_len, tie)
    starts = _cut(size[order], max_tokens)
    ends = np.r_[starts[1:], n]
    if shuffle:
        perm = rng.permutation(len(starts))
        starts, ends = starts[perm], ends[perm]
    return Batches(order, starts, ends)


def eval_batches(corpus, max_tokens: int, pad_to_multiple: int = 1) -> list[Batch]:
    """Fixed, unshuffled batches of a (small) corpus, for validation."""
    batches = make_batches(corpus.src_lengths, corpus.tgt_lengths, max_tokens, 0, 0, shuffle=False,
                           pad_to_multiple=pad_to_multiple)
    return [Batch.from_corpus(corpus, batches[i], pad_to_multiple) for i in range(len(batches))]


# --------------------------------------------------------------------------- the training stream

@dataclass
class Update:
    """What one optimizer update consumes on this rank, and where the stream stands after it."""

    batches: list[Batch]       # this rank's update_freq batches
    n_tgt_tokens: int          # target tokens of the whole update, all ranks (normalises the loss)
    n_src_tokens: int
    data_state: dict           # the stream position after this update: what a checkpoint saves
    epochs_done: int


class BatchStream:
    """Endless stream of training Batches over an encoded corpus, epoch after epoch, resumable at (epoch, position).

    An update consumes a group of world_size x update_freq consecutive batches of the epoch's
    order; rank r takes group[r::world_size]. So 1 process with update_freq 8 and 8 processes
    with update_freq 1 see the same batches per update, and every rank knows the token count
    of the whole group without communicating. `position` counts this rank's batches, which is
    the same number on every rank.
    """

    def __init__(self, corpus, cfg: DataConfig, seed: int, epoch: int = 0, batches_done: int = 0,
                 rank: int = 0, world_size: int = 1, update_freq: int = 1):
        """batches_done: batches of the epoch already consumed by all ranks together (what state() saves),
        so that a run may resume with another number of ranks or another update_freq."""
        if batches_done % (world_size * update_freq):
            raise UserError(f"data: cannot resume after {batches_done} batches of an epoch with updates of "
                            f"{world_size} ranks x update_freq {update_freq}")
        self.corpus, self.cfg, self.seed = corpus, cfg, seed
        self.src_len, self.tgt_len = corpus.src_lengths, corpus.tgt_lengths
        self.rank, self.world_size, self.update_freq = rank, world_size, update_freq
        self.epoch, self.position = epoch, batches_done // world_size  # position: this rank's next batch
        self._batches = self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> Batches:
        batches = make_batches(self.src_len, self.tgt_len, self.cfg.max_tokens, self.seed, epoch,
                               pad_to_multiple=self.cfg.pad_to_multiple)
        group = self.world_size * self.update_freq
        if len(batches) < group:
            raise UserError(f"data: {len(batches)} batches per epoch cannot fill one update of "
                            f"{self.world_size} ranks x {self.cfg.max_tokens} tokens x update_freq {self.update_freq}")
        # An update never straddles two epochs; the few batches that do not fill a group are left out.
        return batches.take(len(batches) - len(batches) % group)

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
        return Batch.from_corpus(self.corpus, indices, self.cfg.pad_to_multiple)

    def next_update(self) -> Update:
        """This rank's update_freq batches, and the token counts of the whole update across all ranks."""
        if self.position % self.update_freq != 0:
            raise RuntimeError("next_update() called in the middle of an update")
        self._roll_epoch()
        group_start = self._global_index(self.position) - self.rank
        group = np.concatenate([self._batches[i] for i in range(group_start,
                                                                 group_start + self.world_size * self.update_freq)])
        n_tgt = int(self.tgt_len[group].sum()) + len(group)  # + EOS per sentence
        n_src = int(self.src_len[group].sum()) + len(group)
        batches = [next(self) for _ in range(self.update_freq)]
        return Update(batches, n_tgt, n_src, self.state(), self.epochs_done)

    def state(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.position * self.world_size}


class Prefetcher:
    """Builds the next updates in a background thread while the current one computes, so the training loop
    waits for data only when the host falls behind; `wait_seconds` says how long it waited in total."""

    def __init__(self, stream: BatchStream, pin_memory: bool = False, depth: int = 2):
        self.epochs_done = stream.epochs_done  # of the last update handed out (the stream itself runs ahead)
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(stream, pin_memory), daemon=True,
                                        name="batch-prefetch")
        self._thread.start()

    def _work(self, stream: BatchStream, pin_memory: bool) -> None:
        try:
            while not self._stop.is_set():
                update = stream.next_update()
                if pin_memory:  # pinned host memory lets the copy to the GPU overlap its kernels
                    update.batches = [b.pin_memory() for b in update.batches]
                self._put(update)
        except BaseException as e:  # handed to the training loop, which raises it
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> Update:
        start = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        self.epochs_done = item.epochs_done
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def chain_lines(chunks: Iterator[Chunk]) -> Iterator[str]:
    """Every sentence of a stream of chunks, source and target of a pair in turn (SentencePiece's input)."""
    return chain.from_iterable(chain.from_iterable(zip(src, tgt)) for src, tgt in chunks)
