"""Request batching for `transformer serve`: requests that arrive within a window share one search."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformer.translate import Translator


@dataclass
class _Job:
    ids: list[list[int]]              # the sources, encoded once by the request's handler
    beam: int
    nbest: int
    done: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return sum(len(ids) + 1 for ids in self.ids)  # source tokens with EOS: what decode.max_tokens bounds


class Batcher:
    """/translate requests that arrive within the window go to the model worker as one call (bounded by
    decode.max_tokens); requests that arrive while it works wait and form the next batch."""

    def __init__(self, translator: Translator, worker: ThreadPoolExecutor, window_s: float):
        self.translator, self.worker, self.window = translator, worker, window_s
        self.pending: list[_Job] = []
        self.arrived = asyncio.Event()
        self.stats = {"requests": 0, "sentences": 0, "batches": 0, "largest_batch": 0}

    def pending_sentences(self) -> int:
        return sum(len(job.ids) for job in self.pending)

    async def translate(self, ids: list[list[int]], beam: int, nbest: int) -> list:
        """Per source (subword ids), its n-best (score, translation) pairs, searched with whatever arrives
        within the window."""
        job = _Job(ids, beam, nbest, asyncio.get_running_loop().create_future())
        self.pending.append(job)
        self.arrived.set()
        return await job.done

    async def run(self) -> None:
        while True:
            jobs = await self._collect()
            groups: dict[tuple[int, int], list[_Job]] = {}
            for job in jobs:  # one search per setting: a batched search runs one beam size
                groups.setdefault((job.beam, job.nbest), []).append(job)
            for (beam, nbest), group in groups.items():
                ids = [source for job in group for source in job.ids]
                try:
                    found = await asyncio.get_running_loop().run_in_executor(
                        self.worker, self._translate, ids, beam, nbest)
                except Exception as e:  # the requests fail; the service goes on
                    for job in group:
                        if not job.done.done():  # done already: its client went away
                            job.done.set_exception(e)
                    continue
                self.stats["batches"] += 1
                self.stats["largest_batch"] = max(self.stats["largest_batch"], len(ids))
                for job in group:
                    if not job.done.done():
                        job.done.set_result(found[:len(job.ids)])
                    found = found[len(job.ids):]

    async def _collect(self) -> list[_Job]:
        """Wait for a request, then until its window closes or the waiting sources fill decode.max_tokens."""
        while not self.pending:
            self.arrived.clear()
            await self.arrived.wait()
        deadline = self.pending[0].arrived + self.window
        while sum(job.tokens for job in self.pending) < self.translator.max_tokens:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        taken, tokens = 0, 0
        while taken < len(self.pending) and (taken == 0 or tokens + self.pending[taken].tokens
                                             <= self.translator.max_tokens):
            tokens += self.pending[taken].tokens
            taken += 1
        jobs, self.pending = self.pending[:taken], self.pending[taken:]
        return jobs

    def _translate(self, ids: list[list[int]], beam: int, nbest: int) -> list:
        self.translator.beam = beam  # this worker thread is the translator's only user
        return self.translator.texts(self.translator.search(ids, nbest))

    def fail_pending(self, error: Exception) -> None:
        """Answer every waiting request with `error` (the server is shutting down)."""
        for job in self.pending:
            if not job.done.done():
                job.done.set_exception(error)
        self.pending = []
