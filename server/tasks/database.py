"""The database connection of the task store: URLs, SQLite set-up, the write lock, and the
mapping of transient database errors to TaskUnavailable (HTTP 503, retryable).

SQLite runs in WAL mode with synchronous=FULL: a commit that returned is on disk even after a
power loss. Every write transaction begins IMMEDIATE: it takes the write lock first, waiting up
to the busy timeout for another process (a replica on the same file), instead of failing at its
first write. Writes in one process are serialized by one lock; reads run concurrently.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from server.tasks import migrate
from server.tasks.errors import TaskError, TaskUnavailable

log = logging.getLogger("server.tasks.store")

_ASYNC_SCHEMES = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}


def database_url(db: str) -> str:
    """A settings value (path or URL) -> an async SQLAlchemy URL."""
    if "://" in db:  # the blocking drivers' schemes name their async twins here
        scheme, rest = db.split("://", 1)
        return f"{_ASYNC_SCHEMES.get(scheme, scheme)}://{rest}"
    if db in ("", ":memory:"):
        return "sqlite+aiosqlite://"
    path = os.path.abspath(os.path.expanduser(db))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"sqlite+aiosqlite:///{path}"


def _sqlite_setup(engine: AsyncEngine, busy_ms: int) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (transactional DDL)
        cur = dbapi_conn.cursor()
        # page_size first: it only applies to a database not yet written (a new file). States
        # are blobs of megabytes (21 MB for 2.9B in fp32), stored as chains of overflow pages:
        # 64 KiB pages commit them several times faster than 4 KiB ones; one-row updates are
        # no slower. busy_timeout before journal_mode: switching a new file to WAL takes a lock
        # that another process opening the same file at the same time may hold.
        for pragma in (
            f"busy_timeout={busy_ms}",
            "page_size=65536",
            "journal_mode=WAL",
            "synchronous=FULL",
            "journal_size_limit=67108864",
            "temp_store=MEMORY",
        ):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # IMMEDIATE takes the write lock up front (waiting up to busy_timeout for it); a deferred
        # transaction that read first and then writes fails at once if another process wrote.
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


_BUSY = ("database is locked", "database table is locked", "database is busy")
_FULL = ("database or disk is full", "no space left")
_IO = ("disk i/o error", "readonly database", "unable to open database file")
"""SQLite's words for a file it cannot write now (a failing or remounted disk, permissions taken
away); PostgreSQL's: SQLSTATE class 58 (system errors: I/O) and 25006 (a read-only transaction:
a standby after a failover)."""
_PG_BUSY = {"55P03", "40P01", "40001"}  # lock not available, deadlock, serialization failure
_PG_FULL = {"53100"}


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sa.exc.DBAPIError) and any(m in str(exc.orig).lower() for m in _BUSY)


def unavailable(exc: BaseException) -> TaskUnavailable | None:
    """The retryable TaskUnavailable a database error means (None: not a transient one): locked
    beyond the busy timeout, a full disk, unreachable, or a file it cannot write now."""
    if isinstance(exc, TaskError):
        return None
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:
            return TaskUnavailable("the task database's disk is full; nothing was stored, retry later")
        return TaskUnavailable(f"the task database is unreachable ({exc}); retry later")
    if not isinstance(exc, sa.exc.DBAPIError):
        return None
    orig = exc.orig
    msg, state = str(orig).lower(), getattr(orig, "sqlstate", None) or ""
    if any(m in msg for m in _BUSY) or state in _PG_BUSY:
        return TaskUnavailable(
            "the task database is locked by another writer beyond the busy timeout; nothing was stored, retry shortly"
        )
    if any(m in msg for m in _FULL) or state in _PG_FULL:
        return TaskUnavailable("the task database's disk is full; nothing was stored, retry later")
    if exc.connection_invalidated or state[:2] in ("08", "57", "53"):
        return TaskUnavailable("the task database is unreachable; retry later")
    if any(m in msg for m in _IO) or state[:2] == "58" or state == "25006":
        why = msg.splitlines()[0] if msg else state
        return TaskUnavailable(f"the task database cannot be written now ({why}); nothing was stored, retry later")
    return None


@asynccontextmanager
async def _transient_as_unavailable() -> AsyncIterator[None]:
    """Re-raise a transient database error of the block as TaskUnavailable (unavailable())."""
    try:
        yield
    except Exception as exc:
        err = unavailable(exc)
        if err is None:
            raise
        raise err from exc


_DAMAGED = ("malformed", "file is not a database", "database corrupt")


def damaged(exc: BaseException) -> bool:
    """A database file that is not a valid database (truncated, overwritten)."""
    return isinstance(exc, sa.exc.DatabaseError) and any(m in str(exc.orig).lower() for m in _DAMAGED)


class DatabaseDamaged(RuntimeError):
    """The task database file is damaged; the server does not start on it."""

    def __init__(self, url: str, exc: BaseException) -> None:
        path = url.split(":///", 1)[-1]
        super().__init__(
            f"the task database {path} is damaged ({getattr(exc, 'orig', exc)}): nothing was changed. "
            f"Restore it from a backup, or salvage what is readable with `sqlite3 {path} .recover | "
            f"sqlite3 recovered.db` and start on recovered.db (tasks missing there are lost; states "
            f"missing there are rebuilt from their tasks' tokens)"
        )


class Database:
    """An async SQLAlchemy engine on the task database, migrated to the head schema at open."""

    def __init__(self, db: str, *, busy_timeout: float = 30.0) -> None:
        self.url = database_url(db)
        self.engine: AsyncEngine | None = None
        self.is_sqlite = self.url.startswith("sqlite")
        self.busy_timeout = float(busy_timeout)
        self.revision_before: str | None = None
        self.revision: str = ""
        self._wlock = asyncio.Lock()

    # --- life cycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        kw: dict[str, Any] = {} if self.is_sqlite else {"pool_pre_ping": True}  # survives a server restart
        if self.url == "sqlite+aiosqlite://":
            kw = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        try:
            self.engine = create_async_engine(self.url, **kw)
        except ModuleNotFoundError as exc:  # e.g. postgresql:// without asyncpg installed
            raise RuntimeError(
                f"the task database {self.url.split('://')[0]}:// needs the {exc.name} "
                f"package (pip install {exc.name}; for PostgreSQL, in the server's source tree: "
                f"pip install -e '.[postgres]')"
            ) from exc
        if self.is_sqlite:
            _sqlite_setup(self.engine, int(self.busy_timeout * 1000))
        try:
            await self._migrate()
        except BaseException as exc:
            await self.engine.dispose()
            self.engine = None
            if damaged(exc):
                raise DatabaseDamaged(self.url, exc) from exc
            raise
        if self.revision_before != self.revision:
            log.info("task database %s: schema %s -> %s", self.url, self.revision_before or "empty", self.revision)

    async def _migrate(self) -> None:
        """Bring the schema to head. Migrations hold the database's write lock from the start
        (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock in migrate.upgrade), so servers
        opening one new database together run them one after the other instead of failing on
        each other. SQLite can still answer "locked" without waiting (a new file switching to
        WAL while another process opens it): such an attempt is retried until busy_timeout."""
        assert self.engine is not None
        deadline = time.monotonic() + self.busy_timeout
        while True:
            try:
                async with self.engine.connect() as conn:
                    conn = await conn.execution_options(sqlite_immediate=True)
                    async with conn.begin():
                        self.revision_before, self.revision = await conn.run_sync(migrate.upgrade)
                return
            except Exception as exc:
                if not (self.is_sqlite and _locked(exc)) or time.monotonic() > deadline:
                    raise
                log.info("task database %s is locked by another process opening it; retrying", self.url)
                await asyncio.sleep(0.05 + random.random() * 0.2)

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.dispose()
            self.engine = None

    def _db(self) -> AsyncEngine:
        if self.engine is None:
            raise RuntimeError("the task store is not open")
        return self.engine

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """`async with store.write() as conn`: the write lock + one committed transaction
        (SQLite: BEGIN IMMEDIATE). A transient database error becomes TaskUnavailable."""
        async with self._wlock, _transient_as_unavailable(), self._db().connect() as conn:
            conn = await conn.execution_options(sqlite_immediate=True)
            async with conn.begin():
                yield conn

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """`async with store.read() as conn`: a pooled connection for queries."""
        async with _transient_as_unavailable(), self._db().connect() as conn:
            yield conn

    async def db_now(self, conn: AsyncConnection) -> float:
        """The database's clock in epoch seconds (leases compare times of several hosts)."""
        if self.is_sqlite:
            q = "SELECT (julianday('now') - 2440587.5) * 86400.0"
        else:
            q = "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS double precision)"
        return float((await conn.exec_driver_sql(q)).scalar_one())
