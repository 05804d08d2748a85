"""The task database's errors (split from server/tasks/database.py for size): the transient ones
as TaskUnavailable (HTTP 503, retryable), a damaged file or page (DatabaseDamaged, DamagedPage),
and whether the database answered its last use (Outages, for /health and /metrics).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from dataclasses import dataclass

import sqlalchemy as sa

from server.tasks.errors import TaskError, TaskUnavailable

log = logging.getLogger("server.tasks.store")

_BUSY = ("database is locked", "database table is locked", "database is busy")
_FULL = ("database or disk is full", "no space left")
_IO = ("disk i/o error", "readonly database", "unable to open database file")
"""SQLite's words for a file it cannot write now (a failing or remounted disk, permissions taken
away); PostgreSQL's: SQLSTATE class 58 (system errors: I/O) and 25006 (a read-only transaction:
a standby after a failover)."""
_PG_BUSY = {"55P03", "40P01", "40001"}  # lock not available, deadlock, serialization failure
_PG_FULL = {"53100"}


def locked(exc: BaseException) -> bool:
    return isinstance(exc, sa.exc.DBAPIError) and any(m in str(exc.orig).lower() for m in _BUSY)


def unavailable(exc: BaseException) -> TaskUnavailable | None:
    """The retryable TaskUnavailable a database error means (None: not a transient one): locked
    beyond the busy timeout, a full disk, unreachable, or a file it cannot write now."""
    if isinstance(exc, TaskError):
        return None
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, sa.exc.TimeoutError)):  # pgconnect's bounds, the pool's
        return TaskUnavailable("the task database did not answer within db_busy_timeout; retry later")
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
    if any(m in msg for m in _IO) or state[:2] == "58" or state == "25006":
        why = msg.splitlines()[0] if msg else state
        return TaskUnavailable(f"the task database cannot be written now ({why}); nothing was stored, retry later")
    if exc.connection_invalidated or state[:2] in ("08", "57", "53"):
        return TaskUnavailable("the task database is unreachable; retry later")
    return None


def file_unwritable(exc: BaseException) -> bool:
    """SQLite cannot write through this connection (it opened the file read-only, which it does
    silently when the file was not writable then, or met an I/O error): the connection stays so."""
    return any(m in str(getattr(exc, "orig", None) or exc).lower() for m in _IO)


def contention(exc: BaseException) -> bool:
    """PostgreSQL: a lock on rows another transaction holds (or a deadlock): one row's trouble,
    not the database's."""
    return isinstance(exc, sa.exc.DBAPIError) and (getattr(exc.orig, "sqlstate", None) or "") in _PG_BUSY


_DAMAGED = ("malformed", "file is not a database", "database corrupt")


def damaged(exc: BaseException) -> bool:
    """A file that is not a valid database (truncated, overwritten), or a page found damaged (DamagedPage)."""
    if isinstance(exc, DamagedPage):
        return True
    return isinstance(exc, sa.exc.DatabaseError) and any(m in str(exc.orig).lower() for m in _DAMAGED)


def _why(exc: BaseException) -> str:
    """The driver's first line for a database error (not SQLAlchemy's dump of the SQL)."""
    return (str(getattr(exc, "orig", None) or exc).strip() or type(exc).__name__).splitlines()[0]


def damage_line(url: str, exc: BaseException, then: str) -> str:
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
        super().__init__(damage_line(url, exc, ": nothing was changed; "))


class DamagedPage(TaskError):
    """A page of the task database found damaged while serving: not transient (not retried as a
    TaskUnavailable is), 503 without Retry-After; the log names the file, once (Database._task_errors)."""

    status, code = 503, "database_unavailable"

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"the task database is damaged ({_why(exc)}); nothing was stored (the server's log says more)")


@dataclass(frozen=True)
class Availability:
    """Whether the task database answered this server's last use of it (a request's, a write's,
    a heartbeat's: server.tasks.lease beats every lease_timeout / 3 seconds, so an outage shows
    within that and one busy timeout without traffic). Not a probe of its own: /health reads it."""

    ok: bool = True
    error: str | None = None  # the failure's message (a 503 database_unavailable's)
    since: float | None = None  # when the failures began (epoch seconds)


class Outages:
    """Availability over time from each database block's outcome (Database._task_errors): a
    failed block makes it unavailable; only a write that succeeds (a heartbeat's, a request's)
    makes it available again, or a read when reads were what failed (reads may go on while
    every write fails: a read-only file, a standby). One log line when it is available again."""

    def __init__(self) -> None:
        self.now = Availability()
        self._failed_write = False

    def failed(self, err: TaskError, *, write: bool) -> None:
        since = self.now.since if not self.now.ok else time.time()
        self._failed_write = write or (self._failed_write and not self.now.ok)
        self.now = Availability(ok=False, error=err.message, since=since)

    def answered(self, *, write: bool) -> None:
        if self.now.ok or (self._failed_write and not write):
            return
        log.warning("the task database answers again (unavailable for %.1f s)", time.time() - (self.now.since or 0))
        self.now, self._failed_write = Availability(), False
