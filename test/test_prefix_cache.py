"""The chat-prefix cache over the task layer's StateCache: concurrent first requests share one
prefill, later ones hit the cache, a state larger than the whole budget is used once and not
kept, a failed prefill reaches every waiter and is not cached."""

from __future__ import annotations

import asyncio

import pytest

from server.api.openai.prefix_cache import PrefixCache
from server.engine.types import RequestFailedError, Result


class _State:
    def __init__(self, nbytes: int) -> None:
        self._n = nbytes

    def nbytes(self) -> int:
        return self._n


class _Handle:
    def __init__(self, eng: _Engine, rid: str) -> None:
        self.eng, self.request_id = eng, rid
        self.admitted = True

    async def wait(self) -> Result:
        await self.eng.release.wait()
        if self.eng.fail:
            return Result(self.request_id, "", [], 3, 0, "error", error="boom")
        return Result(self.request_id, "", [], 3, 0, "length", state=_State(self.eng.nbytes))

    def abort(self) -> bool:
        return True


class _Engine:
    def __init__(self, nbytes: int = 100, fail: bool = False) -> None:
        self.nbytes, self.fail, self.submits = nbytes, fail, 0
        self.release = asyncio.Event()

    def submit(self, tokens, params, **kw) -> _Handle:
        assert params.max_tokens == 0 and kw["return_state"]
        self.submits += 1
        return _Handle(self, kw["request_id"])


async def test_one_prefill_for_concurrent_requests_then_hits():
    cache, eng = PrefixCache(1000), _Engine()
    waiters = [asyncio.create_task(cache.get(eng, [1, 2, 3], "System: x\n\n")) for _ in range(5)]
    await asyncio.sleep(0.01)
    eng.release.set()
    states = await asyncio.gather(*waiters)
    assert eng.submits == 1 and all(s is states[0] for s in states)
    assert await cache.get(eng, [1, 2, 3], "System: x\n\n") is states[0] and eng.submits == 1
    st = cache.stats()
    assert st["misses"] == 1 and st["hits"] == 5 and st["entries"] == 1 and st["bytes"] == 100


async def test_a_state_over_the_budget_is_used_but_not_kept():
    cache, eng = PrefixCache(50), _Engine(nbytes=100)
    eng.release.set()
    assert (await cache.get(eng, [1], "a")).nbytes() == 100
    await cache.get(eng, [1], "a")
    assert eng.submits == 2 and cache.stats()["entries"] == 0


async def test_a_failed_prefill_reaches_every_waiter_and_is_not_cached():
    cache, eng = PrefixCache(1000), _Engine(fail=True)
    waiters = [asyncio.create_task(cache.get(eng, [1], "p")) for _ in range(3)]
    await asyncio.sleep(0.01)
    eng.release.set()
    for r in await asyncio.gather(*waiters, return_exceptions=True):
        assert isinstance(r, RequestFailedError) and "boom" in str(r)
    eng.fail = False
    await cache.get(eng, [1], "p")
    assert eng.submits == 2 and cache.stats()["entries"] == 1


async def test_a_requester_that_leaves_does_not_cancel_the_shared_prefill():
    cache, eng = PrefixCache(1000), _Engine()
    first = asyncio.create_task(cache.get(eng, [1], "p"))
    second = asyncio.create_task(cache.get(eng, [1], "p"))
    await asyncio.sleep(0.01)
    first.cancel()
    eng.release.set()
    assert (await second).nbytes() == 100
    with pytest.raises(asyncio.CancelledError):
        await first
    assert eng.submits == 1
