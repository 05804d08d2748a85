"""One template name per API key in the database: a key's public `_<name>` and its private
`_<name>@<owner>` are one name, never both (a private one would shadow the public one from that
key: docs/task-api.md). A write transaction that inserts a key's template row first takes the
name's lock (`lock_name`), then checks that the other form is free (`name_free`, TaskConflict:
the 409 of as_template). In SQLAlchemy Core that SQLite and PostgreSQL both run; the lock is
PostgreSQL's advisory lock (SQLite's write transactions are serial already).
"""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from server.tasks.errors import TaskConflict
from server.tasks.records import qualified
from server.tasks.schema import tasks

__all__ = ["lock_name", "name_free"]


def _keyed_name(row: dict[str, Any]) -> tuple[str, str] | None:
    """(owner, name: `_<name>`) of a new template row of an API key (None: not one; a template
    made without keys is public, its id is its name and the primary key keeps it unique)."""
    if row.get("kind") != "template" or row.get("owner") is None:
        return None
    return row["owner"], row["id"].split("@", 1)[0]


async def lock_name(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """In a write transaction, first: lock the key's template name till the commit, so that two
    servers inserting a public `_name` and a private `_name@<owner>` of one key at once run one
    after the other, and the later one's name_free sees the first's row. SQLite: its write
    transactions already are (BEGIN IMMEDIATE). PostgreSQL: a transaction-scoped advisory lock
    on (owner, name); READ COMMITTED, each later statement reads what committed meanwhile."""
    keyed = _keyed_name(row)
    if keyed is None or conn.dialect.name != "postgresql":
        return
    digest = hashlib.sha256("\0".join(("template name", *keyed)).encode()).digest()
    key = int.from_bytes(digest[:8], "big", signed=True)  # pg_advisory_xact_lock takes a bigint
    await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.bindparam("k", key, type_=sa.BigInteger))))


async def name_free(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """After lock_name: TaskConflict (TaskManager.as_template's 409, the same message) when the
    owner of the new template `row` has the other template of its name, made or being made (its
    claim): a private one would shadow the public one from that key (docs/task-api.md)."""
    keyed = _keyed_name(row)
    if keyed is None:
        return
    owner, name = keyed
    other = qualified(name, owner) if row["id"] == name else name
    q = sa.select(tasks.c.id).where(tasks.c.id == other, tasks.c.owner == owner)
    if (await conn.execute(q)).first() is not None:
        kind = "private" if row["public"] else "public"
        raise TaskConflict(f"template {name!r} already exists ({kind})", param="name")
