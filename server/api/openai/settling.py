"""A request tracked by the conversation cache, from its submission until its states are kept.

The engine does not wake the event loop for a handle that has a listener (direct streams), so
the end of generation is polled (POLL_FIRST_S growing to POLL_MAX_S), and a lookup that finds a
finished request kicks its settle at once; a repair waits here for a slot and an idle engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

from server.engine.protocol import EngineAPI, Handle

REPAIR_IDLE_S = 10.0
POLL_FIRST_S, POLL_MAX_S = 0.02, 0.5


@dataclass(eq=False)
class Settling:
    """A tracked request: its token stream and handles, until its entries are kept."""

    tokens: list[int]
    handles: list[Handle]
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    awaited: bool = False
    """A request that continues this one waits for its entries."""

    def generated(self) -> bool:
        return all(h.done for h in self.handles)

    def ended(self) -> bool:
        """Every handle's finishing event went out (their results, with the states, may follow)."""
        return all(h.ended for h in self.handles)


class RepairSlots:
    """At most `n` repairs waiting for an idle engine or running at once, taken in arrival order.
    A request gives up its place as soon as a later request waits for it (that request prefills
    the reply itself): a continuation never waits behind other requests' repairs; and after
    REPAIR_IDLE_S in the queue (a busy engine would let it grow with the mismatches' rate)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._queue: deque[Settling] = deque()

    async def take(self, s: Settling) -> bool:
        """True with a slot (give() it back), False once a request waits for `s` or after
        REPAIR_IDLE_S in the queue."""
        self._queue.append(s)
        try:
            delay, deadline = POLL_FIRST_S, asyncio.get_running_loop().time() + REPAIR_IDLE_S
            while not s.awaited and asyncio.get_running_loop().time() < deadline:
                if self.free > 0 and self._queue[0] is s:
                    self.free -= 1
                    return True
                delay = await _pause(s, delay)
            return False
        finally:
            self._queue.remove(s)
            self._wake()

    def give(self) -> None:
        self.free += 1
        self._wake()

    def _wake(self) -> None:
        if self._queue and self.free > 0:
            self._queue[0].kick.set()


async def until_generated(s: Settling) -> None:
    """Until every handle of `s` ended (polling, or kicked by a lookup that saw them end)."""
    delay = POLL_FIRST_S
    while not s.generated():
        delay = await _pause(s, POLL_FIRST_S if s.awaited else delay)  # a request waits: look often


async def engine_idle(engine: EngineAPI, s: Settling) -> bool:
    """Wait until nothing runs in the engine: True; False after REPAIR_IDLE_S, or as soon as a
    request waits for `s` (it prefills the reply itself)."""
    deadline = asyncio.get_running_loop().time() + REPAIR_IDLE_S
    delay = POLL_FIRST_S
    while not s.awaited:
        st = engine.stats()
        if st.waiting == 0 and st.running == 0:
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        delay = await _pause(s, delay)
    return False


async def _pause(s: Settling, delay: float) -> float:
    """Sleep `delay` (less if kicked); the next, longer delay."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(s.kick.wait(), delay)
    s.kick.clear()
    return min(delay * 1.5, POLL_MAX_S)
