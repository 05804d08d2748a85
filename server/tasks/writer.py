"""Background writer: database jobs run one at a time, in submission order, off the request path.

The queue is bounded (settings.writer_queue): `put`/`call` wait while it is full (back-pressure,
never unbounded memory); `offer` drops the job instead (progress snapshots, which the next one
supersedes)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger("server.tasks.writer")
Job = Callable[..., Awaitable[Any]]


class Writer:
    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=max(1, int(maxsize)))
        self._task: asyncio.Task | None = None
        self.done = 0
        self.failed = 0
        self.dropped = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="task-db-writer")

    async def put(self, fn: Job, *args: Any) -> asyncio.Future:
        """Queue a job (waits while the queue is full); returns a future of its result."""
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((fn, args, fut))
        return fut

    async def call(self, fn: Job, *args: Any) -> Any:
        """Queue a job and wait for it (its exception is raised here)."""
        return await (await self.put(fn, *args))

    def offer(self, fn: Job, *args: Any) -> bool:
        """Queue a job if there is room; False (job dropped) when the queue is full."""
        try:
            self.queue.put_nowait((fn, args, None))
            return True
        except asyncio.QueueFull:
            self.dropped += 1
            return False

    async def flush(self) -> None:
        async def _noop() -> None:
            return None

        if self._task is not None and not self._task.done():
            await self.call(_noop)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.flush(), timeout=30)
        except asyncio.TimeoutError:
            log.warning("task writer did not drain in 30 s; %d jobs lost", self.queue.qsize())
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            fn, args, fut = await self.queue.get()
            try:
                result = await fn(*args)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one failed job must not stop the writer
                self.failed += 1
                if fut is None:
                    log.exception("background database write failed: %s", exc)
                elif not fut.done():
                    fut.set_exception(exc)
            else:
                self.done += 1
                if fut is not None and not fut.done():
                    fut.set_result(result)
            finally:
                self.queue.task_done()
