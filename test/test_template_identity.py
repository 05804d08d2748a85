"""A template's identity, against real servers and SQLite files.

1. A fork of a state-file template records WHICH state of it its history starts from (its state
   id, named by the file's content: server.tasks.lineage, imports.state_id_of). When the fork's
   own state is lost and the template's name now holds another state (deleted and uploaded
   again, or an operator's `--state` of another file at a restart), the fork is refused with 409
   `state_lost`, never rebuilt on the new state; the same file loaded again is the same base.
2. An as_template that never answered (its server was killed while it prefilled the history)
   leaves nothing: after a restart, or once a replica reaped the dead instance, the name is free
   and no half-made template is listed; while it runs, the template is not listed either, and a
   live replica never reaps it. The claim's SQL (server.tasks.claims) also runs on PostgreSQL.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures
from test_state_files import PROMPT, _bytes, _save, random_state_dict
from util_server import ServerProcess, running_server

from server.tasks.listing import Listing
from server.tasks.records import Task, to_row
from server.tasks.store import Store

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
G = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0, "ignore_eos": True}
OCTET = {"Content-Type": "application/octet-stream"}
HISTORY = [100 + i % 500 for i in range(32_000)]  # a few seconds of prefill on the CPU


def tasks(srv: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=srv.url + "/v1/tasks", timeout=120)


def done(c: httpx.Client, tid: str, stored: bool = False, timeout: float = 120) -> dict:
    """The finished task (and, with stored, once its state is in the database)."""
    deadline = time.monotonic() + timeout
    while not ((r := c.get(f"/{tid}/get_result").json())["finished"] and (not stored or r["state"] == "stored")):
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def run(c: httpx.Client, path: str, body: dict, stored: bool = False) -> dict:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return done(c, r.json()["task_id"], stored)


def drop_own_state(db: str, task_id: str) -> None:
    """Lose the task's stored state as the database budget does (the server is stopped)."""
    with sqlite3.connect(db) as conn:
        (sid,) = conn.execute("select state_id from tasks where id = ?", (task_id,)).fetchone()
        assert sid is not None and sid.startswith(task_id + ":"), sid
        conn.execute("update tasks set state_id = NULL, state_pos = 0 where id = ?", (task_id,))
        conn.execute("delete from states where id = ?", (sid,))


