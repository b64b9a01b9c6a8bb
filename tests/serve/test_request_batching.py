"""serve's request batcher on a stub translator: token budgets count EOS, and a failed search leaves the
service answering."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from transformer.inference.settings import SearchSettings
from transformer.inference.translator import Translation
from transformer.serve.request_batching import Batcher, _Job

GREEDY = SearchSettings(beam=1)


class StubTranslator:
    """Translates a source to its length; the first search fails when asked to."""

    def __init__(self, max_tokens: int = 64, fail_first: bool = False):
        self.settings, self.fail_first, self.searches = SearchSettings(beam=1, max_tokens=max_tokens), fail_first, []

    def search(self, ids, settings, options=None, unmet=None):
        self.searches.append([len(s) for s in ids])
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("out of memory")
        return [[len(s)] for s in ids]

    def translations(self, ids, found, unmet=()):
        return [[Translation(0.0, str(n)) for n in hyps] for hyps in found]


def test_a_jobs_tokens_count_eos_like_decode_max_tokens():
    loop = asyncio.new_event_loop()
    try:
        assert _Job([[5, 6, 7], [8]], GREEDY, loop.create_future()).tokens == 6  # 3 + EOS, 1 + EOS
    finally:
        loop.close()


def test_requests_beyond_max_tokens_wait_for_the_next_batch():
    async def scenario():
        translator = StubTranslator(max_tokens=7)  # two 3-token sources with EOS make 8
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher(translator, worker, window_s=0.05)
            task = asyncio.create_task(batcher.run())
            results = await asyncio.gather(
                batcher.translate([[1, 2, 3]], GREEDY), batcher.translate([[4, 5, 6]], GREEDY)
            )
            task.cancel()
        return translator.searches, results

    searches, results = asyncio.run(scenario())
    assert searches == [[3], [3]] and results == [[[Translation(0.0, "3")]], [[Translation(0.0, "3")]]]


@pytest.mark.parametrize("others", [True, False])
def test_the_window_is_waited_only_while_another_connection_is_open(others):
    """Two requests 50 ms apart within a 300 ms window share a search while other connections are open; on the
    only open connection the first has nobody to wait for and goes at once, alone."""

    async def scenario():
        translator = StubTranslator()
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher(translator, worker, window_s=0.3, others_connected=lambda: others)
            task = asyncio.create_task(batcher.run())
            first = asyncio.create_task(batcher.translate([[1, 2]], GREEDY))
            await asyncio.sleep(0.05)
            await asyncio.gather(first, batcher.translate([[3]], GREEDY))
            task.cancel()
        return translator.searches

    assert asyncio.run(scenario()) == ([[2, 1]] if others else [[2], [1]])


def test_a_failed_search_while_a_client_has_gone_leaves_the_service_answering():
    """Two requests share a search that fails after one of their clients went away: the other gets the error,
    and the batcher goes on (setting an exception on the cancelled request's future would have stopped it)."""

    async def scenario():
        translator = StubTranslator(fail_first=True)
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher(translator, worker, window_s=0.2)
            runner = asyncio.create_task(batcher.run())
            gone = asyncio.create_task(batcher.translate([[1, 2]], GREEDY))
            stays = asyncio.create_task(batcher.translate([[3]], GREEDY))
            await asyncio.sleep(0.05)
            gone.cancel()  # the client disconnects inside the window
            with pytest.raises(RuntimeError, match="out of memory"):
                await asyncio.wait_for(stays, timeout=5)
            later = await asyncio.wait_for(batcher.translate([[4, 5, 6]], GREEDY), timeout=5)
            alive = not runner.done()
            runner.cancel()
        return later, alive

    later, alive = asyncio.run(scenario())
    assert later == [[Translation(0.0, "3")]] and alive


def test_freed_memory_is_given_back_when_the_worker_goes_idle(monkeypatch):
    """Searches of ever new batch shapes left malloc's arenas at their high-water mark (the server's memory grew
    with every peak); the batcher trims once it runs out of work, and not while nothing has run."""
    import transformer.serve.request_batching as batcher_module

    trims = []
    monkeypatch.setattr(batcher_module, "release_freed_memory", lambda: trims.append(1))

    async def scenario():
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher(StubTranslator(), worker, window_s=0.0)
            runner = asyncio.create_task(batcher.run())
            await asyncio.sleep(0.05)
            idle_before = len(trims)
            await batcher.translate([[1, 2]], GREEDY)
            await batcher.inspect(lambda: None)
            await asyncio.sleep(0.05)
            runner.cancel()
        return idle_before, len(trims)

    idle_before, after = asyncio.run(scenario())
    assert idle_before == 0 and after >= 1
