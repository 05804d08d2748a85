"""Faults of the task database (issue 22): a corrupt or undecodable state blob is rebuilt from the
task's tokens (never refused, never used); a truncated database file is refused with a clear
error; a lock held beyond the busy timeout, or a full disk, answers a retryable 503 with nothing
stored, nothing running and nothing listed, and a task whose final row could not be committed is
not shown finished until it is; a continue whose claim waited for the lock (or failed on it) is
not taken for a takeover by another instance; a writer killed in the middle of a state write
leaves the database as it was. Scripted engine (test/task_fakes.py), real SQLite files (and
PostgreSQL for the killed writer); one real server holding its lock against another connection."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from task_fakes import FakeEngine, FakeShape, FakeTokenizer, counted_state

from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures
from server.tasks import TaskConflict, TaskConfig, TaskManager, TaskUnavailable, pump
from server.tasks.codec import encode_state
from server.tasks.database import DatabaseDamaged
from server.tasks.records import FINISHED, RUNNING, Task, complete_interrupted, to_row
from server.tasks.statestore import state_row
from server.tasks.store import Store
from server.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]


async def manager(eng: FakeEngine, path, **kw) -> TaskManager:
    tm = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(path), default_max_tokens=3, **kw), FakeShape())
    await tm.start()
    return tm


async def stored_task(tm: TaskManager, prompt: str = "abc") -> Task:
    t = await tm.wait((await tm.create(prompt, persistent=True)).id, timeout=10)
    await tm.flush()
    assert t.state == "stored"
    return t


# --- a crash mid-run: the text of the last progress row ------------------------------------------
@pytest.mark.parametrize(
    "stored, shown",
    [
        ("<100><101>", "<100><101><102>"),  # the stream still held the last token's text: completed
        ("<100>x", "<100>x"),  # not what its tokens decode to (runs cut by a stop string): kept
    ],
)
async def test_a_task_a_crash_interrupted_shows_the_text_of_its_tokens(tmp_path, stored, shown):
    path = tmp_path / "c.db"
    tm = await manager(FakeEngine(), path)
    t = await stored_task(tm)
    assert t.out.text == "<100><101><102>"
    await tm.close()
    with sqlite3.connect(path) as conn:  # the row as a server killed mid-run left it
        conn.execute(
            "update tasks set status = ?, finish_reason = null, instance = 'gone', text = ? where id = ?",
            (RUNNING, stored, t.id),
        )
    tm = await manager(FakeEngine(), path)
    try:
        assert tm.interrupted == [t.id]
        after = await tm.get(t.id)
        assert (after.finish_reason, after.out.text) == ("interrupted", shown)
    finally:
        await tm.close()


def test_an_unfinished_character_shows_as_a_run_stopped_there_shows_it():
    tok = get_tokenizer()
    ids = tok.encode("ok ") + [229]  # 229: the byte 0xE4, the first of a 3-byte character
    t = Task(id="t", kind="task", tokens=array("i", ids), out_start=0)
    t.out.append("ok ", len(ids))  # the stream holds the lone byte back
    complete_interrupted(t, tok.decode)
    assert t.out.text == "ok \ufffd" == tok.decode(ids)


# --- broken state blobs: rebuilt ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flipped byte", "truncated blob", "garbage metadata", "wrong layout"])
async def test_a_broken_state_is_rebuilt_from_the_tokens_not_refused(tmp_path, damage):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "b.db")
    t = await stored_task(tm)
    sid = t.state_id
    await tm.close()
    with sqlite3.connect(tmp_path / "b.db") as conn:
        data, meta = conn.execute("select data, meta from states where id = ?", (sid,)).fetchone()
        if damage == "flipped byte":
            data = bytes([data[0] ^ 1]) + data[1:]
        elif damage == "truncated blob":
            data = data[:-8]
        elif damage == "garbage metadata":
            meta = "{not json"
        else:
            meta = meta.replace("rwkv7-state-v1", "rwkv7-state-v9")
        conn.execute("update states set data = ?, meta = ? where id = ?", (data, meta, sid))
    tm = await manager(eng, tmp_path / "b.db")
    try:
        loaded = await tm.get(t.id)
        assert loaded.state == "stored"  # not known to be broken until it is read
        c = await tm.wait((await tm.continue_(t.id, {"max_tokens": 2})).id, timeout=10)
        sub = eng.submissions[-1]
        assert sub.init_state is None and sub.prompt == list(t.tokens)  # the whole history, from zero
        assert tm.counters["state_corrupt"] == 1 and tm.counters["rebuilds"] == 1
        assert tm.counters["rebuild_tokens"] == len(t.tokens) - 1
        assert c.finish_reason == "length" and c.out.text == t.out.text + "<100><101>"
        await tm.flush()
        assert await tm.store.states.get_state(sid) is None  # the broken one is gone
        assert c.state == "stored" and await tm.store.states.get_state(c.state_id) is not None
    finally:
        await tm.close()


async def test_a_state_of_another_model_is_still_refused(tmp_path):
    """Not a corruption: the task was made with another model; continuing it here would mix two
    models in one history."""
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "m.db")
    t = await stored_task(tm)
    tm.cache.discard(t.state_id)
    tm.persistence.reads.signature = "another-model"
    with pytest.raises(TaskConflict, match="model shape"):
        await tm.continue_(t.id, {"max_tokens": 1})
    assert not (await tm.get(t.id)).running
    await tm.close()


async def test_a_state_on_a_damaged_database_page_is_rebuilt(tmp_path):
    """The page chain of a large state blob is broken (SQLite: "database disk image is
    malformed" when it is read): the state is taken as lost and rebuilt; the rest works."""
    import torch

    from server.model.state import State

    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "p.db")
    t = await stored_task(tm)
    big = State(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.arange(65536.0).view(1, 1, 1, 256, 256))  # 256 KiB
    enc = encode_state(big, FakeShape().signature())
    async with tm.store.write() as conn:
        await conn.execute(sa.text("DELETE FROM states"))
    await tm.store.save(None, state_row(t.stored_id, t.id, enc, False))
    await tm.close()
    with sqlite3.connect(tmp_path / "p.db") as conn:
        conn.execute("pragma wal_checkpoint(truncate)")
        page = conn.execute("pragma page_size").fetchone()[0]
    raw = bytearray((tmp_path / "p.db").read_bytes())
    at = raw.find(bytes(enc.data[3 * page:3 * page + 64]))  # inside one of the blob's overflow pages
    assert at > 0
    start = (at // page) * page
    raw[start:start + 4] = (2**31 - 5).to_bytes(4, "big")  # the next-page pointer of the chain
    (tmp_path / "p.db").write_bytes(bytes(raw))
    tm = await manager(eng, tmp_path / "p.db")
    try:
        c = await tm.wait((await tm.continue_(t.id, {"max_tokens": 1})).id, timeout=10)
        assert eng.submissions[-1].init_state is None and tm.counters["state_corrupt"] == 1
        assert c.out.text == t.out.text + "<100>" and tm.counters["rebuilds"] == 1
    finally:
        await tm.close()


# --- a truncated database file ---------------------------------------------------------------------
async def test_a_truncated_database_file_is_refused_with_a_clear_error(tmp_path):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "ok.db")
    for i in range(20):
        await stored_task(tm, f"task {i}")
    await tm.close()
    with sqlite3.connect(tmp_path / "ok.db") as conn:
        conn.execute("pragma wal_checkpoint(truncate)")
    size = os.path.getsize(tmp_path / "ok.db")
    for frac in (0.9, 0.5, 0.02):
        bad = tmp_path / f"cut{frac}.db"
        shutil.copy(tmp_path / "ok.db", bad)
        with open(bad, "r+b") as f:
            f.truncate(int(size * frac))
        store = Store(str(bad))
        with pytest.raises(DatabaseDamaged, match=r"is damaged \(database disk image is malformed\).*recover"):
            await store.open()
        assert os.path.getsize(bad) == int(size * frac)  # untouched
    tm = await manager(eng, tmp_path / "ok.db")  # the intact file still opens, all there
    assert (await tm.store.counts())["tasks"] == 20
    await tm.close()


