"""The SQLite side of the task database (split from server/tasks/database.py for size): each
connection's pragmas and IMMEDIATE transactions, a connection that cannot write dropped, the
start-up read of every b-tree (a damaged file refused unchanged), and the file's identity (one
removed or replaced while serving is noticed)."""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from server.tasks.dbfaults import DatabaseDamaged, damaged, file_unwritable, locked


def sqlite_setup(engine: AsyncEngine, busy_ms: int) -> None:
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

    @event.listens_for(engine.sync_engine, "handle_error")
    def _on_error(ctx: Any) -> None:
        # a connection that cannot write stays so (SQLite opened the file read-only because it
        # was not writable then, or met an I/O error): dropped with the pool as a lost one is,
        # so that the next connections open the file again once it is writable
        if file_unwritable(ctx.original_exception):
            cursor = getattr(ctx.execution_context, "cursor", None)
            if cursor is not None:  # (a cursor left open keeps the closed connection, and its lock)
                with contextlib.suppress(Exception):
                    cursor.close()
            ctx.is_disconnect = True

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # IMMEDIATE takes the write lock up front (waiting up to busy_timeout for it); a deferred
        # transaction that read first and then writes fails at once if another process wrote.
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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
            if damaged(exc) or locked(exc) or kind == "table":
                raise
            continue  # an index SQLite will not scan alone ("no query solution"): not judged here
        if kind == "table":
            rows[name] = n
        elif where is None and n != rows.get(table, n):
            raise DatabaseDamaged(url, RuntimeError(f"index {name} has {n} entries for {rows[table]} rows of {table}"))
