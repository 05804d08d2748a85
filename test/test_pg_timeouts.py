"""The task store's waits on PostgreSQL are bounded by db_busy_timeout (server/tasks/pgconnect.py):
a frozen server (its processes stopped by SIGSTOP), a table locked by another connection, a
listener that accepts and never answers, each end as a retryable TaskUnavailable (or a one-line
start-up refusal) within about that bound, not when the database comes back. libpq's URL options
(`sslmode=...`) are translated for asyncpg; an unknown one is a one-line refusal. A final row that
cannot be committed is logged once, not at every retry, and a shutdown does not count it kept.
Real PostgreSQL (test/pg_util.py; skipped without it) where the fault is PostgreSQL's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncpg
import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

from pg_util import pg_cluster, pg_url  # noqa: F401 - fixtures
from server.checks import database_open_problem, database_problem
from server.config import Settings
from server.tasks import TaskConfig, TaskManager, TaskUnavailable
from server.tasks.records import RUNNING, Task, to_row
from server.tasks.store import Store
from util_server import free_port

ROOT = Path(__file__).resolve().parents[1]
BUSY = 1.0  # db_busy_timeout of these tests: a statement is given 2 s, a connection 1 s


def cluster_pids(cluster) -> list[int]:
    """The postmaster and its children (backends, checkpointer, ...)."""
    with open(os.path.join(cluster.data, "postmaster.pid")) as f:
        master = int(f.readline())
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == master:
                    kids.append(int(d))
    return [master, *kids]


@contextlib.contextmanager
def frozen(cluster):
    """The whole PostgreSQL server stopped (SIGSTOP) for the block: it accepts nothing, answers nothing."""
    pids = cluster_pids(cluster)
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


async def timed(aw, limit: float = 8.0):
    """(the exception `aw` raised or None, seconds); fails the test if it takes beyond `limit` (a hang)."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(aw, limit)
    except asyncio.TimeoutError:
        pytest.fail(f"still waiting on the database after {limit} s (no time bound)")
    except Exception as exc:
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


def row(i: int) -> dict:
    return to_row(Task(id=f"TASK_{i}", kind="task", prompt="p", status=RUNNING))


async def test_a_frozen_server_is_a_503_within_the_busy_timeout_then_works_again(pg_cluster, pg_url):
    store = Store(pg_url, busy_timeout=BUSY)
    await store.open()
    await store.save_rows([row(1)])
    try:
        with frozen(pg_cluster):
            for op in (store.save_rows([row(2)]), store.get_task("TASK_1"), store.counts()):
                exc, took = await timed(op)
                assert isinstance(exc, TaskUnavailable), exc
                assert exc.status == 503 and exc.retry_after and "did not answer" in exc.message
                assert took < 6, took
        assert (await store.get_task("TASK_1")).id == "TASK_1"  # thawed: the pool recovers
        await store.save_rows([row(3)])
        assert (await store.counts())["tasks"] == 2
    finally:
        await store.close()


async def test_a_locked_table_is_a_503_locked_within_the_busy_timeout(pg_cluster, pg_url):
    store = Store(pg_url, busy_timeout=BUSY)
    await store.open()
    dbname = pg_url.rsplit("/", 1)[1]
    other = await asyncpg.connect(host="127.0.0.1", port=pg_cluster.port, user="postgres", database=dbname)
    try:
        tr = other.transaction()
        await tr.start()
        await other.execute("LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE")
        for op in (store.save_rows([row(1)]), store.get_task("TASK_1")):
            exc, took = await timed(op)
            assert isinstance(exc, TaskUnavailable) and "locked" in exc.message, exc
            assert BUSY * 0.9 < took < 4, took
        await tr.rollback()
        await store.save_rows([row(1)])  # the same connections, usable again
        assert (await store.get_task("TASK_1")).id == "TASK_1"
    finally:
        await other.close()
        await store.close()


def test_a_listener_that_never_answers_fails_the_start_within_the_bound_naming_it():
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", free_port()))
        lst.listen(8)  # accepts (the kernel's backlog), never answers
        port = lst.getsockname()[1]
        settings = Settings(db=f"postgresql://postgres:secret@127.0.0.1:{port}/rwkv", db_busy_timeout=BUSY)
        said: list[str | None] = []
        th = threading.Thread(target=lambda: said.append(database_open_problem(settings)), daemon=True)
        t0 = time.monotonic()
        th.start()
        th.join(10)
        assert not th.is_alive(), "the start-up check still waits on a server that never answers"
    assert time.monotonic() - t0 < 5
    line = said[0]
    assert line and "\n" not in line and "secret" not in line, line
    assert f"connecting to 127.0.0.1:{port} timed out after 1 s" in line, line


