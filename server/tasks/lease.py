"""Instance leases: several servers (replicas) on one database.

Each server start is an instance with a row in `instances` whose `heartbeat_at` (the database's
clock, so hosts with skewed clocks agree) it renews every `timeout / 3` seconds. At start and at
every heartbeat, in one transaction, an instance drops the rows of instances silent for more
than `timeout` seconds and marks interrupted the running tasks of every instance that is no
longer listed: a crashed replica's tasks are interrupted by the others within about
`timeout * 4 / 3` seconds, while a live replica's tasks are never touched.

A server has a stable name (Settings.instance_name; by default `<hostname>:<port>`, or
`<hostname>/<host>:<port>` for one bound address: no two live servers share it); each start of
it is a new instance of that name. A start takes the rows of its earlier instances for dead, and
marks their running tasks interrupted. Under a default name it does so at once (it holds their
port, so they are gone): a server restarted after a crash finds its interrupted tasks at once,
not a lease timeout later. A name that was given (--instance-name) proves nothing of the kind:
a second server may be started under a name a live one uses. So such a start first watches
(`watch_name`) the rows of its name whose heartbeat is within their lease timeout: a heartbeat
that advances is a live server, and the start is refused (NameInUse) with its tasks untouched; a
row that stays still until its lease expires is a crashed predecessor's, taken for dead as
above. A clean shutdown deletes its row (`close`), so a restart after one does not wait.

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

from server.tasks.config import TaskSettings, server_name
from server.tasks.database import database_url
from server.tasks.schema import instances
from server.tasks.store import Store, interrupt_orphans

log = logging.getLogger("server.tasks")


class NameInUse(ValueError):
    """Another live server runs under this instance name: this start is refused (watch_name).
    `refusal`: the CLI says it in one line and exits with status 2, as its start-up checks do."""

    refusal = True


def instance_id(name: str) -> str:
    """A new instance of server `name`: `<name>-<6 hex>` (at most 80 characters)."""
    return f"{name[:72]}-{uuid.uuid4().hex[:6]}"


class Lease:
    def __init__(self, store: Store, name: str, url: str | None, timeout: float, *, watch: bool = True) -> None:
        """`watch`: the name was given, not derived from the address this server listens on:
        `start` first watches the name's live-looking rows (watch_name)."""
        self.store, self.name, self.url = store, name, url or None
        self.watch = watch
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
        tasks of dead instances; returns their ids. With `watch`: NameInUse, nothing written,
        when a live server holds this name (watch_name)."""
        if self.watch:
            await watch_name(self.store, self.name, self.timeout)
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
        """One heartbeat: renew (or register) this instance's lease, then, in a transaction of
        its own, drop expired instances and interrupt their tasks. Apart, so that the renewal
        never waits on a task row another server's stalled transaction holds."""
        async with self.store.write() as conn:
            renewed = await self._renew(conn, await self.store.db_now(conn))
            twins = [] if renewed else await self._twins(conn)
        if not renewed and self.renewals:
            self.lost += 1
            log.error(
                "instance %s: its lease had expired (no heartbeat for over its --lease-timeout, "
                "%g s); the tasks it was running were marked interrupted; registered again%s",
                self.instance,
                self.timeout,
                f". Another server started under its name {self.name!r} meanwhile (instance "
                f"{', '.join(twins)}) and took it for dead: two live servers share the name now; "
                "restart one with another --instance-name"
                if twins
                else "",
            )
        self.renewals += 1
        async with self.store.write() as conn:
            now = await self.store.db_now(conn)
            # each row is judged by its holder's own timeout (an older server's row: by ours)
            timeout = sa.func.coalesce(instances.c.lease_timeout, self.timeout)
            dead = instances.c.heartbeat_at < now - timeout
            if first:
                dead = sa.or_(dead, instances.c.name == self.name)
            await conn.execute(sa.delete(instances).where(dead).where(instances.c.id != self.instance))
            live = {r.id: r.url for r in await conn.execute(sa.select(instances.c.id, instances.c.url))}
            reaped = await interrupt_orphans(conn, set(live))
        live.pop(self.instance, None)
        self.peers = live
        if reaped and not first:  # (at start the task manager says it, once)
            log.warning("%d task(s) of stopped or silent instances marked interrupted", len(reaped))
        return reaped

    async def _twins(self, conn: AsyncConnection) -> list[str]:
        """The other instances of this server's name (another server started under it)."""
        q = sa.select(instances.c.id).where(instances.c.name == self.name, instances.c.id != self.instance)
        return sorted(r.id for r in await conn.execute(q))

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
            except Exception as exc:  # (a lost lease found by its renewal is still acted on)
                log.warning("instance %s: heartbeat failed: %s", self.instance, exc)
                reaped = []
            if self.lost != lost:
                on_lost()
            if reaped:
                on_reaped(reaped)


