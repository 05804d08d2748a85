"""Crash safety of states written behind (issue 22), against real servers: SIGKILL right after
tasks finished and while others run, then continue every task. Each continuation equals, token
for token at temperature 0, the same continuation on a server that was never killed; the same
after a stored state was deleted or corrupted (rebuilt from the task's tokens, not refused).
Run twice: with the default write-behind budget (states mostly stored by the kill) and with a
budget of 0 (no state is ever written: every finished task is rebuilt after the kill)."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from util_server import ServerProcess, wait_committed

G = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}
PROMPTS = [f"Task {i}: tell me about {w}." for i, w in enumerate(["owls", "rivers", "clocks", "salt", "glass"])]


def wait_done(c: httpx.Client, tid: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = c.get(f"/{tid}/get_result")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["finished"]:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def make_finished(c: httpx.Client) -> list[dict]:
    ids = [c.post("/create", json={"prompt": p, "max_tokens": 8, **G}).json()["task_id"] for p in PROMPTS]
    return [wait_done(c, i) for i in ids]


def continue_all(c: httpx.Client, ids: list[str], n: int = 8) -> list[str]:
    for i in ids:
        r = c.post(f"/{i}/continue", json={"max_tokens": n})
        assert r.status_code == 200, r.text
    return [wait_done(c, i)["result"] for i in ids]


def break_states(db: str, corrupt: str, delete: str) -> list[str]:
    """Flip a byte of one task's stored state, delete another's (the server is not running)."""
    done = []
    with sqlite3.connect(db) as conn:
        for tid, how in ((corrupt, "corrupt"), (delete, "delete")):
            (sid,) = conn.execute("select state_id from tasks where id = ?", (tid,)).fetchone()
            if sid is None:
                continue  # never written (write-behind budget 0)
            if how == "delete":
                conn.execute("delete from states where id = ?", (sid,))
            else:
                data = bytearray(conn.execute("select data from states where id = ?", (sid,)).fetchone()[0])
                data[len(data) // 2] ^= 0x40
                conn.execute("update states set data = ? where id = ?", (bytes(data), sid))
            done.append(how)
    return done


@pytest.mark.parametrize("write_behind", ["default", "0"])
def test_sigkill_then_every_task_continues_as_on_a_server_never_killed(tmp_path, write_behind):
    env = {} if write_behind == "default" else {"RWKV_WRITE_BEHIND_BYTES": "0"}
    ref = ServerProcess(tmp_path / "ref").start()
    srv = ServerProcess(tmp_path / "crash", env=env).start()
    try:
        with httpx.Client(base_url=ref.url + "/v1/tasks", timeout=30) as r, \
                httpx.Client(base_url=srv.url + "/v1/tasks", timeout=30) as c:
            ref_done = make_finished(r)
            running = [c.post("/create", json={"prompt": f"long run {i}", "max_tokens": 100000, **G}).json()["task_id"]
                       for i in range(2)]
            done = make_finished(c)  # finished while the long ones run
            assert [d["result"] for d in done] == [d["result"] for d in ref_done]
            ids = [d["task_id"] for d in done]
            for i in running:  # a progress row of the running ones lands
                wait_committed(srv.db, i, lambda row: row["completion_tokens"] > 0)
            if write_behind != "0":  # (the default budget: the states of the two broken below are written)
                for i in ids[:2]:
                    wait_committed(srv.db, i, lambda row: row["state_id"] is not None)
            srv.kill()  # SIGKILL right after: no shutdown code runs
        broken = break_states(srv.db, corrupt=ids[0], delete=ids[1])
        assert broken == ([] if write_behind == "0" else ["corrupt", "delete"])  # budget 0: none written
        srv.start()
        with httpx.Client(base_url=ref.url + "/v1/tasks", timeout=30) as r, \
                httpx.Client(base_url=srv.url + "/v1/tasks", timeout=30) as c:
            for d in done:  # every acknowledged, finished task is there as it was shown
                after = c.get(f"/{d['task_id']}/get_result").json()
                keys = ("result", "finish_reason", "completion_tokens", "prompt_tokens", "finished")
                assert {k: after[k] for k in keys} == {k: d[k] for k in keys}, srv.log_tail()
                assert after["state"] in ("stored", "rebuild")
            if write_behind == "0":
                assert all(c.get(f"/{i}/get_result").json()["state"] == "rebuild" for i in ids)
            lengths = []
            for i in running:
                st = c.get(f"/{i}/status").json()
                assert (st["status"], st["finish_reason"]) == (3, "interrupted") and st["generated_buf"] > 0
                lengths.append(st["generated_buf"])
            assert continue_all(c, ids) == continue_all(r, [d["task_id"] for d in ref_done]), srv.log_tail()
            # an interrupted task goes on as a task that had stopped there
            twins = [r.post("/create", json={"prompt": f"long run {i}", "max_tokens": n, **G}).json()["task_id"]
                     for i, n in enumerate(lengths)]
            for t in twins:
                wait_done(r, t)
            assert continue_all(c, running, 5) == continue_all(r, twins, 5)
            log = srv.log_tail(400)
            assert "Traceback" not in log, log
            if broken:
                assert "is unusable" in log  # the corrupt one was detected, then rebuilt
    finally:
        srv.stop()
        ref.stop()