@pytest.mark.parametrize("query, says", [
    ("?sslmode=require", None), (f"?sslmode=verify-full&sslrootcert={__file__}&application_name=a", None),
    ("?sslmode=require&sslrootcert=/nonexistent/ca.pem", "?sslrootcert=/nonexistent/ca.pem: no such file"),
    ("?ssl=prefer&connect_timeout=5&dbname=x", None),
    ("?sslmode=sometimes", "?sslmode=sometimes: use one of disable, allow, prefer, require, verify-ca, verify-full"),
    ("?sslmode=require&foo=1", "unsupported option 'foo' in the URL's query"),
    ("?options=-c%20search_path%3Dtenant_a%20--work-mem%3D64MB", None),
    ("?options=-c%20lock_timeout%3D0", "?options: lock_timeout may not be set here: --db-busy-timeout"),
    ("?options=-c%20LOCK_TIMEOUT%3D0", "?options: lock_timeout may not be set here"),  # (names ignore case)
    ("?options=--statement-timeout%3D5s", "?options: statement_timeout may not be set here"),
    ("?options=-x", "?options: '-x' is not a server setting (use -c name=value)"),
    ("?gssencmode=disable", "unsupported option 'gssencmode'"),  # (libpq's; asyncpg has no such thing)
    # libpq's TCP options: set on the socket (test_pg_keepalive.py)
    ("?keepalives=1&keepalives_idle=30&keepalives_interval=10&keepalives_count=5&tcp_user_timeout=0", None),
    ("?keepalives=yes", "?keepalives=yes: use 1 (on, the default) or 0 (off)"),
    ("?keepalives_idle=-1", "?keepalives_idle=-1: must be a whole number of seconds from 0 (the system's) to 32767"),
    ("?keepalives_idle=40000", "?keepalives_idle=40000: must be a whole number of seconds"),  # (Linux: EINVAL)
    ("?keepalives_interval=1.5", "?keepalives_interval=1.5: must be a whole number of seconds"),
    ("?keepalives_count=many", "?keepalives_count=many: must be a whole number of probes from 0 (the system's) to 127"),
    ("?keepalives_count=%C2%B2", "?keepalives_count=\u00b2: must be a whole number of probes"),  # (a digit to isdigit)
    ("?tcp_user_timeout=99999999999", "?tcp_user_timeout=99999999999: must be a whole number of milliseconds"),
])
def test_libpq_url_options_are_taken_or_refused_in_one_line(query, says):
    pytest.importorskip("asyncpg")
    line = database_problem(f"postgresql://u:pw@db.example.com/rwkv{query}")
    if says is None:
        assert line is None
    else:
        assert line and says in line and "pw" not in line and "\n" not in line, line


async def test_sslmode_reaches_asyncpg_as_its_ssl_argument(pg_cluster, pg_url):
    # the throwaway cluster has no TLS: prefer and disable connect; require is refused by the server's answer
    store = Store(pg_url + "?sslmode=prefer&application_name=rwkv-test", busy_timeout=BUSY)
    await store.open()
    async with store.read() as conn:
        assert (await conn.exec_driver_sql("select current_setting('application_name')")).scalar() == "rwkv-test"
        assert (await conn.exec_driver_sql("select current_setting('lock_timeout')")).scalar() == "1s"
    await store.close()
    settings = Settings(db=pg_url + "?sslmode=require", db_busy_timeout=BUSY)
    line = await asyncio.to_thread(database_open_problem, settings)
    assert line and "cannot open the task database" in line and "SSL" in line and "TypeError" not in line, line


async def test_options_give_each_store_a_schema_of_its_own(pg_cluster, pg_url):
    """libpq's `options=-c search_path=...`: two stores on one database in two schemas (tables,
    migrations and tasks each its own), the lock bound still the server's."""
    dbname = pg_url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(host="127.0.0.1", port=pg_cluster.port, user="postgres", database=dbname)
    await admin.execute("CREATE SCHEMA tenant_a; CREATE SCHEMA tenant_b")
    try:
        managers = {}
        for schema in ("tenant_a", "tenant_b"):
            cfg = TaskConfig(db=f"{pg_url}?options=-c%20search_path%3D{schema}", db_busy_timeout=BUSY,
                             default_max_tokens=3)
            managers[schema] = tm = TaskManager(FakeEngine(), FakeTokenizer(), cfg, FakeShape())
            await tm.start()
            await tm.wait((await tm.create(f"in {schema}", persistent=True)).id, timeout=10)
            async with tm.store.read() as conn:
                got = (await conn.exec_driver_sql("select current_setting('search_path'), "
                                                  "current_setting('lock_timeout')")).one()
            assert tuple(got) == (schema, "1s")
        for schema, tm in managers.items():
            listed = (await tm.list())["tasks"]
            assert len(listed) == 1 and listed[0]["prompt_preview"] == f"in {schema}", listed
            await tm.close()
        tables = await admin.fetch("select table_schema, table_name from information_schema.tables "
                                   "where table_name = 'tasks'")
        assert sorted(r["table_schema"] for r in tables) == ["tenant_a", "tenant_b"]  # none in public
    finally:
        await admin.close()


