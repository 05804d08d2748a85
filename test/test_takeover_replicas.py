"""Tasks changing hands among replicas (server.tasks.takeover, server.tasks.lease), with real
servers on one SQLite file and on one PostgreSQL database (test/pg_util.py).

1. A server paused past its lease (SIGSTOP) is taken over by the other; the creates it answers as
   it wakes (200, their rows committed after it registered again) run on: they used to end
   `interrupted` after a token, because the takeover read which rows were still its own before
   those rows were committed, and stopped every task it did not find.
2. A second server started under the --instance-name of a live one is refused (status 2, one
   line) and leaves the live one's tasks alone; it used to take the name over at once (the
   live server's running task marked interrupted, both then running under one name). A crashed
   holder's name is taken once its lease has expired; a restart after a clean shutdown does not
   wait.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from pg_util import pg_cluster, pg_url  # noqa: F401 - fixtures
from util_server import ServerProcess

from server.engine.types import SamplingParams
from server.tasks.records import RUNNING, TASK, Run, Task
from server.tasks.table import TaskTable
from server.tasks.takeover import Takeover

LEASE = 1.5
LONG = {"max_tokens": 100000, "ignore_eos": True}


# Each test runs on one of the two stores (its rule is the store's either way; the suite's time):
# the paused takeover on a SQLite file, the name refusal and the stalled row lock on PostgreSQL.


def server(tmp_path, d: str, db: str, name: str, lease: float = LEASE) -> ServerProcess:
    srv = ServerProcess(tmp_path / d, db=db)
    srv.env.update(RWKV_LEASE_TIMEOUT=str(lease), RWKV_INSTANCE_NAME=name, RWKV_MAX_BATCH="16")
    return srv


def result(srv: ServerProcess, tid: str) -> dict:
    return httpx.get(f"{srv.url}/v1/tasks/{tid}/get_result", timeout=30).json()


def until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


# --- 1. tasks acknowledged just after a takeover run on -------------------------------------------


def test_tasks_answered_as_a_paused_server_wakes_after_a_takeover_run_on(tmp_path):
    db = str(tmp_path / "shared.db")
    d, e = server(tmp_path, "d", db, "rD"), server(tmp_path, "e", db, "rE")
    try:
        d.start()
        e.start()
        for rnd in range(2):
            old = httpx.post(d.url + "/v1/tasks/create", json={"prompt": f"old {rnd}", **LONG}, timeout=30).json()
            old = old["task_id"]
            until(lambda: result(d, old)["completion_tokens"] > 0, 30, "the old task never generated")
            pause_until_taken(d, e, old)

            async def creates() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=60) as c:
                    body = {"max_tokens": 30, "ignore_eos": True}
                    sent = [c.post(d.url + "/v1/tasks/create", json={"prompt": f"new {rnd} {i}", **body})
                            for i in range(4)]  # fmt: skip
                    answers = asyncio.gather(*sent)
                    await asyncio.sleep(0.05)  # the requests wait in d's socket, then d wakes
                    d.resume()
                    return list(await answers)

            answers = asyncio.run(creates())
            assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
            for r in answers:
                tid = r.json()["task_id"]
                until(lambda tid=tid: result(d, tid)["finished"], 60, f"{tid} never finished")
                done = result(d, tid)
                # acknowledged after the takeover: it runs on (it used to end interrupted at once)
                assert done["finish_reason"] == "length" and done["completion_tokens"] == 30, (done, d.log_tail())
            # the task the other replica took over ends interrupted on d too, and d says so
            until(lambda: result(d, old)["finished"], 30, "the old task kept running on d")
            assert result(d, old)["finish_reason"] == "interrupted"
        assert "another instance took over" in d.log_tail(400), d.log_tail()
    finally:
        d.resume()
        d.stop()
        e.stop()


def pause_until_taken(d: ServerProcess, e: ServerProcess, tid: str) -> None:
    """SIGSTOP d until e has taken d for dead (d's running task `tid` reads interrupted on e). A
    pause that caught d inside a write transaction holds e's reaper up: then d runs a moment and
    is paused again."""
    for _ in range(3):
        d.pause()
        end = time.monotonic() + LEASE * 4 / 3 + 4
        while time.monotonic() < end:
            if result(e, tid)["finished"]:
                return
            time.sleep(0.05)
        d.resume()
        time.sleep(0.3)
    raise AssertionError(f"e never took the paused d for dead\n{e.log_tail()}")


async def test_a_run_is_judged_by_its_row_once_that_row_is_committed():
    # The takeover read which rows this instance still held at once: a run whose start row was
    # still in the writer's queue was not found, and stopped, although its row (committed right
    # after) named this instance and nobody had taken it.
    class Rows:
        def __init__(self) -> None:
            self.ours: set[str] = set()
            self.reads = 0

        async def held_by(self, ids: list[str], instance: str) -> set[str]:
            self.reads += 1
            return self.ours & set(ids)

    loop = asyncio.get_running_loop()

    def running(task_id: str, started: asyncio.Future | None) -> Task:
        t = Task(id=task_id, kind=TASK, status=RUNNING)
        t.run = Run(pos=0, n_input=1, params=SamplingParams(), key=None, started=started)
        table.live[t.id] = t
        return t

    table, rows, aborted = TaskTable(), Rows(), []
    taken = running("TASK_taken", loop.create_future())  # committed before the takeover, not ours now
    taken.run.started.set_result(None)
    writing = running("TASK_writing", loop.create_future())  # its start row is being committed
    later = running("TASK_later", None)  # its start row not queued yet: written after the new registration
    takeover = Takeover(table, rows, "inst-1", aborted.append)
    takeover.lost()
    await asyncio.sleep(0.05)
    assert aborted == [taken] and taken.interrupted  # the committed row that is not ours any more
    rows.ours.add(writing.id)  # its row commits, naming this instance
    writing.run.started.set_result(None)
    await asyncio.gather(*takeover.background)
    assert aborted == [taken] and not writing.interrupted and not later.interrupted


# --- 2. a second server under a live server's name ---------------------------------------------------


def started_or_exited(srv: ServerProcess, timeout: float = 90) -> int | None:
    """The exit status of srv (started), or None once it answers /health 200."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if srv.proc.poll() is not None:
            return srv.proc.returncode
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"neither started nor exited\n{srv.log_tail()}")