# --- a lock held beyond the busy timeout -------------------------------------------------------------
async def test_a_lock_beyond_the_busy_timeout_is_a_503_that_leaves_nothing(tmp_path):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "l.db", db_busy_timeout=0.3)
    done = await stored_task(tm)
    other = sqlite3.connect(tmp_path / "l.db", isolation_level=None)  # another process's writer
    other.execute("BEGIN IMMEDIATE")
    try:
        n = len(eng.submissions)
        with pytest.raises(TaskUnavailable) as e:
            await tm.create("blocked", persistent=True)
        assert e.value.status == 503 and e.value.retry_after and "busy timeout" in e.value.message
        assert len(eng.submissions) == n + 1 and eng.handles[-1].aborted  # submitted, then aborted unread
        with pytest.raises(TaskUnavailable):
            await tm.continue_(done.id, {"max_tokens": 1})
        assert not done.running and done.out.text == "<100><101><102>" and len(done.tokens) == 6
        listing = await tm.list()  # reads still work (WAL)
        assert listing["database_count"] == 1 and [x["task_id"] for x in listing["tasks"]] == [done.id]
        assert not [t for t in tm.live.values() if t.running]
    finally:
        other.execute("ROLLBACK")
        other.close()
    t = await tm.wait((await tm.create("after", persistent=True)).id, timeout=10)  # the lock is gone: fine
    assert t.finish_reason == "length"
    await tm.close()


