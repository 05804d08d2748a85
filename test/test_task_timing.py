"""A task's gen_time and speed while it runs and after a crash: get_result shows the time its
output has been generating so far (not 0 until the run ends), a progress row keeps it, so a
task a kill interrupted keeps the time it had, and a continue adds to it (its speed is the
output's tokens over the output's time, not over the last run's)."""

from __future__ import annotations

import httpx
import pytest
from util_server import running_server, task_result, wait_committed

LONG = {"prompt": "A long story", "max_tokens": 100_000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("timing")) as srv:
        yield srv


def result(c: httpx.Client, tid: str) -> dict:
    return c.get(f"/v1/tasks/{tid}/get_result").json()


def until(c: httpx.Client, tid: str, cond, timeout: float = 30) -> dict:
    return task_result(c, tid, cond, timeout)


def test_a_running_task_shows_its_time_so_far(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        tid = c.post("/v1/tasks/create", json=LONG).json()["task_id"]
        r = until(c, tid, lambda r: r["completion_tokens"] >= 20)
        assert not r["finished"] and r["gen_time"] > 0 and r["speed"] > 0, r
        later = until(c, tid, lambda x: x["completion_tokens"] > r["completion_tokens"])
        assert later["gen_time"] > r["gen_time"]
        c.post(f"/v1/tasks/{tid}/stop")
        done = until(c, tid, lambda x: x["finished"])
        assert done["gen_time"] >= later["gen_time"] and done["speed"] > 0


def test_a_task_a_crash_interrupted_keeps_its_time(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        tid = c.post("/v1/tasks/create", json=LONG).json()["task_id"]
        until(c, tid, lambda r: r["completion_tokens"] >= 20)
        wait_committed(server.db, tid, lambda row: row["gen_time"] > 0.5)  # a progress row or two (one a second)
    server.restart(hard=True)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = result(c, tid)
        assert r["finish_reason"] == "interrupted" and r["completion_tokens"] > 0 and r["gen_time"] > 0.5, r
        assert c.post(f"/v1/tasks/{tid}/continue", json={"max_tokens": 16}).status_code == 200
        after = until(c, tid, lambda x: x["finished"])
        assert after["gen_time"] > r["gen_time"]
        assert after["speed"] == pytest.approx((after["completion_tokens"] - 1) / after["gen_time"], rel=1e-6)


def test_a_one_token_answer_has_no_speed(server):
    """`speed` counts the tokens after the first (the prefill made that one, before gen_time
    starts): a one-token answer reads 0, not its one token over a few microseconds."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for n in (1, 4):
            tid = c.post("/v1/tasks/create", json={"prompt": "speed", "max_tokens": n, "ignore_eos": True}).json()
            r = until(c, tid["task_id"], lambda x: x["finished"])
            assert r["completion_tokens"] == n, r
            if n == 1:
                assert r["speed"] == 0.0, r
            else:
                assert r["gen_time"] > 0 and r["speed"] == pytest.approx((n - 1) / r["gen_time"], rel=1e-3), r
