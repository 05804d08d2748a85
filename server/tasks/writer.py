"""Background writer: database jobs run one at a time, in submission order, off the request path.

The queue is bounded (settings.writer_queue): `put`/`call` wait while it is full (back-pressure,
never unbounded memory); `offer` drops the job instead (progress snapshots, which the next one
supersedes). `put_many` queues one item of a list job: consecutive such entries of the same job
run as one call, i.e. one transaction (group commit: a burst of 256 new tasks is one commit, not
256, each acknowledged only once it is committed). Items may weigh bytes (a settled task's state:
21 MB at 2.9B in fp32): a group closes at GROUP_BYTES, so that the first items of a burst are
acknowledged after one bounded commit, not after the whole burst's.

At shutdown (`closing`), the first job that finds the database away (TaskUnavailable) ends the
writer's tries: the jobs still queued, and those queued later, fail at once with its error
instead of each waiting out its own bound (a failed group is not retried item by item either),
so a shutdown on a stalled database takes about one bound, however many tasks it settles."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

from server.tasks.errors import TaskUnavailable

log = logging.getLogger("server.tasks.writer")
Job = Callable[..., Awaitable[Any]]
"""A database job: a coroutine function, called with the arguments it was queued with."""
T = TypeVar("T")
ListJob = Callable[[list[T]], Awaitable[object]]
"""A job that writes a list of items in one transaction (put_many)."""
MAX_GROUP = 256  # items per merged put_many call
GROUP_BYTES = 64 * 2**20  # weight (bytes written) per merged put_many call; at least one item
UNAVAILABLE_LOG_S = 30.0  # at most one line this often while the database is away


class _Entry(NamedTuple):
    fn: Job
    args: tuple[Any, ...]  # put_many: (item,)
    fut: asyncio.Future[Any] | None  # None: offer (nobody waits)
    many: bool  # a put_many item
    weight: int = 0  # put_many: the bytes the item writes (GROUP_BYTES)
    queued: float = 0.0  # time.monotonic() when it was queued (Writer._away)
    fail_fast: bool = False  # a request's job: fails at once while the database is away (_away)


class Writer:
    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[_Entry] = asyncio.Queue(maxsize=max(1, int(maxsize)))
        self._task: asyncio.Task[None] | None = None
        self.done = 0
        self.failed = 0
        self.dropped = 0
        self._unavailable, self._unavailable_logged = 0, -UNAVAILABLE_LOG_S  # (_log_failure)
        self._away: tuple[float, TaskUnavailable] | None = None
        """(when, why) a job last found the database away (TaskUnavailable: locked beyond the busy
        timeout, full, unreachable); None once a job succeeded since. A request's entry
        (`fail_fast`) queued before then fails at once with the same error instead of waiting out
        the busy timeout again: requests queued behind a failed write get their 503 together, not
        one timeout after another. Background jobs (progress, settle rows, states) always run:
        each handles its own failure (a retry later, a flag reset), which skipping would bypass."""
        self._closing = False  # (closing)
        self.gone: TaskUnavailable | None = None
        """Why the database was found away during the shutdown (closing); None until then. Every
        job from then on fails at once with it, background ones included (nothing retries them)."""
        self._gone_event = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="task-db-writer")

    async def put(self, fn: Job, *args: Any, fail_fast: bool = False) -> asyncio.Future[Any]:
        """Queue a job (waits while the queue is full); returns a future of its result.
        fail_fast: a request's job, whose caller turns a TaskUnavailable into its answer (_away)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Entry(fn, args, fut, False, 0, time.monotonic(), fail_fast))
        return fut

    async def put_many(
        self, fn: ListJob[T], item: T, weight: int = 0, *, fail_fast: bool = False
    ) -> asyncio.Future[None]:
        """Queue `item` for `fn(items)`, a job that writes a list in one transaction. Consecutive
        queued entries of the same fn are merged into one call (up to MAX_GROUP items and
        GROUP_BYTES of weight). Returns a future of None, set when the call that held the item
        has finished; if a merged call fails, its items are retried one by one, so only a
        failing item's future fails."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Entry(fn, (item,), fut, True, int(weight), time.monotonic(), fail_fast))
        return fut

    async def call(self, fn: Job, *args: Any, fail_fast: bool = False) -> Any:
        """Queue a job and wait for it (its exception is raised here); fail_fast: as put's."""
        return await (await self.put(fn, *args, fail_fast=fail_fast))

    def offer(self, fn: Job, *args: Any) -> bool:
        """Queue a job if there is room; False (job dropped) when the queue is full."""
        try:
            self.queue.put_nowait(_Entry(fn, args, None, False, 0, time.monotonic()))
            return True
        except asyncio.QueueFull:
            self.dropped += 1
            return False

    def closing(self) -> None:
        """The shutdown has begun: from the first job that finds the database away
        (TaskUnavailable) on, every queued job fails at once (`gone`). Until then, jobs run as
        always (a database that answers gets every write)."""
        self._closing = True

    def unavailable(self, exc: TaskUnavailable) -> None:
        """A job that handles its own failure (a settle row, retried later) found the database
        away: during the shutdown, the writer gives up as if the job had raised it (`gone`)."""
        if self._closing:
            self._note(exc)

    async def wait_gone(self) -> None:
        """Until the database is found away during the shutdown (`gone`)."""
        await self._gone_event.wait()

    async def unless_gone(self, aw: Awaitable[Any], timeout: float) -> bool:
        """Await `aw` for up to `timeout` seconds, or until the shutdown finds the database away
        (wait_gone); whether `aw` finished (else it is cancelled)."""
        work, gone = asyncio.ensure_future(aw), asyncio.ensure_future(self.wait_gone())
        try:
            await asyncio.wait((work, gone), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            return work.done() and not work.cancelled()
        finally:
            for f in (work, gone):
                f.cancel()

    async def flush(self) -> None:
        """Until every job queued before this call has run (or failed)."""

        async def _noop() -> None:
            return None

        if self._task is not None and not self._task.done():
            try:
                await self.call(_noop)
            except TaskUnavailable:  # failed at once (gone): the jobs before it are over too
                pass

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
        ahead: _Entry | None = None  # an entry taken while gathering a group that belongs to the next round
        while True:
            ahead = await self._round(ahead if ahead is not None else await self.queue.get())

    async def _round(self, entry: _Entry) -> _Entry | None:
        """Run `entry`, merged with the put_many entries of the same job queued behind it; returns
        an entry taken that belongs to the next round. A method of its own so that the entries
        it ran (and the items they hold: states, MBs each) are let go when it returns: locals
        of _loop would keep the last ones while the writer waits for the next job."""
        group, ahead = self._gather(entry)
        try:
            run = self._skip_while_away(group)
            if not run:
                pass
            elif not entry.many:
                await self._run(entry.fn, entry.args, entry.fut)
            elif len(run) == 1 or not await self._run_group(entry.fn, run):
                for e in self._skip_while_away(run):  # alone, or isolating the failing item(s), in order
                    if self.gone is not None:  # found away at shutdown: not tried one by one
                        self._give_up(e, self.gone)
                    else:
                        await self._run(e.fn, ([e.args[0]],), e.fut)
        finally:
            for _ in group:
                self.queue.task_done()
        return ahead

    def _gather(self, entry: _Entry) -> tuple[list[_Entry], _Entry | None]:
        """`entry` and the put_many entries of its job queued right behind it (MAX_GROUP,
        GROUP_BYTES); the first other entry taken meanwhile, if any, is returned to go next."""
        group, weight = [entry], entry.weight
        while entry.many and len(group) < MAX_GROUP and weight < GROUP_BYTES:
            try:
                nxt = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if not (nxt.many and nxt.fn == entry.fn) or weight + nxt.weight > GROUP_BYTES:
                return group, nxt  # another job (bound methods compare equal, not identical), or too heavy
            group.append(nxt)
            weight += nxt.weight
        return group, None

    def _skip_while_away(self, group: list[_Entry]) -> list[_Entry]:
        """The entries of `group` to run; requests' entries (fail_fast) queued before a job found
        the database away (self._away) fail at once with its error (counted as failed). Once the
        database was found away during the shutdown (`gone`), every entry does (_give_up)."""
        if self.gone is not None:
            for e in group:
                self._give_up(e, self.gone)
            return []
        if self._away is None:
            return group
        since, why = self._away
        run = []
        for e in group:
            if not e.fail_fast or e.queued >= since or e.fut is None:
                run.append(e)
                continue
            self.failed += 1
            if not e.fut.done():
                e.fut.set_exception(TaskUnavailable(why.message))
        return run

    def _give_up(self, e: _Entry, why: TaskUnavailable) -> None:
        """Fail e at once, not tried: the database was found away during the shutdown. Its future
        (if any) gets the error, marked as read: nobody waits for a background job's."""
        self.failed += 1
        if e.fut is not None and not e.fut.done():
            e.fut.set_exception(TaskUnavailable(why.message))
            e.fut.exception()  # read here: no "never retrieved" line for a background job's

    def _note(self, exc: Exception | None) -> None:
        """A job's outcome: the database found away (a TaskUnavailable), or back (None). Away
        during the shutdown (closing): the writer gives up (`gone`)."""
        if exc is None:
            self._away = None
        elif isinstance(exc, TaskUnavailable):
            self._away = (time.monotonic(), exc)
            if self._closing and self.gone is None:
                self.gone = exc
                self._gone_event.set()
                log.warning(
                    "shutting down: the task database is unavailable (%s); the writes still queued are not "
                    "tried (the tasks whose final rows could not be committed are named below)",
                    exc.message,
                )

    async def _run(self, fn: Job, args: tuple[Any, ...], fut: asyncio.Future[Any] | None) -> None:
        try:
            result = await fn(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._note(exc)
            self.failed += 1
            if fut is None:
                self._log_failure(exc)
            elif not fut.done():
                fut.set_exception(exc)
        else:
            self._note(None)
            self.done += 1
            if fut is not None and not fut.done():
                fut.set_result(result)

    def _log_failure(self, exc: Exception) -> None:
        """A background write failed: a bug gets its traceback; the database being away (busy,
        full, unreachable: TaskUnavailable, retried by the jobs that must land) gets one line,
        at most every UNAVAILABLE_LOG_S, counting the failures in between."""
        if not isinstance(exc, TaskUnavailable):
            log.exception("background database write failed")
            return
        self._unavailable += 1
        now = time.monotonic()
        if now - self._unavailable_logged >= UNAVAILABLE_LOG_S:
            log.warning("background database writes failing (%d since the last line): %s", self._unavailable, exc)
            self._unavailable, self._unavailable_logged = 0, now

    async def _run_group(self, fn: Job, group: list[_Entry]) -> bool:
        """One call for the group's items; False (nothing set) when it fails."""
        try:
            await fn([e.args[0] for e in group])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._note(exc)
            return False
        self._note(None)
        for e in group:
            self.done += 1
            if e.fut is not None and not e.fut.done():
                e.fut.set_result(None)
        return True
