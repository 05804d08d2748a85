"""A real server on a frozen PostgreSQL (its processes stopped by SIGSTOP; test/pg_util.py's
throwaway cluster, skipped without PostgreSQL): requests answer 503 `database_unavailable` with
Retry-After within about --db-busy-timeout (a state upload too, not a 500), instead of hanging
until the database thaws; a SIGTERM during the freeze ends the server within a bounded time, and
its log names the task whose final row could not be committed instead of counting it kept."""

from __future__ import annotations

import time

import httpx
import pytest
from util_server import ServerProcess

from pg_util import pg_cluster, pg_url  # noqa: F401 - fixtures
from test_pg_timeouts import frozen

ARGS = ("--db-busy-timeout", "1")


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "database_unavailable" and int(r.headers["Retry-After"]) >= 1, r.text


@pytest.fixture
def server(tmp_path, pg_url):
    srv = ServerProcess(tmp_path, db=pg_url, args=ARGS, stop_timeout=30)
    srv.start()
    yield srv
    srv.stop()


def test_requests_on_a_frozen_database_answer_503_within_the_bound(server, pg_cluster):
    with httpx.Client(base_url=server.url, timeout=15) as c:
        assert c.post("/v1/tasks/create", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        with frozen(pg_cluster):
            for method, path, kw in [
                ("POST", "/v1/tasks/create", {"json": {"prompt": "hi", "max_tokens": 2}}),
                ("GET", "/v1/tasks/list", {}),
                ("POST", "/v1/states/x", {"content": b"\0" * 64,
                                          "headers": {"Content-Type": "application/octet-stream"}}),
            ]:
                t0 = time.monotonic()
                r = c.request(method, path, **kw)
                assert time.monotonic() - t0 < 8, (path, time.monotonic() - t0)
                assert_unavailable(r)
            h = c.get("/health")  # still 200 (completions need no database), and says it
            assert h.status_code == 200 and h.json()["database"] == "unavailable", h.text
            assert h.json()["database_unavailable_since"] and "task database" in h.json()["database_error"], h.text
        assert c.get("/v1/tasks/list").status_code == 200  # thawed: back
        # a write failed in the freeze: a write that succeeds says the database is back (a read
        # alone does not, and the heartbeat's write may still be 10 s away)
        assert c.post("/v1/tasks/create", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert c.get("/health").json()["database"] == "ok"
    assert "Traceback" not in server.log_path.read_text(), server.log_tail()


def test_a_sigterm_during_a_freeze_ends_within_a_bound_and_says_what_was_not_stored(server, pg_cluster):
    with httpx.Client(base_url=server.url, timeout=15) as c:
        r = c.post("/v1/tasks/create", json={"prompt": "hi", "max_tokens": 100000, "ignore_eos": True})
        tid = r.json()["task_id"]
        time.sleep(0.5)
    with frozen(pg_cluster):
        t0 = time.monotonic()
        server.stop(timeout=25)
        took = time.monotonic() - t0
    log = server.log_path.read_text()
    assert server.proc.returncode is not None and took < 25, (took, server.log_tail())
    assert "1 not stored" in log and "0 stored" in log, server.log_tail()
    assert tid in log.split("could not be committed (the task database is unavailable)")[-1], server.log_tail()
