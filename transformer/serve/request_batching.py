"""The model worker's schedule for `transformer serve`: /translate requests that arrive within a window share one
search, and the page's requests (attention, beam traces, positional tables) take turns with those searches."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from transformer.inference.batched import SentenceOptions
from transformer.inference.settings import SearchSettings
from transformer.inference.translator import Translation, Translator


@dataclass
class _Job:
    ids: list[list[int]]  # the sources, encoded once by the request's handler
    settings: SearchSettings  # the request's: the server's with its beam, n-best, sampling, alignments
    done: asyncio.Future
    options: list[SentenceOptions] | None = None  # per source: its prefix and constraints
    arrived: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return sum(len(ids) + 1 for ids in self.ids)  # source tokens with EOS: what decode.max_tokens bounds


@dataclass
class _Inspection:
    compute: Callable[[], Any]  # runs on the model worker; its result answers the request
    done: asyncio.Future


def _malloc_trim():
    """glibc's malloc_trim(0), or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Give the pages malloc holds free back to the system. Searches of ever new batch shapes leave each
    allocator arena at its high-water mark, so a server's resident memory climbed with every peak and never came
    down; after a trim it is what is in use."""
    if _TRIM is not None and os.environ.get("TRANSFORMER_NO_TRIM") != "1":
        _TRIM(0)


def _waiting(jobs):
    """The jobs whose request still waits: a cancelled future is a client that went away."""
    return [job for job in jobs if not job.done.done()]


class Batcher:
    """Everything that runs the model goes through here, onto its one worker thread:

    - /translate requests that arrive within the window go to the worker as one call (bounded by
      decode.max_tokens); requests that arrive while it works wait and form the next batch. The window is
      waited only while another connection is open (`others_connected`): a request on the only one has nobody
      to wait for (a client of its own, one request at a time) and goes at once;
    - inspections (/attention, /beam, /positions) run one at a time, taking turns with translation batches,
      so that a translation waits for at most one of them (each is bounded by the server's settings);
    - a request whose client went away (its future cancelled) is dropped before it runs.
    """

    def __init__(
        self,
        translator: Translator,
        worker: ThreadPoolExecutor,
        window_s: float,
        others_connected: Callable[[], bool] = lambda: True,
    ):
        self.translator, self.worker, self.window = translator, worker, window_s
        self.others_connected = others_connected
        self.pending: list[_Job] = []
        self.inspections: deque[_Inspection] = deque()
        self.running: list[asyncio.Future] = []  # the futures of what the worker computes now
        self.arrived = asyncio.Event()
        self.stats = {"requests": 0, "sentences": 0, "batches": 0, "largest_batch": 0}
        self.trimmed, self.used = 0.0, False  # when freed memory was last given back; whether work ran since

    def pending_sentences(self) -> int:
        """What waits for the model: sentences to translate, and inspections (one each)."""
        return sum(len(job.ids) for job in _waiting(self.pending)) + len(_waiting(self.inspections))

    async def translate(
        self, ids: list[list[int]], settings: SearchSettings, options: list[SentenceOptions] | None = None
    ) -> list[list[Translation]]:
        """Per source (subword ids), its n-best Translations, searched with whatever arrives within the window and
        asks for the same settings (`options`: per source, what it asks beyond them)."""
        job = _Job(ids, settings, asyncio.get_running_loop().create_future(), options)
        self.pending.append(job)
        self.arrived.set()
        return await job.done

    async def inspect(self, compute: Callable[[], Any]) -> Any:
        """compute() on the model worker, in its turn."""
        job = _Inspection(compute, asyncio.get_running_loop().create_future())
        self.inspections.append(job)
        self.arrived.set()
        return await job.done

    async def run(self) -> None:
        inspect_next = False
        while True:
            await self._wait_for_work()
            if self.inspections and (inspect_next or not self.pending):
                await self._inspect(self.inspections.popleft())
                inspect_next = False
                continue
            jobs = await self._collect()
            groups: dict[SearchSettings, list[_Job]] = {}
            for job in jobs:  # one search per setting: a batched search runs one beam size, one sampling rule
                groups.setdefault(job.settings, []).append(job)
            for settings, group in groups.items():
                await self._search(_waiting(group), settings)  # a client may leave during another search
            inspect_next = bool(jobs)

    async def _wait_for_work(self) -> None:
        while True:
            self.pending = _waiting(self.pending)
            while self.inspections and self.inspections[0].done.done():
                self.inspections.popleft()
            busy = bool(self.pending or self.inspections)
            if self.used and (not busy or time.monotonic() - self.trimmed > 1.0):  # idle, or once a second
                self.used, self.trimmed = False, time.monotonic()
                self.worker.submit(release_freed_memory)  # on the worker, before its next job
            if busy:
                return
            self.arrived.clear()
            await self.arrived.wait()

    async def _on_worker(self, futures: list[asyncio.Future], fn, *args):
        self.running, self.used = futures, True
        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)
        finally:
            self.running = []

    async def _inspect(self, job: _Inspection) -> None:
        if job.done.done():
            return
        try:
            result = await self._on_worker([job.done], job.compute)
        except Exception as e:
            if not job.done.done():
                job.done.set_exception(e)
            return
        if not job.done.done():  # done already: its client went away, or the server stopped waiting
            job.done.set_result(result)

    async def _search(self, group: list[_Job], settings: SearchSettings) -> None:
        if not group:
            return
        ids = [source for job in group for source in job.ids]
        options = None
        if any(job.options for job in group):
            options = [o for job in group for o in (job.options or [SentenceOptions()] * len(job.ids))]
        try:
            found = await self._on_worker([job.done for job in group], self._translate, ids, settings, options)
        except Exception as e:  # the requests fail; the service goes on
            for job in group:
                if not job.done.done():
                    job.done.set_exception(e)
            return
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(ids))
        for job in group:
            if not job.done.done():
                job.done.set_result(found[: len(job.ids)])
            found = found[len(job.ids) :]

    async def _collect(self) -> list[_Job]:
        """Wait until the first request's window closes or the waiting sources fill decode.max_tokens; take
        what fits. No window while no other connection is open."""
        deadline = self.pending[0].arrived + (self.window if self.others_connected() else 0.0)
        while sum(job.tokens for job in self.pending) < self.translator.settings.max_tokens:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        self.pending = _waiting(self.pending)
        taken, tokens = 0, 0
        while taken < len(self.pending) and (
            taken == 0 or tokens + self.pending[taken].tokens <= self.translator.settings.max_tokens
        ):
            tokens += self.pending[taken].tokens
            taken += 1
        jobs, self.pending = self.pending[:taken], self.pending[taken:]
        return jobs

    def _translate(
        self, ids: list[list[int]], settings: SearchSettings, options: list[SentenceOptions] | None
    ) -> list[list[Translation]]:
        unmet: list[int] = []
        found = self.translator.search(ids, settings, options, unmet)
        return self.translator.translations(ids, found, unmet)

    def fail_all(self, error: Exception) -> None:
        """Answer every request still waiting, and those the worker computes now, with `error` (the server is
        stopping); what the worker computes is thrown away when it ends."""
        for future in [job.done for job in self.pending] + [job.done for job in self.inspections] + self.running:
            if not future.done():
                future.set_exception(error)
        self.pending, self.inspections = [], deque()
