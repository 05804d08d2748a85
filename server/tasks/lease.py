"""Instance leases: several servers (replicas) on one database.

Each server start is an instance with a row in `instances` whose `heartbeat_at` (the database's
clock, so hosts with skewed clocks agree) it renews every `timeout / 3` seconds. At start and at
every heartbeat, in one transaction, an instance drops the rows of instances silent for more
than `timeout` seconds and marks interrupted the running tasks of every instance that is no
longer listed: a crashed replica's tasks are interrupted by the others within about
`timeout * 4 / 3` seconds, while a live replica's tasks are never touched.

A server has a stable name (Settings.instance_name; by default `<hostname>:<port>`, or
`<hostname>/<host>:<port>` for one bound address: no two live servers share it); each start of
it is a new instance of that name. A start takes the rows of its earlier instances for dead at
once (it holds their port, so they are gone), so a server restarted after a crash finds its
interrupted tasks at once, not a lease timeout later.

An instance that finds its own row gone (it was silent too long: a stalled process, a database
outage) registers again; the tasks it was running were interrupted by the others, and its writes
of them are refused from then on (`Store.update_owned`), so nothing it does later overwrites
what another replica did with them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from server.tasks.schema import instances
from server.tasks.store import Store, interrupt_orphans

log = logging.getLogger("server.tasks")


def instance_id(name: str) -> str:
    """A new instance of server `name`: `<name>-<6 hex>` (at most 80 characters)."""
    return f"{name[:72]}-{uuid.uuid4().hex[:6]}"


class Lease:
    def __init__(self, store: Store, name: str, url: str | None, timeout: float) -> None:
        self.store, self.name, self.url = store, name, url or None
        self.instance = instance_id(name)
        self.timeout = float(timeout)
        self.interval = max(0.05, self.timeout / 3)
        self.peers: dict[str, str | None] = {}
        """The other live instances (id -> advertised URL) at the last heartbeat."""
        self.renewals = 0
        self.lost = 0
        """Times this instance found its lease expired and registered again."""
        self._task: asyncio.Task[None] | None = None

    @property
    def shared(self) -> bool:
        """Another instance was live at the last heartbeat (copies of tasks may go stale)."""
        return bool(self.peers)

    def url_of(self, instance: str | None) -> str | None:
        if instance == self.instance:
            return self.url
        return self.peers.get(instance) if instance else None

    async def start(self) -> list[str]:
        """Register (taking this server's earlier instances for dead), then interrupt the
        tasks of dead instances; returns their ids."""
        return await self.beat(first=True)

    def run(self, on_reaped: Callable[[list[str]], None], on_lost: Callable[[], None]) -> None:
        """Heartbeat in the background; `on_reaped(ids)` after tasks were marked interrupted,
        `on_lost()` when this instance's lease had expired (the task manager's: its Takeover,
        server.tasks.takeover)."""
        self._task = asyncio.create_task(self._loop(on_reaped, on_lost), name="task-lease")

    async def close(self) -> None:
        """Stop the heartbeat and leave (the tasks this instance ran are settled by then)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            async with self.store.write() as conn:
                await conn.execute(sa.delete(instances).where(instances.c.id == self.instance))
        except Exception as exc:
            log.warning("could not remove this instance's lease row: %s", exc)

    async def beat(self, first: bool = False) -> list[str]:
        """One heartbeat: renew (or register), drop expired instances, interrupt their tasks."""
        async with self.store.write() as conn:
            now = await self.store.db_now(conn)
            renewed = await self._renew(conn, now)
            # each row is judged by its holder's own timeout (an older server's row: by ours)
            timeout = sa.func.coalesce(instances.c.lease_timeout, self.timeout)
            dead = instances.c.heartbeat_at < now - timeout
            if first:
                dead = sa.or_(dead, instances.c.name == self.name)
            await conn.execute(sa.delete(instances).where(dead).where(instances.c.id != self.instance))
            live = {r.id: r.url for r in await conn.execute(sa.select(instances.c.id, instances.c.url))}
            reaped = await interrupt_orphans(conn, set(live))
        if not renewed and self.renewals:
            self.lost += 1
            log.error(
                "instance %s: its lease had expired (no heartbeat for over its --lease-timeout, "
                "%.0f s); the tasks it was running were marked interrupted; registered again",
                self.instance,
                self.timeout,
            )
        self.renewals += 1
        live.pop(self.instance, None)
        self.peers = live
        if reaped and not first:  # (at start the task manager says it, once)
            log.warning("%d task(s) of stopped or silent instances marked interrupted", len(reaped))
        return reaped

    async def _renew(self, conn: AsyncConnection, now: float) -> bool:
        """Renew this instance's row; insert it when missing. True when it was there."""
        res = await conn.execute(
            sa.update(instances)
            .where(instances.c.id == self.instance)
            .values(heartbeat_at=now, url=self.url, lease_timeout=self.timeout)
        )
        if res.rowcount:
            return True
        await conn.execute(
            sa.insert(instances).values(
                id=self.instance,
                name=self.name,
                url=self.url,
                started_at=time.time(),
                heartbeat_at=now,
                lease_timeout=self.timeout,
            )
        )
        return False

    async def _loop(self, on_reaped: Callable[[list[str]], None], on_lost: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(self.interval)
            lost = self.lost
            try:
                reaped = await self.beat()
            except Exception as exc:
                log.warning("instance %s: heartbeat failed: %s", self.instance, exc)
                continue
            if self.lost != lost:
                on_lost()
            if reaped:
                on_reaped(reaped)
