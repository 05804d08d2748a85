"""RequestHandle: a submitted request seen from the caller (sync and async iteration, results).

The engine thread pushes each step's events under the handle's lock (threads blocked in sync
iteration are notified), then wakes asyncio consumers with ONE `call_soon_threadsafe` per event
loop per step for all the handles of that loop (`wake_handles`). An asyncio consumer can take
all the events pending at a wake-up at once (`await h.next_batch()`, `async for batch in
h.batches()`): a consumer that fell behind catches up in one pass (one write per stream).
A handle can instead have a listener (`set_listener`): a callable run ON THE ENGINE THREAD right
after each delivery to the handle (and when it fails), in place of the event-loop wake-up; it
takes the events itself (`take_ready`; server.api.streaming.direct writes a stream's bytes from there).

A handle knows nothing of the engine but two callables given at construction: `alive()` (the
engine will still deliver to it: not stopped, not dead; an engine not started yet is alive) and
`abort(request_id)`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from .types import EngineDeadError, Event, Result

log = logging.getLogger("server.engine")

_POLL_S = 1.0  # how often a blocked caller re-checks that the engine loop is alive


class RequestHandle:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None, *, alive: Callable[[], bool],
                 abort: Callable[[str], bool], end_before_state: bool = False):  # fmt: skip
        self.request_id = request_id
        self.admitted = False
        """The engine gave the sequence a slot (set on the engine thread when the step that
        admits it is planned): its prompt is being fed, or it decodes. False: it waits."""
        self.end_before_state = end_before_state
        """The finishing event is delivered at once, the Result when its final state has been
        copied out (else both together)."""
        self._alive = alive
        self._abort = abort
        self._cond = threading.Condition()
        self._events: deque[Event] = deque()
        self._result: Result | None = None
        self._ended = False  # the finishing event was pushed (the result may still wait for its state)
        self._error: BaseException | None = None
        self._loop = loop
        self._bound = False  # _bind_loop() done (next_batch checks once, not per call)
        self._waiter: asyncio.Future | None = None
        """The future an asyncio consumer awaits (set by wake_handles in its loop). A bare future,
        not an asyncio.Event: the wake-up is the per-token cost of a stream. No lost wake-ups:
        the consumer checks for events and creates the future with no await in between, and the
        engine pushes before it schedules the wake-up."""
        self._sync_waiters = 0
        """Threads blocked on _cond (changed under it): the engine notifies only when > 0."""
        self._listener: Callable[[], None] | None = None
        """Run on the engine thread after each delivery instead of waking the loop (set_listener)."""

    # --- engine side (engine thread) --------------------------------------------------------
    def _push(self, ev: Event | None, result: Result | None = None) -> asyncio.AbstractEventLoop | None:
        """Add an event and/or the result (a result that waited for its final state comes after
        the finishing event, alone); return the event loop to wake, if any.
        Lock-free unless a thread waits: deque.append is atomic, and a waiter registers itself
        under _cond BEFORE checking for events, so it either sees them or gets notified."""
        if ev is not None:
            self._events.append(ev)
            self._ended = self._ended or ev.finished
        if result is not None:
            self._result = result
        if self._sync_waiters:
            with self._cond:
                self._cond.notify_all()
        return self._loop

    def _fail(self, exc: BaseException) -> asyncio.AbstractEventLoop | None:
        with self._cond:
            if self._result is None:
                self._error = exc
            self._cond.notify_all()
            return self._loop

    # --- caller side ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    @property
    def ended(self) -> bool:
        """The finishing event was delivered (or the request failed); the Result may still be
        on its way (it waits for the final state's copy to the host)."""
        return self._ended or self.done

    def _check_engine(self) -> None:
        if not self.done and not self._alive():
            self._error = self._error or EngineDeadError("the engine loop is not running")

    def __iter__(self) -> Iterator[Event]:
        while True:
            with self._cond:
                self._sync_waiters += 1  # registered before checking (see _push)
                try:
                    while not self._events and not self.done:
                        if not self._cond.wait(_POLL_S):
                            self._check_engine()
                finally:
                    self._sync_waiters -= 1
                if self._events:
                    ev = self._events.popleft()
                elif self._error is not None:
                    raise self._error
                else:
                    return
            yield ev

    def result(self, timeout: float | None = None) -> Result:
        """Block until the request finished; its Result (raises EngineDeadError if the loop died)."""
        deadline = None if timeout is None else time.monotonic() + timeout  # (a wake-up is no full poll)
        with self._cond:
            self._sync_waiters += 1  # registered before checking (see _push)
            try:
                while not self.done:
                    step = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
                    if step <= 0:
                        raise TimeoutError(f"request {self.request_id} not finished after {timeout}s")
                    if not self._cond.wait(step):
                        self._check_engine()
            finally:
                self._sync_waiters -= 1
            if self._error is not None:
                raise self._error
            assert self._result is not None
            return self._result

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            with self._cond:
                if self._loop is None:
                    self._loop = loop
                elif self._loop is not loop:
                    raise RuntimeError("a RequestHandle is consumed from one event loop only")
        self._bound = True

    async def _wait_async(self) -> None:
        fut = self._waiter
        if fut is None or fut.done():
            fut = self._waiter = self._loop.create_future()  # type: ignore[union-attr]
        if self._alive():
            await fut  # the engine's end (fail_handles at its exit or shutdown) always wakes us
            return
        try:  # stopping or dead: poll, the loop may never wake us
            await asyncio.wait_for(asyncio.shield(fut), _POLL_S)
        except asyncio.TimeoutError:
            self._check_engine()

    def take_ready(self) -> list[Event] | None:
        """What next_batch() returns, without waiting: the events pending now, [] once the
        request has ended and every event was taken, None when nothing is there yet; raises the
        request's error (EngineDeadError) after its last events. Any thread (a listener's too)."""
        done, error = self.done, self._error  # read BEFORE draining: the result follows its events
        events = self._events
        n = len(events)
        if n:
            if n == 1:
                return [events.popleft()]
            return [events.popleft() for _ in range(n)]  # not list()+clear(): the engine appends
        if error is not None:
            raise error
        return [] if done else None

    async def next_batch(self) -> list[Event]:
        """All the events pending now (waiting for at least one); [] once the request has
        ended and every event was taken; raises the request's error (EngineDeadError) after
        its last events. One wake-up of the consumer per call, however many events came."""
        if not self._bound:
            self._bind_loop()
        while True:
            batch = self.take_ready()
            if batch is not None:
                return batch
            await self._wait_async()

    async def batches(self) -> AsyncIterator[list[Event]]:
        """`async for batch in h.batches()`: next_batch() until the request ends."""
        while True:
            batch = await self.next_batch()
            if not batch:
                return
            yield batch

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            batch = await self.next_batch()
            if not batch:
                return
            for ev in batch:
                yield ev

    async def wait(self) -> Result:
        """Await the Result (raises EngineDeadError if the loop died)."""
        self._bind_loop()
        while not self.done:
            await self._wait_async()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def peek_result(self) -> Result | None:
        """The Result once it was delivered (with the finishing event, or after it when the result
        waits for its final state to be copied out), else None. No waiting."""
        return self._result

    def abort(self) -> bool:
        return self._abort(self.request_id)

    def set_listener(self, fn: Callable[[], None] | None) -> None:
        """fn() runs on the engine thread after every delivery of events (or a failure) to this
        handle, instead of the event-loop wake-up; it must not block, and takes the events itself
        (take_ready). None: back to waking the loop (events already pending stay queued: a
        consumer that resumes with next_batch() finds them without a wake-up)."""
        self._listener = fn

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, done={self.done})"