async def test_a_continue_refused_by_a_lock_is_not_logged_as_a_takeover(tmp_path, monkeypatch, caplog):
    """The continue's claim fails on the lock (503); the progress job queued behind it ran before
    the start was undone, with the continued task's row in it, and, the lock gone, committed: the
    row (never claimed) was refused and logged as "taken over by another instance" on a server
    that has no other instance. Progress rows are now only those of runs whose start row is
    committed."""
    monkeypatch.setattr(pump, "PROGRESS_INTERVAL", 0.0)  # a progress job at each batch
    tm = await manager(FakeEngine(), tmp_path / "c.db", db_busy_timeout=1.0)
    done = await stored_task(tm)
    other = sqlite3.connect(tmp_path / "c.db", isolation_level=None)  # another process's writer
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(TaskUnavailable):
            await tm.continue_(done.id, {"max_tokens": 3})
    finally:
        other.execute("ROLLBACK")  # at once: the job behind the claim gets the lock
        other.close()
    await tm.flush()
    assert "taken over" not in caplog.text, caplog.text
    assert not done.running and done.out.text == "<100><101><102>" and done.instance is None
    row = await tm.store.get_task(done.id)
    assert row.status == FINISHED and row.instance is None and row.completion_tokens == 3
    c = await tm.wait((await tm.continue_(done.id, {"max_tokens": 2})).id, timeout=10)  # the lock gone: fine
    assert c.out.text == "<100><101><102><100><101>" and "taken over" not in caplog.text
    await tm.close()


def test_a_continue_claimed_during_a_lock_is_not_logged_as_a_takeover(tmp_path):
    """QA's repro on a real server: another connection holds the SQLite write lock (3.5 s, under
    --db-busy-timeout 5) while a long task runs, and a finished task is continued. A progress job
    of the long task waits for the lock, the next one is queued behind it, then the continue's
    claim. Once the lock was gone, that progress job held the continued task's row, not yet
    claimed: refused, and logged "1 running task(s) were taken over by another instance" on a
    server alone on its database. Now the continue answers 200 once its claim commits, the task
    ends with its 3 new tokens, committed, and the log has no takeover."""
    from util_server import running_server, task_result, wait_committed

    with (running_server(tmp_path, args=("--db-busy-timeout", "5")) as srv,
          httpx.Client(base_url=srv.url, timeout=60) as c):  # fmt: skip
        fin = c.post("/v1/tasks/create", json={"prompt": "fin", "max_tokens": 5}).json()["task_id"]
        before = task_result(c, fin)
        long = c.post("/v1/tasks/create", json={"prompt": "long", "max_tokens": 100000}).json()["task_id"]
        wait_committed(srv.db, long)  # its progress rows are flowing
        other = sqlite3.connect(srv.db, isolation_level=None, timeout=30, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        release = threading.Thread(target=lambda: (time.sleep(3.5), other.execute("ROLLBACK")))
        release.start()
        try:
            time.sleep(2.5)  # a progress job waits for the lock (from within 1 s), the next is queued (1 s on)
            r = c.post(f"/v1/tasks/{fin}/continue", json={"max_tokens": 3})
        finally:
            release.join()
            other.close()
        assert r.status_code == 200, r.text
        after = task_result(c, fin)
        assert after["finish_reason"] == "length" and after["completion_tokens"] == before["completion_tokens"] + 3
        row = wait_committed(srv.db, fin, lambda row: row["status"] == FINISHED and row["instance"] is None)
        assert row["completion_tokens"] == after["completion_tokens"] and row["text"] == after["result"]
        assert c.post(f"/v1/tasks/{long}/stop", json={}).status_code == 200
        assert task_result(c, long)["finish_reason"] == "stopped"
        log = srv.log_path.read_text(errors="replace")
        assert "taken over" not in log, srv.log_tail()


# --- a full disk -------------------------------------------------------------------------------------
SQLITE_SAYS = {
    "sqlite": "database or disk is full",
    "io": "disk I/O error",  # a failing disk, or a file made immutable under the server
    "readonly": "attempt to write a readonly database",  # permissions taken away, a read-only remount
}


async def disk_full(store: Store, how: str = "errno") -> None:
    """Fail a write transaction as a full disk does: an OSError(ENOSPC) from the file, or
    SQLite's own words (SQLITE_SAYS: full, or a disk it cannot write now)."""
    async with store.write():
        if how == "errno":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError(SQLITE_SAYS[how]))