async def watch_name(store: Store, name: str, timeout: float) -> None:
    """Before a start under a given `name` takes its earlier instances for dead: the rows of
    `name` whose heartbeat is within their lease timeout (their own, else `timeout`) are
    watched until that timeout has passed since their last heartbeat (at most a lease
    timeout). NameInUse as soon as one's heartbeat advances (a live server uses the name);
    returns once none is left (stayed still: a crashed server's; deleted: a clean shutdown,
    or reaped by another replica). No row within its timeout: returns at once. Reads only."""
    now, seen = await _name_rows(store, name, timeout)
    fresh = {i: (hb, t) for i, (hb, t) in seen.items() if hb >= now - t}
    if not fresh:
        return
    until = max(hb + t for hb, t in fresh.values())
    log.warning(
        "instance name %r: instance %s heartbeat %.1f s ago; watching its lease row for up to %.1f s before "
        "taking it for dead (a live server under this name refuses this start)",
        name,
        ", ".join(sorted(fresh)),
        now - max(hb for hb, _ in fresh.values()),
        until - now,
    )
    pause = min(1.0, max(0.05, min(t for _, t in fresh.values()) / 10))
    while True:
        await asyncio.sleep(pause)
        now, rows = await _name_rows(store, name, timeout)
        for i, (hb, _) in list(fresh.items()):
            if i not in rows:
                del fresh[i]  # it left: a clean shutdown (or another replica reaped it)
            elif rows[i][0] > hb:
                raise NameInUse(
                    f"--instance-name {name}: another live server uses this name (its instance {i} "
                    "renewed its lease while this start watched it); choose another --instance-name"
                )
        if not fresh or now >= until:
            if fresh:
                log.warning("instance name %r: instance %s stayed silent for its lease timeout: taken for dead",
                            name, ", ".join(sorted(fresh)))  # fmt: skip
            return


async def _name_rows(store: Store, name: str, timeout: float) -> tuple[float, dict[str, tuple[float, float]]]:
    """(the database's clock, the lease rows of `name`: id -> (heartbeat_at, its lease timeout,
    else `timeout`))."""
    async with store.read() as conn:
        now = await store.db_now(conn)
        q = sa.select(instances.c.id, instances.c.heartbeat_at, instances.c.lease_timeout)
        rows = (await conn.execute(q.where(instances.c.name == name))).all()
    return now, {r.id: (float(r.heartbeat_at), float(r.lease_timeout or timeout)) for r in rows}


def name_problem(settings: TaskSettings) -> str | None:
    """For the CLI, before the model loads: why a start under the given --instance-name is
    refused (watch_name: a live server uses it), one line, or None (no name given: the default
    one is held by the port this server listens on; an in-memory database: no other server).
    Opens and closes the database."""
    if not settings.instance_name or database_url(settings.db) == "sqlite+aiosqlite://":
        return None

    async def check() -> str | None:
        store = Store(settings.db, busy_timeout=settings.db_busy_timeout)
        await store.open()
        try:
            await watch_name(store, server_name(settings.instance_name), float(settings.lease_timeout))
        except NameInUse as exc:
            return str(exc)
        finally:
            await store.close()
        return None

    return asyncio.run(check())