def wake_handles(handles: list[RequestHandle]) -> None:
    """Runs in an event loop (one call per step): wake that loop's consumers."""
    for h in handles:
        fut = h._waiter
        if fut is not None:
            h._waiter = None
            if not fut.done():
                fut.set_result(None)


class Deliveries:
    """One step's events and results, pushed in order, then one wake-up per event loop."""

    def __init__(self):
        self.items: list[tuple[RequestHandle, Event | None, Result | None]] = []

    def add(self, handle: RequestHandle, ev: Event | None, result: Result | None = None) -> None:
        self.items.append((handle, ev, result))

    def deliver(self) -> None:
        loops: dict = {}
        listened: dict[RequestHandle, Callable[[], None]] = {}
        last_loop: asyncio.AbstractEventLoop | None = None
        last_list: list[RequestHandle] = []
        for h, ev, res in self.items:
            loop = h._push(ev, res)
            fn = h._listener
            if fn is not None:
                listened[h] = fn
                continue
            if loop is None:
                continue
            if loop is not last_loop:
                last_loop, last_list = loop, loops.setdefault(loop, [])
            last_list.append(h)
        self.items = []
        call_listeners(listened)
        wake_loops(loops)


def fail_handles(handles: list[RequestHandle], exc: BaseException) -> None:
    """End these handles with exc (the engine died or was shut down) and wake their consumers."""
    loops: dict = {}
    listened: dict = {}
    for h in handles:
        loop = h._fail(exc)
        fn = h._listener
        if fn is not None:
            listened[h] = fn
        elif loop is not None:
            loops.setdefault(loop, []).append(h)
    call_listeners(listened)
    wake_loops(loops)


def call_listeners(listened: dict) -> None:
    """Run the handles' listeners (engine thread); one that raises is logged and dropped, its
    handle goes back to loop wake-ups (and is woken now)."""
    for h, fn in listened.items():
        try:
            fn()
        except Exception:
            log.exception("event listener of %s failed; back to event-loop delivery", h.request_id)
            h._listener = None
            if h._loop is not None:
                wake_loops({h._loop: [h]})


def wake_loops(loops: dict) -> None:
    for loop, handles in loops.items():
        try:
            loop.call_soon_threadsafe(wake_handles, handles)
        except RuntimeError:  # that event loop is closed: nobody is waiting there
            pass
