"""RequestHandle: a submitted request seen from the caller (sync and async iteration, results).

The engine thread pushes each step's events under the handle's lock (threads blocked in sync
iteration are notified), then wakes asyncio consumers with ONE `call_soon_threadsafe` per event
loop per step for all the handles of that loop (`wake_handles`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import TYPE_CHECKING, AsyncIterator, Iterator

from .types import EngineDeadError, Event, Result

if TYPE_CHECKING:
    from .engine import Engine

_POLL_S = 1.0  # how often a blocked caller re-checks that the engine loop is alive


class RequestHandle:
    def __init__(self, engine: "Engine", request_id: str, loop: asyncio.AbstractEventLoop | None):
        self.request_id = request_id
        self._engine = engine
        self._cond = threading.Condition()
        self._events: deque[Event] = deque()
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._loop = loop
        self._aevent = asyncio.Event()

    # --- engine side (engine thread) --------------------------------------------------------
    def _push(self, events: list[Event], result: Result | None = None) -> asyncio.AbstractEventLoop | None:
        """Add events (and the result); return the event loop to wake, if any."""
        with self._cond:
            self._events.extend(events)
            if result is not None:
                self._result = result
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

    def _check_engine(self) -> None:
        if not self.done and self._engine._gone():
            self._error = self._error or EngineDeadError("the engine loop is not running")

    def __iter__(self) -> Iterator[Event]:
        while True:
            with self._cond:
                while not self._events and not self.done:
                    if not self._cond.wait(_POLL_S):
                        self._check_engine()
                if self._events:
                    ev = self._events.popleft()
                elif self._error is not None:
                    raise self._error
                else:
                    return
            yield ev

    def result(self, timeout: float | None = None) -> Result:
        """Block until the request finished; its Result (raises EngineDeadError if the loop died)."""
        with self._cond:
            waited = 0.0
            while not self.done:
                step = _POLL_S if timeout is None else min(_POLL_S, timeout - waited)
                if step <= 0:
                    raise TimeoutError(f"request {self.request_id} not finished after {timeout}s")
                if not self._cond.wait(step):
                    self._check_engine()
                waited += step
            if self._error is not None:
                raise self._error
            assert self._result is not None
            return self._result

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._loop is None:
                self._loop = loop
            elif self._loop is not loop:
                raise RuntimeError("a RequestHandle is consumed from one event loop only")

    async def _wait_async(self) -> None:
        try:
            await asyncio.wait_for(self._aevent.wait(), _POLL_S)
        except asyncio.TimeoutError:
            self._check_engine()

    async def __aiter__(self) -> AsyncIterator[Event]:
        self._bind_loop()
        while True:
            self._aevent.clear()
            with self._cond:
                batch = list(self._events)
                self._events.clear()
                done, error = self.done, self._error
            for ev in batch:
                yield ev
            if not batch:
                if error is not None:
                    raise error
                if done:
                    return
                await self._wait_async()

    async def wait(self) -> Result:
        """Await the Result (raises EngineDeadError if the loop died)."""
        self._bind_loop()
        while not self.done:
            self._aevent.clear()
            if self.done:
                break
            await self._wait_async()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def abort(self) -> bool:
        return self._engine.abort(self.request_id)

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, done={self.done})"


def wake_handles(handles: list[RequestHandle]) -> None:
    """Runs in an event loop (one call per step): wake that loop's consumers."""
    for h in handles:
        h._aevent.set()


class Deliveries:
    """One step's events and results, pushed per handle, then one wake-up per event loop."""

    def __init__(self):
        self.items: dict[RequestHandle, tuple[list[Event], list[Result]]] = {}

    def add(self, handle: RequestHandle, ev: Event, result: Result | None = None) -> None:
        evs, res = self.items.setdefault(handle, ([], []))
        evs.append(ev)
        if result is not None:
            res.append(result)

    def deliver(self) -> None:
        loops: dict = {}
        for h, (evs, res) in self.items.items():
            loop = h._push(evs, res[0] if res else None)
            if loop is not None:
                loops.setdefault(loop, []).append(h)
        self.items = {}
        wake_loops(loops)


def wake_loops(loops: dict) -> None:
    for loop, handles in loops.items():
        try:
            loop.call_soon_threadsafe(wake_handles, handles)
        except RuntimeError:  # that event loop is closed: nobody is waiting there
            pass