async def test_a_migration_lock_holds_its_own_schema_only_and_is_waited_for_past_the_busy_timeout(
    pg_cluster, pg_url, caplog
):
    """Another server migrating schema tenant_a (its advisory lock held 3 s, thrice the busy
    timeout): a start in tenant_a waits for it, saying so, instead of failing after the busy
    timeout; a start in tenant_b does not wait at all (QA: one lock for every schema, given up
    after the busy timeout)."""
    from server.tasks.migrate import MIGRATION_LOCK

    dbname = pg_url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(host="127.0.0.1", port=pg_cluster.port, user="postgres", database=dbname)
    await admin.execute("CREATE SCHEMA tenant_a; CREATE SCHEMA tenant_b")
    holder = await asyncpg.connect(host="127.0.0.1", port=pg_cluster.port, user="postgres", database=dbname)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK}, hashtext('tenant_a'))")
        t0 = time.monotonic()
        b = Store(f"{pg_url}?options=-c%20search_path%3Dtenant_b", busy_timeout=BUSY)
        await b.open()  # another schema: not held up
        assert time.monotonic() - t0 < 2
        await b.close()
        asyncio.get_running_loop().call_later(3.0, lambda: asyncio.ensure_future(tx.commit()))
        a = Store(f"{pg_url}?options=-c%20search_path%3Dtenant_a", busy_timeout=BUSY)
        await a.open()  # waits for the other migration (3 s > the busy timeout), then opens
        assert time.monotonic() - t0 >= 2.9 and a.revision
        assert "another server is migrating schema 'tenant_a'" in caplog.text
        await a.close()
    finally:
        await holder.close()
        await admin.close()


async def test_a_database_that_takes_no_writes_or_a_missing_schema_is_refused_before_the_model_loads(pg_url):
    """A read-only database (a standby; here default_transaction_read_only) passed the start-up
    check when its schema was already at head, and failed after the model had loaded with a
    traceback and status 1 (QA). A schema that options names and that does not exist says so."""
    store = Store(pg_url, busy_timeout=BUSY)
    await store.open()  # migrated: a later open writes nothing
    await store.close()
    settings = Settings(db=f"{pg_url}?options=-c%20default_transaction_read_only%3Don", db_busy_timeout=BUSY)
    line = await asyncio.to_thread(database_open_problem, settings)
    assert line and "takes no writes (transaction_read_only is on)" in line and "\n" not in line, line
    assert await asyncio.to_thread(database_open_problem, Settings(db=pg_url, db_busy_timeout=BUSY)) is None
    settings = Settings(db=f"{pg_url}?options=-c%20search_path%3Dnosuch", db_busy_timeout=BUSY)
    line = await asyncio.to_thread(database_open_problem, settings)
    assert line and "search_path=... names must exist: CREATE SCHEMA it first" in line, line


def test_an_unknown_url_option_refuses_the_start_with_status_2(tmp_path):
    pytest.importorskip("asyncpg")
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--model", "synthetic:tiny",
                        "--db", "postgresql://u:pw@127.0.0.1:1/rwkv?sslmode=require&gssencmode=disable"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "unsupported option 'gssencmode'" in r.stderr and "TypeError" not in r.stderr, r.stderr[-2000:]


# --- a final row that cannot be committed: said once; not counted kept at shutdown ----------------
async def test_a_final_row_failing_is_logged_once_and_not_counted_kept_at_shutdown(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="server.tasks")
    tm = TaskManager(FakeEngine(), FakeTokenizer(), TaskConfig(db=str(tmp_path / "f.db"), default_max_tokens=3),
                     FakeShape())
    await tm.start()

    async def update_owned(rows, instance):
        raise TaskUnavailable("the task database is unreachable ([Errno 111] Connection refused); retry later")

    monkeypatch.setattr(tm.store, "update_owned", update_owned)
    t = await tm.create("abc", persistent=True)
    await asyncio.sleep(3)  # generated; its final row is retried again and again (backoff 0.1, 0.2, ... s)
    assert t.running
    said = [r for r in caplog.records if "could not be committed" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    await tm.close()
    lines = [r.getMessage() for r in caplog.records if "shutting down" in r.getMessage()]
    assert any("0 stored" in m and "1 not stored" in m for m in lines), lines
    assert not any("1 stored" in m for m in lines), lines
    assert any(t.id in m and "could not be committed" in m for m in lines), lines
