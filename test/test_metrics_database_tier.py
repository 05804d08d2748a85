"""`rwkv_state_cache_entries{tier="database"}` against a real server: the stored non-template states,
as the database holds them, through writes, a continue (its new state replaces the old one), a
template (not counted: the tier's bytes leave templates out too), a delete, a restart (read from
the database at start) and the database budget's evictions (read again at the check)."""

from __future__ import annotations

import sqlite3
import time

import httpx
from util_server import running_server, task_result

from server.api.metrics import parse_metrics

ENTRIES = 'rwkv_state_cache_entries{tier="database"}'
BYTES = 'rwkv_state_cache_bytes{tier="database"}'


def in_db(path: str) -> tuple[int, int]:
    """(number, bytes) of the non-template states in the server's SQLite file."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        n, b = db.execute("SELECT count(*), coalesce(sum(nbytes), 0) FROM states WHERE is_template = 0").fetchone()
    return int(n), int(b)


def figures(c: httpx.Client) -> tuple[float, float]:
    m = parse_metrics(c.get("/metrics").text)
    assert ENTRIES in m, "no database tier in rwkv_state_cache_entries"
    return m[ENTRIES], m[BYTES]


def settled(c: httpx.Client, db: str, n: int | None = None, timeout: float = 20) -> tuple[int, int]:
    """Once the gauges equal the database's figures (and hold n states, when given): those figures."""
    deadline = time.monotonic() + timeout
    while True:
        want = in_db(db)
        if figures(c) == want and (n is None or want[0] == n):
            return want
        assert time.monotonic() < deadline, (figures(c), want, n)
        time.sleep(0.05)


def stored(c: httpx.Client, task_id: str) -> dict:
    return task_result(c, task_id, until=lambda r: r["finished"] and r.get("state") == "stored")


def create(c: httpx.Client, prompt: str) -> str:
    r = c.post("/v1/tasks/create", json={"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text
    return r.json()["task_id"]


def test_database_tier_counts_the_stored_states(tmp_path):
    with running_server(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert settled(c, srv.db, 0) == (0, 0)
        a, b = create(c, "first"), create(c, "second")
        for t in (a, b):
            stored(c, t)
        _, two = settled(c, srv.db, 2)
        one = two // 2

        r = c.post(f"/v1/tasks/{a}/continue", json={"prompt": " more", "max_tokens": 3})
        assert r.status_code == 200, r.text
        stored(c, a)  # (the continue answered once its run started)
        settled(c, srv.db, 2)  # the new state replaced the old one

        r = c.post(f"/v1/tasks/{b}/as_template", json={})
        assert r.status_code == 200, r.text
        settled(c, srv.db, 2)  # the template's own state is stored, not counted

        assert c.post(f"/v1/tasks/{b}/delete", json={}).status_code == 200
        settled(c, srv.db, 1)
        stored(c, create(c, "third"))
        settled(c, srv.db, 2)

        srv.env["RWKV_DB_BUDGET_BYTES"] = str(int(2.5 * one))  # room for two states
        srv.restart()
        assert figures(c) == in_db(srv.db) == (2, 2 * one)  # read from the database at start
        evict_elsewhere(srv.db)  # another replica's budget dropped both: not seen here yet
        assert figures(c) == (2, 2 * one) and in_db(srv.db) == (0, 0)
        stored(c, create(c, "more 0"))  # 3 states' bytes by this server's count: a budget check
        settled(c, srv.db, 1)  # ... which reads the database's figures again
        for i in (1, 2):
            stored(c, create(c, f"more {i}"))
        settled(c, srv.db, 2)  # the budget dropped the least recently used one


def evict_elsewhere(path: str) -> None:
    """What another replica's budget check does to every non-template state (StateStore.enforce_budget)."""
    with sqlite3.connect(path, timeout=30) as db:
        gone = [r[0] for r in db.execute("SELECT id FROM states WHERE is_template = 0")]
        for sid in gone:
            db.execute("UPDATE tasks SET state_id = NULL, state_pos = 0 WHERE state_id = ?", (sid,))
            db.execute("DELETE FROM states WHERE id = ?", (sid,))
