"""A SIGTERM while PostgreSQL is frozen (its processes stopped by SIGSTOP; test/pg_util.py's
throwaway cluster, skipped without PostgreSQL) ends within about one --db-busy-timeout bound,
however many persistent tasks were running: the first write of the shutdown that finds the
database away ends the writer's tries (server/tasks/writer.py, Writer.closing), instead of each
queued final row waiting out its own bound, one after the other (minutes at the default bound).
The log still names every task whose final row could not be committed. On a database that
answers, the same shutdown still commits every final row and every state."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytest.importorskip("asyncpg", reason="asyncpg is not installed (pip install asyncpg): no PostgreSQL tests")

import asyncpg  # noqa: E402
from pg_util import pg_cluster, pg_url  # noqa: E402, F401 - fixtures
from test_pg_timeouts import frozen  # noqa: E402
from util_server import ServerProcess  # noqa: E402

BUSY = 1  # --db-busy-timeout: a statement is given 2 s
TASKS = 24  # before the fix, each final row waited out its own bound at shutdown: over 24 s
BOUND_S = 12.0  # the shutdown's bound: the in-flight write's (2 s), the lease's 1 s, and the rest of the exit
RUNNING, FINISHED = 2, 3  # tasks.status (server/tasks/schema.py)


def start_long_tasks(c: httpx.Client, n: int) -> list[str]:
    ids = []
    for i in range(n):
        r = c.post("/v1/tasks/create", json={"prompt": f"run {i}", "max_tokens": 100000, "ignore_eos": True})
        assert r.status_code == 200, r.text
        ids.append(r.json()["task_id"])
    return ids


def stored_rows(url: str) -> dict[str, tuple[int, str | None, str | None]]:
    """id -> (status, finish_reason, state_id) of every task row."""

    async def go() -> dict[str, tuple[int, str | None, str | None]]:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            rows = await conn.fetch("select id, status, finish_reason, state_id from tasks")
        finally:
            await conn.close()
        return {r["id"]: (r["status"], r["finish_reason"], r["state_id"]) for r in rows}

    return asyncio.run(go())


def test_a_sigterm_on_a_frozen_database_ends_within_a_bound_whatever_the_task_count(tmp_path, pg_url, pg_cluster):
    srv = ServerProcess(tmp_path, db=pg_url, args=("--db-busy-timeout", str(BUSY)), stop_timeout=BOUND_S)
    srv.start()
    try:
        # a database that answers: every final row and every state is committed at the SIGTERM
        with httpx.Client(base_url=srv.url, timeout=15) as c:
            ids = start_long_tasks(c, 4)
            time.sleep(0.5)
        assert srv.stop(timeout=30) is not None and not srv.alive, srv.log_tail()
        rows = stored_rows(pg_url)
        for tid in ids:
            status, reason, state_id = rows[tid]
            assert (status, reason) == (FINISHED, "interrupted") and state_id, (tid, rows[tid], srv.log_tail())

        # frozen: the shutdown gives up on what it cannot write within about one bound
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=15) as c:
            ids = start_long_tasks(c, TASKS)
            time.sleep(0.5)
        with frozen(pg_cluster):
            t0 = time.monotonic()
            srv.stop(timeout=BOUND_S + 20)  # (the old code: still waiting there, one bound per task)
            took = time.monotonic() - t0
    finally:
        srv.kill()
    log = srv.log_path.read_text().split("===== start #2")[-1]
    assert took < BOUND_S, f"the shutdown took {took:.1f} s for {TASKS} tasks (bound {BOUND_S} s)\n{srv.log_tail()}"
    assert f"{TASKS} not stored" in log and "0 stored" in log, srv.log_tail()
    named = log.split("could not be committed (the task database is unavailable)")[-1]
    assert all(tid in named for tid in ids), srv.log_tail()
    assert "Traceback" not in log and "never retrieved" not in log, srv.log_tail()
