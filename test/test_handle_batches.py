"""RequestHandle.next_batch / batches: every pending event in one wake-up, order kept, errors after events."""

import asyncio
import threading

import pytest

from server.engine.handle import Deliveries, RequestHandle
from server.engine.types import EngineDeadError, Event, Result


class _Eng:
    def __init__(self):
        self._thread, self._stopping, self._dead = threading.current_thread(), False, None

    def _gone(self):
        return False


def _ev(i, finished=False):
    return Event(text=f"t{i}", token_ids=[i], n_tokens=i + 1, finished=finished,
                 finish_reason="length" if finished else None)


def _res():
    return Result(request_id="r", text="", token_ids=[], prompt_tokens=1, completion_tokens=3,
                  finish_reason="length", prefill_time=0, gen_time=0)


def test_batches_take_all_pending_events_in_order():
    async def main():
        h = RequestHandle(_Eng(), "r", asyncio.get_running_loop())
        got = []

        async def consume():
            async for batch in h.batches():
                got.append([e.n_tokens for e in batch])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        d = Deliveries()
        d.add(h, _ev(0))
        d.deliver()
        await asyncio.sleep(0.01)
        for i in (1, 2):  # two steps before the consumer runs: one batch
            d.add(h, _ev(i, finished=i == 2), _res() if i == 2 else None)
            d.deliver()
        await asyncio.wait_for(task, 2)
        assert got == [[1], [2, 3]]
        assert [e.n_tokens async for e in h] == []  # drained
        assert (await h.wait()).completion_tokens == 3

    asyncio.run(main())


def test_error_comes_after_the_pending_events():
    async def main():
        h = RequestHandle(_Eng(), "r", asyncio.get_running_loop())
        h._push(_ev(0))
        h._fail(EngineDeadError("gone"))
        assert [e.n_tokens for e in await h.next_batch()] == [1]
        with pytest.raises(EngineDeadError):
            await h.next_batch()

    asyncio.run(main())