def test_a_start_under_the_name_of_a_live_server_is_refused(tmp_path, pg_url):
    db = pg_url
    # a long lease: a paused holder is still within it when b looks, so b watches its row
    a, b = server(tmp_path, "a", db, "rA", lease=10), server(tmp_path, "b", db, "rA", lease=10)
    try:
        a.start()
        tid = httpx.post(a.url + "/v1/tasks/create", json={"prompt": "long", **LONG}, timeout=30).json()["task_id"]
        until(lambda: result(a, tid)["completion_tokens"] > 0, 30, "the task never generated")
        a.pause()  # a stalls (its heartbeat stops) as b starts: b sees a heartbeat within the lease
        b.start(wait=False)
        try:
            until(lambda: "watching its lease row" in b.log_tail(), 20, "")
        except AssertionError:  # (a was paused inside a write: b waited for the lock; or the old code)
            pass
        a.resume()  # a's heartbeat comes, late: a is alive
        assert started_or_exited(b) == 2, b.log_tail()
        last = b.log_tail(1)
        assert last.startswith("rwkv-server: --instance-name rA: another live server uses this name"), last
        assert "choose another --instance-name" in last
        assert not result(a, tid)["finished"]  # a's task runs on, untouched
        assert "lease had expired" not in a.log_tail(300), a.log_tail()
        # and with a running normally, a second start is refused without a pause
        b.start(wait=False)
        assert started_or_exited(b) == 2, b.log_tail()
        assert not result(a, tid)["finished"] and "lease had expired" not in a.log_tail(300)
    finally:
        a.resume()
        a.stop()
        b.stop()


