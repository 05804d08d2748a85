"""A damaged SQLite task database (docs/deployment.md, Faults): a damaged page of any table or
index is refused when the store opens, so `serve` stops at its start-up check with one line
naming the file and `sqlite3 <file> .recover`, status 2, before the model loads, and the file is
left as it was; an index whose entries are not its table's rows too. A page damaged while the
server runs is said once in the log (the file, the salvage command), never as SQLAlchemy's SQL
dump per write: a request answers 503 `database_unavailable`, a state write is dropped (its task
is rebuilt from its tokens). (A damaged page of a state blob is not refused: the state is
rebuilt when it is read, test_persist_faults.py.) Scripted engine (test/task_fakes.py), real
SQLite files; one real `serve` start-up check."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

from server.tasks import TaskConfig, TaskManager
from server.tasks.database import DamagedPage, DatabaseDamaged
from server.tasks.store import Store

ROOT = Path(__file__).resolve().parents[1]


async def manager(path: Path) -> TaskManager:
    tm = TaskManager(FakeEngine(), FakeTokenizer(), TaskConfig(db=str(path), default_max_tokens=3), FakeShape())
    await tm.start()
    return tm


@pytest.fixture(scope="module")
def good_db(tmp_path_factory) -> Path:
    """A closed database with 3 stored tasks and their states (every table and index has rows)."""
    import asyncio

    path = tmp_path_factory.mktemp("damage") / "good.db"

    async def fill() -> None:
        tm = await manager(path)
        for i in range(3):
            await tm.wait((await tm.create(f"task {i}", persistent=True)).id, timeout=10)
        await tm.flush()
        await tm.close()

    asyncio.run(fill())
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert conn.execute("SELECT count(*) FROM states").fetchone()[0] == 3
    return path


def root_page(path: Path, name: str) -> tuple[int, int]:
    """(the file offset of the root page of table or index `name`, the page size)."""
    with closing(sqlite3.connect(path)) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()
    return (root - 1) * page, page


def damage(path: Path, name: str) -> None:
    """Write 16 bytes of 0xFF over the b-tree page header of `name`'s root page (one page)."""
    at, _ = root_page(path, name)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 16)


TREES = ["tasks", "sqlite_autoindex_tasks_1", "ix_tasks_status", "ix_tasks_owner_tag", "ux_tasks_named", "states",
         "sqlite_autoindex_states_1", "ix_states_task", "ix_states_evict", "instances", "alembic_version"]  # fmt: skip


@pytest.mark.parametrize("tree", TREES)
async def test_a_damaged_page_of_any_table_or_index_is_refused_at_open(good_db, tmp_path, tree):
    """Before the fix only the schema's version was read at open: a damaged tasks page ended the
    server once the model had loaded, a damaged states index let it serve with every state
    write failing."""
    bad = tmp_path / f"{tree}.db"
    shutil.copy(good_db, bad)
    damage(bad, tree)
    before = bad.read_bytes()
    store = Store(str(bad))
    with pytest.raises(DatabaseDamaged) as e:
        await store.open()
    msg = str(e.value)
    assert f"the task database {bad} is damaged (database disk image is malformed)" in msg, msg
    assert f"`sqlite3 {bad} .recover | sqlite3 recovered.db`" in msg and "\n" not in msg and "[SQL" not in msg
    assert store.engine is None and bad.read_bytes() == before  # nothing changed
    assert not os.path.exists(f"{bad}-wal") or os.path.getsize(f"{bad}-wal") == 0


async def test_an_index_whose_entries_are_not_its_rows_is_refused(good_db, tmp_path):
    """ix_states_task made to name the tree of ix_tasks_status (3 entries) while states holds 2
    rows: every page reads fine, the index is wrong all the same."""
    bad = tmp_path / "index.db"
    shutil.copy(good_db, bad)
    with closing(sqlite3.connect(bad, isolation_level=None)) as conn:
        conn.execute("DELETE FROM states WHERE id = (SELECT min(id) FROM states)")
        (status_root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'ix_tasks_status'").fetchone()
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET rootpage = ? WHERE name = 'ix_states_task'", (status_root,))
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with pytest.raises(DatabaseDamaged, match=r"index ix_states_task has 3 entries for 2 rows of states.*recover"):
        await Store(str(bad)).open()
    store = Store(str(good_db))  # the intact file opens
    await store.open()
    assert await store.counts() == {"tasks": 3, "states": 3}
    await store.close()


def test_serve_on_a_damaged_file_stops_with_one_line_before_the_model_loads(good_db, tmp_path):
    """QA's repro: the tasks table's page damaged. It used to pass the start-up check, load the
    model, then end with status 1 and SQLAlchemy's multi-line dump."""
    bad = tmp_path / "bad.db"
    shutil.copy(good_db, bad)
    damage(bad, "tasks")
    before = bad.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu"}
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--model", "synthetic:tiny",
                        "--db", str(bad)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"rwkv-server: --db {bad}: the task database {bad} is damaged"), lines[0]
    assert f"sqlite3 {bad} .recover" in lines[0] and "[SQL" not in r.stderr
    assert bad.read_bytes() == before


def damage_while_open(path: Path, name: str) -> None:
    """Damage `name`'s root page under an open store: its pages are checkpointed into the file
    first; a commit of another connection then makes the store's connections drop the pages
    they cache (SQLite re-reads the file after another writer's commit)."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
        damage(path, name)
        conn.execute("UPDATE alembic_version SET version_num = version_num")


async def test_a_page_damaged_while_serving_is_said_once_not_per_write(good_db, tmp_path, caplog):
    """The states index damaged while the server runs: each state write fails. It used to log
    an error with SQLAlchemy's traceback and SQL for every write; now the store says once that
    the file is damaged and how to salvage it, and each write is dropped (counted), its task
    finished as usual and rebuilt from its tokens when continued. Then the tasks' primary key
    damaged too: a create answers 503 database_unavailable saying the database is damaged,
    without SQL, and nothing more is logged at error."""
    path = tmp_path / "live.db"
    shutil.copy(good_db, path)
    tm = await manager(path)
    try:
        damage_while_open(path, "ix_states_task")
        caplog.set_level(logging.DEBUG, logger="server")
        done = []
        for i in range(3):
            t = await tm.wait((await tm.create(f"after {i}", persistent=True)).id, timeout=10)
            await tm.flush()
            assert t.finish_reason == "length" and t.out.text == "<100><101><102>" and t.state != "stored"
            done.append(t)
        assert tm.counters["state_writes_dropped"] == 3 and tm.counters["state_writes"] == 0

        damage_while_open(path, "sqlite_autoindex_tasks_1")
        with pytest.raises(DamagedPage) as e:
            await tm.create("refused", persistent=True)
        assert e.value.status == 503 and e.value.code == "database_unavailable" and e.value.retry_after is None
        assert "task database is damaged (database disk image is malformed)" in e.value.message
        assert "[SQL" not in e.value.message and str(path) not in e.value.message  # (the path: the log's)
    finally:
        await tm.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage()[:300] for r in errors]
    said = errors[0].getMessage()
    assert f"the task database {path} is damaged (database disk image is malformed)" in said
    assert f"`sqlite3 {path} .recover | sqlite3 recovered.db`" in said and "\n" not in said
    for r in caplog.records:
        assert "[SQL" not in r.getMessage() and r.exc_info is None, r.getMessage()[:500]
