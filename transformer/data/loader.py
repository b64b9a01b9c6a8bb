"""Which ids go into which batch, in what order: training's batches (numpy token batching, an epoch of millions of
pairs in about a second; the resumable batch stream; the thread that prepares the next update while one computes)
and a search's sources in length batches (`source_batches`, for both engines). One batch's tensors: batch.py."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from transformer.config import DataConfig, round_up
from transformer.data.batch import Batch, source_limit
from transformer.data.mixture import Mixture
from transformer.data.vocab import OURS, Specials
from transformer.device import cuda_index
from transformer.errors import UserError

# --------------------------------------------------------------------------- filtering and batching on lengths


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


def length_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that batch size x longest (length + EOS) <= max_tokens; longest first, so
    an out-of-memory error shows on the first batch rather than the last."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return pack_by_size(order, [n + 1 for n in lengths], max_tokens)


def source_batches(
    src_ids: Sequence[Sequence[int]], max_positions: int, max_tokens: int, workers: int = 1, rows: int = 1
) -> list[list[int]]:
    """Indices of the non-empty sources (empty ones are never searched) in length batches, as both engines
    take them: of max_tokens / workers source tokens each, so that with `workers` searches side by side the
    tokens in flight stay max_tokens; `rows`: rows each source becomes in the search (its samples), which the
    batch's tokens count (a source alone may still be more)."""
    todo = [i for i, ids in enumerate(src_ids) if len(ids) > 0]
    lengths = [min(len(src_ids[i]), source_limit(max_positions)) for i in todo]
    return [[todo[j] for j in batch] for batch in length_batches(lengths, max(1, max_tokens // (workers * rows)))]


@dataclass(frozen=True)
class Batches:
    """An epoch's batches without Python lists: batch i holds pair indices order[starts[i]:ends[i]]."""

    order: np.ndarray  # (N,) pair indices, length-sorted
    starts: np.ndarray  # (n_batches,)
    ends: np.ndarray  # (n_batches,)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.order[self.starts[i] : self.ends[i]]

    def take(self, n: int) -> Batches:
        """The first n batches."""
        return Batches(self.order, self.starts[:n], self.ends[:n])


def _length_sorted(size: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """Pair indices sorted by padded size, then source and target length; `tie` (a permutation) breaks ties."""
    if max(int(size.max()), int(src_len.max()), int(tgt_len.max())) < 1 << 11:
        # One int64 key and a stable sort: faster than lexsort on millions of pairs.
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
            if open_count + taken < cap:  # the whole run fits and the batch stays open
                open_count += taken
                continue
            starts.append(np.array([open_start]))
            a += taken
        if a == b:
            open_count = 0
            continue
        batch_starts = np.arange(a, b, cap)  # the rest of the run in batches of cap pairs
        starts.append(batch_starts[:-1])
        open_start, open_count = int(batch_starts[-1]), b - int(batch_starts[-1])  # the last may take more
    if open_count:
        starts.append(np.array([open_start]))
    return np.concatenate(starts).astype(np.int64)


def make_batches(
    src_len: np.ndarray,
    tgt_len: np.ndarray,
    max_tokens: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    pad_to_multiple: int = 1,
) -> Batches:
    """Batches of at most max_tokens padded tokens (batch size x the longest side + EOS, rounded up to
    pad_to_multiple), bucketed by length; a pure function of (lengths, seed, epoch).

    Pairs are sorted by that padded size (then source and target length, ties broken at random), and the
    order is cut greedily: vectorised, with no Python step per pair, so that an epoch of millions of pairs is
    batched in a moment."""
    n = len(src_len)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Batches(empty, empty, empty)
    src_len, tgt_len = np.asarray(src_len), np.asarray(tgt_len)
    size = round_up(np.maximum(src_len, tgt_len).astype(np.int64) + 1, pad_to_multiple)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    tie = rng.permutation(n) if shuffle else np.arange(n)
    # The order lives for a whole epoch: int32 halves it (4.5M pairs: 18 MB instead of 36) where it fits.
    order = _length_sorted(size, src_len, tgt_len, tie).astype(np.int32 if n < 1 << 31 else np.int64)
    starts = _cut(size[order], max_tokens)
    ends = np.r_[starts[1:], n]
    if shuffle:
        perm = rng.permutation(len(starts))
        starts, ends = starts[perm], ends[perm]
    return Batches(order, starts, ends)


def eval_batches(corpus, max_tokens: int, pad_to_multiple: int = 1, specials: Specials = OURS) -> list[Batch]:
    """Fixed, unshuffled batches of a (small) corpus, for validation (`specials`: the vocabulary's ids)."""
    batches = make_batches(
        corpus.src_lengths, corpus.tgt_lengths, max_tokens, 0, 0, shuffle=False, pad_to_multiple=pad_to_multiple
    )
    return [Batch.from_corpus(corpus, batches[i], pad_to_multiple, specials) for i in range(len(batches))]


# --------------------------------------------------------------------------- the training stream


@dataclass
class Update:
    """What one optimizer update consumes on this rank, and where the stream stands after it."""

    batches: list[Batch]  # this rank's update_freq batches
    n_tgt_tokens: int  # target tokens of the whole update, all ranks (normalises the loss)
    n_src_tokens: int
    data_state: dict  # the stream position after this update: what a checkpoint saves
    epochs_done: int


class BatchStream:
    """Endless stream of training Batches over an encoded corpus, or a mixture of several (mixture.py), epoch after
    epoch, resumable at (epoch, position).

    An update consumes a group of world_size x update_freq consecutive batches of the epoch's
    order; rank r takes group[r::world_size]. So 1 process with update_freq 8 and 8 processes
    with update_freq 1 see the same batches per update, and every rank knows the token count
    of the whole group without communicating. `position` counts this rank's batches, which is
    the same number on every rank.
    """

    def __init__(
        self,
        corpus,
        cfg: DataConfig,
        seed: int,
        epoch: int = 0,
        batches_done: int = 0,
        rank: int = 0,
        world_size: int = 1,
        update_freq: int = 1,
        specials: Specials = OURS,
    ):
        """corpus: a Corpus (every pair once an epoch) or a Mixture. batches_done: batches of the epoch already
        consumed by all ranks together (what state() saves), so that a run may resume with another number of ranks
        or another update_freq. specials: the vocabulary's ids (ours unless given)."""
        if batches_done % (world_size * update_freq):
            raise UserError(
                f"data: cannot resume after {batches_done} batches of an epoch with updates of "
                f"{world_size} ranks x update_freq {update_freq}"
            )
        self.mixture = corpus if isinstance(corpus, Mixture) else Mixture.of(corpus)
        self.cfg, self.seed, self.specials = cfg, seed, specials
        self.src_len, self.tgt_len = self.mixture.src_lengths, self.mixture.tgt_lengths
        self.rank, self.world_size, self.update_freq = rank, world_size, update_freq
        self.epoch, self.position = epoch, batches_done // world_size  # position: this rank's next batch
        self._batches = self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> Batches:
        drawn = self.mixture.drawn(self.seed, epoch)  # None: every pair once
        src_len, tgt_len = (self.src_len, self.tgt_len) if drawn is None else (self.src_len[drawn], self.tgt_len[drawn])
        batches = make_batches(
            src_len, tgt_len, self.cfg.max_tokens, self.seed, epoch, pad_to_multiple=self.cfg.pad_to_multiple
        )
        if drawn is not None:  # positions in the drawn list -> mixture indices
            batches = Batches(drawn[batches.order], batches.starts, batches.ends)
        group = self.world_size * self.update_freq
        if len(batches) < group:
            raise UserError(
                f"data: {len(batches)} batches per epoch cannot fill one update of "
                f"{self.world_size} ranks x {self.cfg.max_tokens} tokens x update_freq {self.update_freq}"
            )
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
        return self.mixture.batch(indices, self.cfg.pad_to_multiple, self.specials)

    def next_update(self) -> Update:
        """This rank's update_freq batches, and the token counts of the whole update across all ranks."""
        if self.position % self.update_freq != 0:
            raise RuntimeError("next_update() called in the middle of an update")
        self._roll_epoch()
        group_start = self._global_index(self.position) - self.rank
        group = np.concatenate(
            [self._batches[i] for i in range(group_start, group_start + self.world_size * self.update_freq)]
        )
        n_tgt = int(self.tgt_len[group].sum()) + len(group)  # + EOS per sentence
        n_src = int(self.src_len[group].sum()) + len(group)
        batches = [next(self) for _ in range(self.update_freq)]
        return Update(batches, n_tgt, n_src, self.state(), self.epochs_done)

    def state(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.position * self.world_size}


class Prefetcher:
    """Builds the next updates in a background thread while the current one computes, so the training loop
    waits for data only when the host falls behind; `wait_seconds` says how long it waited in total."""

    def __init__(
        self, stream: BatchStream, pin_memory: bool = False, depth: int = 2, device: torch.device | None = None
    ):
        """pin_memory: pin each batch for an asynchronous copy to `device` (CUDA), in the thread."""
        self.epochs_done = stream.epochs_done  # of the last update handed out (the stream itself runs ahead)
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # The GPU as an index, resolved here: the current CUDA device is per thread (the new thread's is GPU 0,
        # not this rank's), and set_device refuses a torch.device("cuda") without one.
        gpu = cuda_index(device) if pin_memory and device is not None and device.type == "cuda" else None
        self._thread = threading.Thread(
            target=self._work, args=(stream, pin_memory, gpu), daemon=True, name="batch-prefetch"
        )
        self._thread.start()

    def _work(self, stream: BatchStream, pin_memory: bool, gpu: int | None) -> None:
        try:
            if gpu is not None:  # pinned memory is allocated for, and its copies ordered on, the current device
                torch.cuda.set_device(gpu)
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
