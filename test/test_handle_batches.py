"""RequestHandle.next_batch / batches: every pending event in one wake-up, order kept, errors after events."""

import asyncio

import pytest

from server.engine.handle import Deliveries, RequestHandle, fail_handles
from server.engine.types import EngineDeadError, Event, Result


def _handle(loop) -> RequestHandle:
    return RequestHandle("r", loop, alive=lambda: True, abort=lambda rid: False)


def _ev(i, finished=False):
    return Event(text=f"t{i}", token_ids=[i], n_tokens=i + 1, finished=finished,
                 finish_reason="length" if finished else None)


def _res():
    return Result(request_id="r", text="", token_ids=[], prompt_tokens=1, completion_tokens=3,
                  finish_reason="length", prefill_time=0, gen_time=0)


def test_batches_take_all_pending_events_in_order():
    async def main():
        h = _handle(asyncio.get_running_loop())
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
        h = _handle(asyncio.get_running_loop())
        h._push(_ev(0))
        h._fail(EngineDeadError("gone"))
        assert [e.n_tokens for e in await h.next_batch()] == [1]
        with pytest.raises(EngineDeadError):
            await h.next_batch()

    asyncio.run(main())


def test_a_listener_replaces_the_loop_wake_up_and_can_hand_back():
    async def main():
        h = _handle(asyncio.get_running_loop())
        calls: list[list[int]] = []

        def listener():  # runs where deliver() runs (the engine thread), drains the events itself
            calls.append([h._events.popleft().n_tokens for _ in range(len(h._events))])

        h.set_listener(listener)
        fut = h._waiter = asyncio.get_running_loop().create_future()  # a consumer would wait on this
        d = Deliveries()
        for i in (0, 1):
            d.add(h, _ev(i))
            d.deliver()
        await asyncio.sleep(0.01)
        assert calls == [[1], [2]] and not fut.done()  # no loop wake-up while listened to
        h.set_listener(None)  # back to the loop: an event pushed now is found by next_batch
        d.add(h, _ev(2, finished=True), _res())
        d.deliver()
        assert [e.n_tokens for e in await asyncio.wait_for(h.next_batch(), 2)] == [3]
        assert calls == [[1], [2]]

    asyncio.run(main())


def test_a_failing_listener_is_dropped_and_the_consumer_woken():
    async def main():
        h = _handle(asyncio.get_running_loop())
        h.set_listener(lambda: 1 / 0)
        waiter = asyncio.create_task(h.next_batch())
        await asyncio.sleep(0)
        d = Deliveries()
        d.add(h, _ev(0))
        d.deliver()  # logged, not raised: the engine loop goes on
        assert h._listener is None
        assert [e.n_tokens for e in await asyncio.wait_for(waiter, 2)] == [1]

    asyncio.run(main())


def test_engine_failure_reaches_the_listener():
    async def main():
        h = _handle(asyncio.get_running_loop())
        seen = []
        h.set_listener(lambda: seen.append(type(h._error).__name__))
        fail_handles([h], EngineDeadError("the engine loop died"))
        assert seen == ["EngineDeadError"]

    asyncio.run(main())