def test_a_name_taken_while_the_model_loads_is_refused_in_one_line(tmp_path):
    """b passes the CLI's check, then a starts under the same name while b loads its model: b's
    task store finds a live a and refuses as the check would (status 2, one line), not as a
    failed load (status 1, a traceback)."""
    db = str(tmp_path / "one.db")
    a, b = server(tmp_path, "a", db, "rA", lease=3), server(tmp_path, "b", db, "rA", lease=3)
    b.env["RWKV_DEBUG_LOAD_DELAY"] = "4"  # (a test hook: sleep before loading the model)
    try:
        b.start(wait=False)
        time.sleep(1.5)  # b is past its check, asleep in its load
        a.start()
        assert started_or_exited(b) == 2, b.log_tail()
        last = b.log_tail(1)
        assert last.startswith("rwkv-server: --instance-name rA: another live server uses this name"), last
        assert "Traceback" not in b.log_tail(200), b.log_tail()
        assert httpx.get(a.url + "/health", timeout=10).status_code == 200
    finally:
        a.stop()
        b.stop()


def test_a_crashed_holders_name_is_taken_once_its_lease_expired_a_clean_one_at_once(tmp_path):
    db, lease = str(tmp_path / "one.db"), 10.0  # longer than b's start takes to look
    a, b = server(tmp_path, "a", db, "rA", lease=lease), server(tmp_path, "b", db, "rA", lease=lease)
    try:
        a.start()
        tid = httpx.post(a.url + "/v1/tasks/create", json={"prompt": "long", **LONG}, timeout=30).json()["task_id"]
        until(lambda: result(a, tid)["completion_tokens"] > 0, 30, "the task never generated")
        a.kill()  # a crash: its lease row stays, its heartbeat stops
        b.start()
        log = b.log_tail(300)
        assert "watching its lease row" in log and "stayed silent for its lease timeout" in log, log
        assert "1 task(s) were running when their server stopped" in log, log
        assert result(b, tid)["finish_reason"] == "interrupted"
        b.stop()  # a clean shutdown deletes its lease row: the next start does not wait
        b.start()
        since = b.log_path.read_text().rsplit("===== start #", 1)[1]
        assert "watching its lease row" not in since, since
    finally:
        a.stop()
        b.stop()


# --- 3. a stalled server's row lock holds no other server's lease -----------------------------------


def test_a_row_a_stalled_server_holds_leaves_the_others_leases_and_tasks_alone(tmp_path, pg_url):
    """X is paused while a transaction of its own holds its running task's row (here: the test's
    connection, as X frozen inside a progress write would). Z's and W's heartbeats must still
    renew their leases (they used to wait on that row with the renewal uncommitted, so the first
    to run after the lock went took the other for dead and interrupted its task), and X's task is
    reaped once its row is free."""
    import asyncpg

    lease = 2.5  # (above LEASE: three servers on a loaded machine must not lose a lease by a slow beat)
    srv = {n: server(tmp_path, n.lower(), pg_url, n, lease=lease) for n in ("X", "Z", "W")}
    for s in srv.values():
        s.env["RWKV_DB_BUSY_TIMEOUT"] = "1"
    try:
        for s in srv.values():
            s.start()
        tid = {n: httpx.post(s.url + "/v1/tasks/create", json={"prompt": n, **LONG}, timeout=30).json()["task_id"]
               for n, s in srv.items()}  # fmt: skip
        until(lambda: all(result(srv[n], tid[n])["completion_tokens"] > 0 for n in srv), 30, "a task never ran")

        async def hold_x_row(seconds: float) -> None:
            conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
            try:
                async with conn.transaction():
                    await conn.execute("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE", tid["X"])
                    srv["X"].pause()
                    await asyncio.sleep(seconds)
            finally:
                await conn.close()

        asyncio.run(hold_x_row(lease * 4))
        for _ in range(3):  # (a pause that caught X inside a write of its own holds its rows: X runs a moment)
            try:
                until(lambda: result(srv["Z"], tid["X"])["finish_reason"] == "interrupted", lease * 3 + 3, "")
                break
            except AssertionError:
                srv["X"].resume()
                time.sleep(0.05)
                srv["X"].pause()
        assert result(srv["Z"], tid["X"])["finish_reason"] == "interrupted", "X was never reaped"
        for n in ("Z", "W"):
            r = result(srv[n], tid[n])
            assert not r["finished"], (n, r)  # still running: never taken for dead
            assert "lease had expired" not in srv[n].log_tail(400), srv[n].log_tail(40)
    finally:
        srv["X"].resume()
        for s in srv.values():
            s.kill()