@pytest.mark.parametrize("how, says", [("errno", "disk is full"), ("sqlite", "disk is full"),
                                       ("io", "cannot be written now \\(disk i/o error"),
                                       ("readonly", "cannot be written now")])
async def test_a_full_disk_refuses_new_tasks_and_never_shows_an_uncommitted_finish(tmp_path, monkeypatch, how, says):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "f.db")
    real_rows, real_owned = tm.store.save_rows, tm.store.update_owned
    full = {"on": True}

    async def save_rows(rows):
        return await (disk_full(tm.store, how) if full["on"] else real_rows(rows))

    async def update_owned(rows, instance):
        return await (disk_full(tm.store, how) if full["on"] else real_owned(rows, instance))

    monkeypatch.setattr(tm.store, "save_rows", save_rows)
    with pytest.raises(TaskUnavailable, match=says) as e:
        await tm.create("nowhere to go", persistent=True)
    assert e.value.status == 503 and eng.handles[-1].aborted
    assert (await tm.list())["tasks"] == [] and not tm.live
    full["on"] = False
    t = await tm.create("finishes on a full disk", persistent=True)
    monkeypatch.setattr(tm.store, "update_owned", update_owned)
    full["on"] = True
    await asyncio.sleep(0.5)  # generated; its final row fails again and again
    assert t.running and not t.out.finished and t.response()["finished"] is False
    assert (await tm.store.get_task(t.id)).status != FINISHED
    full["on"] = False  # space again: the retried row commits, the task shows finished
    await tm.wait(t.id, timeout=10)
    assert not t.running and (await tm.store.get_task(t.id)).status == FINISHED
    await tm.flush()
    assert t.state == "stored" and await tm.store.states.get_state(t.state_id) is not None
    await tm.close()


async def test_a_final_row_refused_for_good_is_said_so_not_blamed_on_another_server(tmp_path, monkeypatch):
    """A final row that fails for a reason no retry helps (a bug) ends the run "error"; the stored
    row still says running on this server, so a continue is refused naming what happened, not
    "running on instance <this one>; continue it there"."""
    tm = await manager(FakeEngine(), tmp_path / "bug.db")

    async def update_owned(rows, instance):
        raise ValueError("a bug in the final row")

    monkeypatch.setattr(tm.store, "update_owned", update_owned)
    t = await tm.wait((await tm.create("abc", persistent=True)).id, timeout=10)
    assert t.finish_reason == "error" and "could not be stored" in t.out.error
    with pytest.raises(TaskConflict, match="last run could not be stored") as e:
        await tm.continue_(t.id, {"max_tokens": 2})
    assert e.value.code == "task_conflict"
    await tm.close()


async def test_a_delete_that_cannot_commit_leaves_the_task_as_it_was(tmp_path, monkeypatch):
    # A delete during an outage used to leave the task marked deleted in memory: its queued final
    # row was then skipped, and the row stayed "running" (with only its last progress text) until
    # a restart; continue, stop and stream all refused it.
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "d.db")
    real_owned, real_delete = tm.store.update_owned, tm.store.delete_task
    full = {"on": False}

    async def update_owned(rows, instance):
        return await (disk_full(tm.store) if full["on"] else real_owned(rows, instance))

    async def delete_task(task_id, instance=None):
        return await (disk_full(tm.store) if full["on"] else real_delete(task_id, instance))

    monkeypatch.setattr(tm.store, "update_owned", update_owned)
    monkeypatch.setattr(tm.store, "delete_task", delete_task)
    done = await stored_task(tm)
    full["on"] = True
    t = await tm.create("finishes during the outage", persistent=True)
    await asyncio.sleep(0.3)  # generated; its final row is being retried
    assert t.running and t.pending_writes > 0
    for task in (t, done):
        with pytest.raises(TaskUnavailable):
            await tm.delete(task.id)
        assert not task.deleted and (await tm.get(task.id)) is task
    full["on"] = False  # the database is back: the final row commits, the task is whole
    await tm.wait(t.id, timeout=10)
    row = await tm.store.get_task(t.id)
    assert not t.running and row.status == FINISHED and t.out.text == "<100><101><102>"
    assert {x["task_id"] for x in (await tm.list())["tasks"]} == {t.id, done.id}
    await tm.wait((await tm.continue_(t.id, {"max_tokens": 1})).id, timeout=10)  # usable
    for task in (t, done):
        await tm.delete(task.id)
        assert await tm.store.get_task(task.id) is None
    await tm.close()


