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
import re
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


_DAMAGED = ("malformed", "file is not a database", "database corrupt")


def damaged(exc: BaseException) -> bool:
    """A file that is not a valid database (truncated, overwritten), or a page found damaged (DamagedPage)."""
    if isinstance(exc, DamagedPage):
        return True
    return isinstance(exc, sa.exc.DatabaseError) and any(m in str(exc.orig).lower() for m in _DAMAGED)


def _why(exc: BaseException) -> str:
    """The driver's first line for a database error (not SQLAlchemy's dump of the SQL)."""
    return (str(getattr(exc, "orig", None) or exc).strip() or type(exc).__name__).splitlines()[0]


def _said(url: str, exc: BaseException, then: str) -> str:
    """The line saying that the task database is damaged, `then`, and how to salvage it."""
    path = url.split(":///", 1)[-1]
    return (
        f"the task database {path} is damaged ({_why(exc)}){then}restore it from a backup, or salvage what is "
        f"readable with `sqlite3 {path} .recover | sqlite3 recovered.db` and start on recovered.db (tasks missing "
        "there are lost; states missing there are rebuilt from their tasks' tokens)"
    )


class DatabaseDamaged(RuntimeError):
    """The task database file is damaged; the server does not start on it."""

    def __init__(self, url: str, exc: BaseException) -> None:
        super().__init__(_said(url, exc, ": nothing was changed; "))


class DamagedPage(TaskError):
    """A page of the task database found damaged while serving: not transient (not retried as a
    TaskUnavailable is), 503 without Retry-After; the log names the file, once (Database._task_errors)."""

    status, code = 503, "database_unavailable"

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"the task database is damaged ({_why(exc)}); nothing was stored (the server's log says more)")


def read_every_tree(conn: sa.Connection, url: str) -> None:
    """Read every page of each SQLite table's and index's b-tree in one read transaction, not the
    overflow pages of large values (a damaged state blob is rebuilt when read): a table by
    SQLite's count, an index by a scan of it alone. A damaged page raises "database disk image
    is malformed"; an index with more or fewer entries than its table has rows, DatabaseDamaged."""
    q = "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE type IN ('table', 'index') AND rootpage > 0"
    rows: dict[str, int] = {}
    for kind, name, table, sql in sorted(conn.exec_driver_sql(q).all(), key=lambda r: r[0] != "table"):
        where = re.search(r"\bWHERE\b(.*)\Z", sql or "", re.IGNORECASE | re.DOTALL)  # a partial index's
        scan = "NOT INDEXED" if kind == "table" else f'INDEXED BY "{name}" WHERE {where[1] if where else 1}'
        try:
            n = int(conn.exec_driver_sql(f'SELECT count(*) FROM "{table}" {scan}').scalar_one())
        except sa.exc.DBAPIError as exc:
            if damaged(exc) or _locked(exc) or kind == "table":
                raise
            continue  # an index SQLite will not scan alone ("no query solution"): not judged here
        if kind == "table":
            rows[name] = n
        elif where is None and n != rows.get(table, n):
            raise DatabaseDamaged(url, RuntimeError(f"index {name} has {n} entries for {rows[table]} rows of {table}"))


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
        self._damage_said = False  # (_task_errors)

    # --- life cycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect, read the trees (SQLite: read_every_tree), migrate. A damaged SQLite file:
        DatabaseDamaged (one line naming the file and how to salvage it), nothing changed."""
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
                raise DatabaseDamaged(self.url, exc) from None
            raise
        if self.revision_before != self.revision:
            log.info("task database %s: schema %s -> %s", self.url, self.revision_before or "empty", self.revision)

    async def _migrate(self) -> None:
        """Bring the schema to head. Migrations hold the database's write lock from the start
        (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock in migrate.upgrade), so servers
        opening one new database together run them one after the other instead of failing on
        each other. SQLite can still answer "locked" without waiting (a new file switching to
        WAL while another process opens it): such an attempt is retried until busy_timeout. A
        file's trees are read first (read_every_tree): a damaged file is refused unchanged."""
        assert self.engine is not None
        deadline = time.monotonic() + self.busy_timeout
        read = not self.is_sqlite or self.url == "sqlite+aiosqlite://"  # (in memory: new)
        while True:
            try:
                if not read:
                    async with self.engine.connect() as conn:
                        await conn.run_sync(read_every_tree, self.url)
                    read = True
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
        (SQLite: BEGIN IMMEDIATE). Errors: _task_errors (TaskUnavailable, DamagedPage)."""
        async with self._wlock, self._task_errors(), self._db().connect() as conn:
            conn = await conn.execution_options(sqlite_immediate=True)
            async with conn.begin():
                yield conn

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """`async with store.read() as conn`: a pooled connection for queries (errors: write's)."""
        async with self._task_errors(), self._db().connect() as conn:
            yield conn

    @asynccontextmanager
    async def _task_errors(self) -> AsyncIterator[None]:
        """A transient database error of the block as TaskUnavailable (unavailable()); a damaged
        page (one damaged while serving: a damaged file is refused at open) as DamagedPage, said
        once in the log with the file and how to salvage it, not as SQLAlchemy's SQL per write."""
        try:
            yield
        except Exception as exc:
            if damaged(exc) and not isinstance(exc, DamagedPage):
                then = ", found while serving: what needs those pages fails (503, nothing stored). Stop the server, "
                log.log(logging.DEBUG if self._damage_said else logging.ERROR, "%s", _said(self.url, exc, then))
                self._damage_said = True
                raise DamagedPage(exc) from None
            err = unavailable(exc)
            if err is None:
                raise
            raise err from exc

    async def db_now(self, conn: AsyncConnection) -> float:
        """The database's clock in epoch seconds (leases compare times of several hosts)."""
        if self.is_sqlite:
            q = "SELECT (julianday('now') - 2440587.5) * 86400.0"
        else:
            q = "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS double precision)"
        return float((await conn.exec_driver_sql(q)).scalar_one())
