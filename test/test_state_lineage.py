"""A lost state of a task that descends from a state template (a state file) is rebuilt from that
template's state, never from the zero state (server.tasks.lineage), against a real server: a
fork whose stored state is corrupted continues exactly as its untouched twin does; with the
template's state corrupted too, continuing is a 409 `state_lost` that changes nothing."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from test_state_files import PROMPT, _bytes, files, random_state_dict  # noqa: F401  (files: a fixture)
from util_server import running_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
G = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0, "ignore_eos": True}


def done(c: httpx.Client, tid: str, stored: bool = False, timeout: float = 60) -> dict:
    """The finished task (and, with stored, once its state is in the database)."""
    deadline = time.monotonic() + timeout
    while not ((r := c.get(f"/{tid}/get_result").json())["finished"] and (not stored or r["state"] == "stored")):
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def corrupt(db: str, task_id: str) -> None:
    """Flip a byte of the task's stored state (the server is stopped)."""
    with sqlite3.connect(db) as conn:
        (sid,) = conn.execute("select state_id from tasks where id = ?", (task_id,)).fetchone()
        assert sid is not None, f"{task_id} has no stored state"
        data = bytearray(conn.execute("select data from states where id = ?", (sid,)).fetchone()[0])
        data[len(data) // 2] ^= 0x40
        conn.execute("update states set data = ? where id = ?", (bytes(data), sid))


def test_a_fork_of_a_state_template_is_rebuilt_from_that_state(files, tmp_path):  # noqa: F811
    ckpt, _ = files
    with running_server(tmp_path, model=str(ckpt)) as srv:
        assert httpx.post(srv.url + "/v1/states/up", content=_bytes(random_state_dict())).status_code == 201
        c = httpx.Client(base_url=srv.url + "/v1/tasks", timeout=60)
        a, b, lost = (c.post("/_up/fork", json={"prompt": PROMPT, "max_tokens": 12, **G}).json()["task_id"]
                      for _ in range(3))
        assert len({done(c, t, stored=True)["result"] for t in (a, b, lost)}) == 1  # three twins
        # forks of a fork, whose parent is deleted below: their base is recorded, not only traced
        d1, d2 = (c.post(f"/{a}/fork", json={"max_tokens": 6, **G}).json()["task_id"] for _ in range(2))
        assert done(c, d1, stored=True)["result"] == done(c, d2, stored=True)["result"]
        expected = {}
        for t in (a, d1):  # continued from their own states, in memory
            assert c.post(f"/{t}/continue", json={"max_tokens": 8}).status_code == 200
            expected[t] = done(c, t)["result"]
        assert c.post(f"/{a}/delete").status_code == 200

        srv.stop()
        corrupt(srv.db, b)
        corrupt(srv.db, d2)
        srv.start()
        c = httpx.Client(base_url=srv.url + "/v1/tasks", timeout=60)
        for t, twin in ((b, a), (d2, d1)):  # rebuilt from the template's state + their tokens
            r = c.post(f"/{t}/continue", json={"max_tokens": 8})
            assert r.status_code == 200, r.text
            assert done(c, t)["result"] == expected[twin], t
        assert "is unusable" in srv.log_tail(200)

        srv.stop()
        corrupt(srv.db, lost)
        corrupt(srv.db, "_up")
        srv.start()
        c = httpx.Client(base_url=srv.url + "/v1/tasks", timeout=60)
        before = c.get(f"/{lost}/get_result").json()
        r = c.post(f"/{lost}/continue", json={"max_tokens": 8})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "state_lost" and "_up" in err["message"], err
        after = c.get(f"/{lost}/get_result").json()
        assert after.pop("state") in {"stored", "rebuild"} and before.pop("state") == "stored"
        assert after == before  # nothing changed, nothing is running
        assert c.post("/_up/fork", json={"prompt": PROMPT, "max_tokens": 4, **G}).status_code == 409
        # a fork of the lost task names that task (the state it would copy), not an id never made
        r = c.post(f"/{lost}/fork", json={"max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 409 and err["code"] == "state_lost" and err["param"] == "task_id", r.text
        assert err["message"].startswith(f"task {lost} "), err
        # its export is the same 409, not a 500
        r = c.get(f"/{lost}/state")
        assert r.status_code == 409 and r.json()["error"]["code"] == "state_lost", r.text
        assert c.get(f"/{lost}/get_result").json()["finished"]