def rows(db: str, task_id: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("select status, finish_reason, state_id from tasks where id = ?", (task_id,)).fetchall()


def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def assert_state_lost(c: httpx.Client, f: str) -> None:
    """Forking and continuing f are 409 state_lost naming `_st`, and change nothing."""
    before = c.get(f"/{f}/get_result").json()
    for path, body in ((f"/{f}/fork?tmp=true", {"prompt": " more", "max_tokens": 12, **G}),
                       (f"/{f}/continue", {"max_tokens": 4})):
        r = c.post(path, json=body)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "state_lost" and "_st" in err["message"], err
    assert c.get(f"/{f}/get_result").json() == before


# --- 1. the base of a fork of a state-file template ---------------------------------------------
def test_a_fork_is_never_rebuilt_on_another_state_under_its_template_s_name(tmp_path):
    a, b = _bytes(random_state_dict(seed=1)), _bytes(random_state_dict(seed=2))
    with running_server(tmp_path) as srv:
        up = lambda data: httpx.post(srv.url + "/v1/states/st", content=data, headers=OCTET)  # noqa: E731
        assert up(a).status_code == 201
        c = tasks(srv)
        f = run(c, "/_st/fork", {"prompt": PROMPT, "max_tokens": 8, **G}, stored=True)["task_id"]
        ref = run(c, f"/{f}/fork?tmp=true", {"prompt": " more", "max_tokens": 12, **G})["result"]
        # a fork with nothing to feed keeps naming the template's state: its row outlives the template
        idle = run(c, "/_st/fork", {})["task_id"]
        assert httpx.delete(srv.url + "/v1/states/st").status_code == 200
        assert up(b).status_code == 201  # the name now holds another state

        srv.stop()
        drop_own_state(srv.db, f)
        srv.start()
        c = tasks(srv)
        assert_state_lost(c, f)

        # the same file again is the same base (its state row, kept for `idle`, is shared)
        assert httpx.delete(srv.url + "/v1/states/st").status_code == 200
        assert up(a).status_code == 201, srv.log_tail()
        assert run(c, f"/{f}/fork?tmp=true", {"prompt": " more", "max_tokens": 12, **G})["result"] == ref
        assert c.post(f"/{idle}/continue", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_an_operator_s_new_file_under_the_same_name_is_another_base(tmp_path):
    fa = _save(random_state_dict(seed=1), tmp_path / "a.pth")
    fb = _save(random_state_dict(seed=2), tmp_path / "b.pth")
    with ServerProcess(tmp_path, args=("--state", f"st={fa}")) as srv:
        srv.start()
        c = tasks(srv)
        f = run(c, "/_st/fork", {"prompt": PROMPT, "max_tokens": 8, **G}, stored=True)["task_id"]
        ref = run(c, f"/{f}/fork?tmp=true", {"prompt": " more", "max_tokens": 12, **G})["result"]

        srv.stop()
        drop_own_state(srv.db, f)
        srv.args = ("--state", f"st={fb}")  # the operator ships another file under the same name
        srv.start()
        assert_state_lost(tasks(srv), f)

        srv.args = ("--state", f"st={fa}")  # and goes back: the same content, the same base
        srv.restart()
        c = tasks(srv)
        assert run(c, f"/{f}/fork?tmp=true", {"prompt": " more", "max_tokens": 12, **G})["result"] == ref


# --- 2. an as_template that never answered ----------------------------------------------------------
def _long_task_without_state(srv: ServerProcess) -> str:
    """A task whose history takes seconds to prefill, its state dropped (the server restarted)."""
    x = run(tasks(srv), "/create", {"prompt": HISTORY, "max_tokens": 2, **G}, stored=True)["task_id"]
    srv.stop()
    drop_own_state(srv.db, x)
    srv.start()
    return x


def _as_template_in_background(srv: ServerProcess, x: str) -> dict:
    """Start as_template?name=tpl (it prefills x's history); return once its claim row is there."""
    answer: dict = {}

    def call() -> None:
        try:
            answer["r"] = tasks(srv).post(f"/{x}/as_template", params={"name": "tpl"}, json={})
        except httpx.HTTPError as exc:
            answer["error"] = exc

    threading.Thread(target=call, daemon=True).start()
    until(lambda: bool(rows(srv.db, "_tpl")) or bool(answer), 60, "no claim row")
    assert not answer, f"as_template answered before it could be interrupted: {answer}"
    return answer


def _listed_templates(srv: ServerProcess) -> list[str]:
    body = tasks(srv).get("/list", params={"kind": "template"}).json()
    return [t["task_id"] for t in body["tasks"]] + body["cpu_tasks"]


def _template_can_be_made(srv: ServerProcess) -> None:
    c = tasks(srv)
    assert "_tpl" not in _listed_templates(srv)
    assert c.get("/_tpl/get_result").status_code == 404
    y = run(c, "/create", {"prompt": [7, 8, 9], "max_tokens": 2, **G}, stored=True)["task_id"]  # (short: no
    r = c.post(f"/{y}/as_template", params={"name": "tpl"}, json={})  # second long prefill) the name is free
    assert r.status_code == 200, r.text
    f = run(c, "/_tpl/fork", {"prompt": [7], "max_tokens": 1})
    assert f["prompt_tokens"] == 2  # from the template's stored state, not a prefill of its history


def test_an_as_template_killed_while_it_prefills_leaves_nothing_after_a_restart(tmp_path):
    with running_server(tmp_path) as srv:
        x = _long_task_without_state(srv)
        answer = _as_template_in_background(srv, x)
        assert "_tpl" not in _listed_templates(srv)  # not a usable template yet
        assert rows(srv.db, "_tpl")[0][0] != 3
        srv.kill()  # kill -9 while it prefills
        assert "r" not in answer, answer
        srv.start()
        assert rows(srv.db, "_tpl") == []
        _template_can_be_made(srv)


def test_a_replica_reaps_a_half_made_template_only_once_its_maker_is_dead(tmp_path):
    db = str(tmp_path / "shared.db")
    env = {"RWKV_LEASE_TIMEOUT": "1.5", "RWKV_MAX_BATCH": "4"}
    a = ServerProcess(tmp_path / "a", db=db, env={**env, "RWKV_INSTANCE_NAME": "a"})
    b = ServerProcess(tmp_path / "b", db=db, env={**env, "RWKV_INSTANCE_NAME": "b"})
    with a, b:
        a.start()
        x = _long_task_without_state(a)
        b.start()
        answer = _as_template_in_background(a, x)
        time.sleep(2.0)  # b's heartbeats (every 0.5 s) leave a live instance's claim alone
        assert rows(db, "_tpl") and "r" not in answer, (rows(db, "_tpl"), answer)
        assert "_tpl" not in _listed_templates(b)
        a.kill()
        until(lambda: rows(db, "_tpl") == [], 15, "b did not reap the dead instance's half-made template")
        _template_can_be_made(b)


# --- the claim's SQL, on SQLite and PostgreSQL ----------------------------------------------------
async def test_claims_are_reaped_with_their_instance_and_settled_or_dropped_only_by_it(db_url):  # noqa: F811
    from server.tasks.claims import drop_claim, settle_claim  # (new with these claims)

    store = Store(db_url)
    await store.open()
    try:
        def claim(tid: str, instance: str, **kw) -> dict:
            return {**to_row(Task(id=tid, kind="template", **kw)), "status": 2, "instance": instance}

        for tid, instance in (("_live", "a"), ("_dead", "x"), ("_mine", "a"), ("_given", "a")):
            assert await store.insert_new(claim(tid, instance))
        await store.save(claim("_continued", "x", version=1))  # a template continued with force
        await store.save({**to_row(Task(id="TASK_1", kind="task")), "status": 2, "instance": "x"})
        rows, total = await Listing(store).list_tasks(None, True, None, 10, 0)
        assert {r.id for r in rows} == {"_continued", "TASK_1"} and total == 2  # claims: never listed
        assert sorted(await store.mark_interrupted(["a"])) == ["TASK_1", "_continued", "_dead"]
        assert await store.get_task("_dead") is None  # deleted, not a half-made template
        assert (await store.get_task("_continued")).finish_reason == "interrupted"
        assert (await store.get_task("_live")).status == 2  # a live instance's claim is left alone
        # only the claim's own instance settles or drops it
        done = {**to_row(Task(id="_mine", kind="template", finish_reason="stop")), "instance": None}
        assert not await settle_claim(store, done, None, "b")
        assert await settle_claim(store, done, None, "a") and (await store.get_task("_mine")).status == 3
        assert not await settle_claim(store, done, None, "a")  # settled once
        await drop_claim(store, "_mine", "a")  # a finished template is no claim: kept
        await drop_claim(store, "_given", "b")
        assert await store.task_exists("_mine") and await store.task_exists("_given")
        await drop_claim(store, "_given", "a")
        assert not await store.task_exists("_given")
    finally:
        await store.close()