async def test_a_state_write_on_a_full_disk_is_retried_and_the_task_stays_usable(tmp_path, monkeypatch):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "s.db")
    real = tm.store.states.store_state
    fails = {"n": 3}

    async def store_state(*a):
        if fails["n"]:
            fails["n"] -= 1
            await disk_full(tm.store)
        return await real(*a)

    monkeypatch.setattr(tm.store.states, "store_state", store_state)
    t = await tm.wait((await tm.create("abc", persistent=True)).id, timeout=10)
    assert t.finish_reason == "length" and t.state in ("cached", "stored")  # shown: its row is in
    await tm.flush()
    assert fails["n"] == 0 and t.state == "stored" and await tm.store.states.get_state(t.state_id) is not None
    await tm.close()


# --- a writer killed in the middle of a state write ----------------------------------------------------
_KILLED_WRITER = """
import asyncio, sys, torch
sys.path.insert(0, "test")
from task_fakes import counted_state
from server.tasks import statestore
from server.tasks.codec import encode_state
from server.tasks.store import Store

async def stuck(conn, state_id):
    print("IN THE MIDDLE", flush=True)
    await asyncio.sleep(600)

async def main():
    s = Store(sys.argv[1])
    await s.open()
    statestore.drop_state_if_unused = stuck  # after the insert and the row update, before the commit
    big = counted_state(5)
    enc = encode_state(big, "fake-L1-C4-H1-N4")
    await s.states.store_state("TASK_x", statestore.state_row("S_new", "TASK_x", enc, False), 5)

asyncio.run(main())
"""


async def test_a_writer_killed_mid_state_write_leaves_the_database_as_it_was(tmp_path, db_url):  # noqa: F811
    store = Store(db_url)
    await store.open()
    t = Task(id="TASK_x", kind="task", stored_id="S_old", stored_pos=2)
    t.tokens.extend([1, 2, 3, 4, 5, 6])
    await store.save(to_row(t), state_row("S_old", t.id, encode_state(counted_state(2), "fake-L1-C4-H1-N4"), False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, db_url], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "IN THE MIDDLE", proc.stderr.read()
    finally:
        proc.kill()
        proc.wait(30)
    row = await store.get_task("TASK_x")
    assert (row.state_id, row.state_pos) == ("S_old", 2)  # the killed transaction left nothing
    assert await store.states.get_state("S_new") is None and await store.states.get_state("S_old") is not None
    stored, _ = await asyncio.wait_for(  # and holds no lock: the next writer goes through
        store.states.store_state("TASK_x", state_row("S_new", "TASK_x", encode_state(counted_state(5), "fake-L1-C4-H1-N4"), False), 5), 10)
    assert stored and (await store.get_task("TASK_x")).state_id == "S_new"
    assert await store.states.get_state("S_old") is None
    await store.close()


async def test_a_final_row_that_cannot_be_stored_unpins_the_runs_new_state(tmp_path, monkeypatch):
    """A final row refused for good (not a transient fault) ends the task with an error; its
    run's new state, pinned until that row committed, goes back to the cache's care (was kept
    pinned for ever: never evicted, never written)."""
    tm = await manager(FakeEngine(), tmp_path / "f.db")
    try:
        async def refuse(rows, instance):
            raise ValueError("a row the database refuses")

        monkeypatch.setattr(tm.store, "update_owned", refuse)
        t = await tm.wait((await tm.create("abc", persistent=True)).id, timeout=10)
        assert t.finish_reason == "error" and "could not be stored" in (t.out.error or "")
        assert not [k for k in tm.persistence.cache.pinned_keys() if k.startswith(t.id + ":")]
    finally:
        monkeypatch.undo()
        await tm.close()
