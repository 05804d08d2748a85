"""/health and /metrics say whether the task database answered the server's last use of it (a
real server on a SQLite file; another connection holds the file's write lock beyond
--db-busy-timeout, as another process would): the failed create is a 503, /health stays 200
(completions need no database) but says "unavailable" with the error and since when,
rwkv_database_available is 0, and both turn back once a use succeeds, which the log says."""

from __future__ import annotations

import sqlite3
import time

import httpx
from util_server import ServerProcess


def gauge(c: httpx.Client) -> float:
    line = next(ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("rwkv_database_available "))
    return float(line.split()[1])


def test_health_says_the_database_failed_its_last_use_and_when_it_answers_again(tmp_path):
    srv = ServerProcess(tmp_path, args=("--db-busy-timeout", "0.5")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.post("/v1/tasks/create", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            h = c.get("/health").json()
            assert h["database"] == "ok" and "database_error" not in h and gauge(c) == 1
            other = sqlite3.connect(srv.db, isolation_level=None)  # another process's writer
            other.execute("BEGIN IMMEDIATE")
            try:
                t0 = time.time()
                r = c.post("/v1/tasks/create", json={"prompt": "blocked", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
                h = c.get("/health")
                assert h.status_code == 200, h.text  # still serving what needs no database
                body = h.json()
                assert body["status"] == "ok" and body["database"] == "unavailable", body
                assert body["database_error"] == r.json()["error"]["message"], body
                assert t0 - 1 <= body["database_unavailable_since"] <= time.time(), body
                assert gauge(c) == 0
                done = c.post("/v1/completions", json={"prompt": "no database", "max_tokens": 3})
                assert done.status_code == 200, done.text
                assert c.get("/v1/tasks/list").status_code == 200  # reads go on (WAL) ...
                assert c.get("/health").json()["database"] == "unavailable"  # ... and prove no write works
            finally:
                other.execute("ROLLBACK")
                other.close()
            assert c.post("/v1/tasks/create", json={"prompt": "after", "max_tokens": 2}).status_code == 200
            h = c.get("/health").json()
            assert h["database"] == "ok" and "database_error" not in h and gauge(c) == 1, h
        assert "the task database answers again (unavailable for" in srv.log_tail(200)
    finally:
        srv.stop()


def test_with_api_keys_health_leaves_the_error_text_to_the_log():
    """/health needs no key; the driver's text may name the database's address."""
    from server.api.ops import _database
    from server.tasks.dbfaults import Availability

    down = Availability(ok=False, error="the task database is unreachable ([Errno 111] ('10.0.0.5', 5432))", since=1.0)
    assert _database(down, keyed=False)["database_error"] == down.error
    assert _database(down, keyed=True) == {"database": "unavailable", "database_unavailable_since": 1.0}
