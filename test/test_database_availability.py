"""Whether the task database answers (dbfaults.Outages, read by /health and /metrics), and a
SQLite connection that cannot write being replaced rather than kept in the pool (QA: a file made
unwritable for a moment left read-only connections that failed writes until a restart)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from server.tasks import TaskUnavailable
from server.tasks.dbfaults import Outages
from server.tasks.schema import instances
from server.tasks.store import Store

DOWN = TaskUnavailable("the task database cannot be written now (attempt to write a readonly database)")


def test_a_failed_write_is_cleared_by_a_write_only():
    """Reads may go on while every write fails (a read-only file, a standby after a failover):
    a read that succeeds does not make the database available again (QA: /health said ok at
    every list while every create failed), a write does, and the outage keeps its start."""
    o = Outages()
    o.failed(DOWN, write=True)
    since = o.now.since
    o.answered(write=False)
    assert not o.now.ok and o.now.error == DOWN.message
    o.failed(TaskUnavailable("unreachable"), write=False)  # a read failing too: still the write's outage
    o.answered(write=False)
    assert not o.now.ok and o.now.since == since
    o.answered(write=True)
    assert o.now.ok and o.now.error is None and o.now.since is None


def test_a_failed_read_is_cleared_by_any_use_that_succeeds():
    o = Outages()
    o.failed(TaskUnavailable("did not answer"), write=False)
    assert not o.now.ok
    o.answered(write=False)
    assert o.now.ok


async def test_a_connection_that_cannot_write_is_replaced(tmp_path):
    """A connection SQLite cannot write through (here: PRAGMA query_only, the same error as a file
    opened read-only) fails its write with a 503 and is dropped: the writes after it succeed."""
    store = Store(str(tmp_path / "ro.db"))
    await store.open()
    try:
        with pytest.raises(TaskUnavailable, match="readonly database"):
            async with store.write() as conn:
                await conn.exec_driver_sql("PRAGMA query_only = 1")
                await conn.execute(sa.delete(instances))
        assert not store.outages.now.ok
        for _ in range(8):  # more than the pool keeps: none of them is the read-only one
            async with store.write() as conn:
                await conn.execute(sa.delete(instances))
        assert store.outages.now.ok
    finally:
        await store.close()


@pytest.mark.parametrize("how", ["removed", "replaced"])
async def test_a_sqlite_file_removed_or_replaced_while_serving_stores_nothing_more(tmp_path, how, caplog):
    """Writes went on into the file the server had opened, gone at the next start (QA: a create
    answered 200 after `rm tasks.db*`, and was lost at the restart). Now each write is a 503
    naming the file, said once in the log; reads still answer."""
    path = tmp_path / "t.db"
    store = Store(str(path))
    await store.open()
    try:
        async with store.write() as conn:
            await conn.execute(sa.delete(instances))
        for f in tmp_path.glob("t.db*"):
            f.unlink()
        if how == "replaced":
            fresh = Store(str(path))  # another file under the name (a restore from a backup)
            await fresh.open()
            await fresh.close()
        for _ in range(2):
            with pytest.raises(TaskUnavailable, match="was removed or replaced while the server runs"):
                async with store.write() as conn:
                    await conn.execute(sa.delete(instances))
        assert not store.outages.now.ok
        assert caplog.text.count("was removed or replaced") == 1, caplog.text
        async with store.read() as conn:
            await conn.exec_driver_sql("select 1")
    finally:
        await store.close()
