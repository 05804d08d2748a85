"""A continue with a new prompt shows its new output from its start: the task is running from the
claim on, and its starting state is read before the submit (from the database, when it is not
in memory: that may take a while), so a read of the task meanwhile (get_result, the dashboard's
detail, a stream) shows the new, empty output, never the old one as the running one; a start that
fails there puts the task back as it was and ends a stream opened meanwhile. A real server in
this process, its state read held on a gate."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from util_server import inprocess_server, task_result

from server.tasks.errors import TaskUnavailable


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    from server.config import Settings

    db = tmp_path_factory.mktemp("window") / "tasks.db"
    with inprocess_server(Settings(device="cpu", db=str(db), stats_interval=0, max_batch=8)) as (url, app):
        yield url, app


class Gate:
    """Persistence.resolve_state held until `open` is set, then the real one (or `error`)."""

    def __init__(self, persistence, error: Exception | None = None) -> None:
        self.inner, self.error = persistence.resolve_state, error
        self.entered, self.open = threading.Event(), threading.Event()

    async def __call__(self, t, holder=None):
        self.entered.set()
        while not self.open.is_set():
            await asyncio.sleep(0.01)
        if self.error is not None:
            raise self.error
        return await self.inner(t, holder)


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(fn()), daemon=True)
    th.start()
    return th, out


def read_stream(url: str, tid: str, attached: threading.Event) -> dict:
    """The task's stream from 0: its text and its final event (`attached` set once its header came)."""
    text, final = "", None
    with httpx.Client(base_url=url, timeout=20) as c, c.stream("GET", f"/v1/tasks/{tid}/stream") as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[len("data: ") :])
            if "data" in ev:
                text += ev["data"]
            elif ev.get("finished"):
                final = ev
            else:
                attached.set()  # the header: the stream is bound to the task's output now
    return {"text": text, "final": final}


def started(c: httpx.Client, app, monkeypatch, error: Exception | None = None):
    """A finished task, its result and output_start, and a gate on the next state read."""
    tid = c.post("/v1/tasks/create", json={"prompt": "Hello", "max_tokens": 8, "seed": 1}).json()["task_id"]
    old = task_result(c, tid, until=lambda r: r["finished"] and r["state"] == "stored")
    start = c.get(f"/v1/ui/tasks/{tid}").json()["output_start"]
    tasks = app.state.services.tasks
    gate = Gate(tasks.runs.persistence, error)
    monkeypatch.setattr(tasks.runs.persistence, "resolve_state", gate)
    return tid, old, start, gate


def post_continue(url: str, tid: str) -> dict:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(f"/v1/tasks/{tid}/continue", json={"prompt": " Again", "max_tokens": 4, "seed": 2})
    return {"status": r.status_code, "body": r.json()}


def test_a_continue_with_a_prompt_shows_its_new_output_while_its_state_is_read(inproc, monkeypatch):
    url, app = inproc
    with httpx.Client(base_url=url, timeout=60) as c:
        tid, old, start, gate = started(c, app, monkeypatch)
        poster, answer = in_thread(lambda: post_continue(url, tid))
        assert gate.entered.wait(30), "the continue never read its state"
        r = c.get(f"/v1/tasks/{tid}/get_result").json()
        detail = c.get(f"/v1/ui/tasks/{tid}", params={"brief": True}).json()
        attached = threading.Event()
        reader, streamed = in_thread(lambda: read_stream(url, tid, attached))
        assert attached.wait(30)
        gate.open.set()
        poster.join(60)
        reader.join(60)
        assert answer["status"] == 200, answer
        done = task_result(c, tid)
        final = c.get(f"/v1/ui/tasks/{tid}", params={"brief": True}).json()
    # while the state was read: running, the new output empty, where it will be
    seen = {k: r[k] for k in ("finished", "status", "result", "finish_reason", "completion_tokens", "prompt_tokens")}
    assert seen == {"finished": False, "status": 0, "result": "", "finish_reason": None, "completion_tokens": 0,
                    "prompt_tokens": 0}, (r, old)  # fmt: skip
    assert (r["gen_time"], r["prefill_time"]) == (0, 0), r
    assert detail["output_start"] == final["output_start"] > start and detail["generated_buf"] == 0, detail
    # a stream opened then is the new output's
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 4, done
    assert streamed["text"] == done["result"] and streamed["final"]["finish_reason"] == "length", (streamed, done)


def test_a_start_that_fails_while_its_state_is_read_leaves_the_task_as_it_was(inproc, monkeypatch):
    url, app = inproc
    with httpx.Client(base_url=url, timeout=60) as c:
        tid, old, start, gate = started(c, app, monkeypatch, TaskUnavailable("the database is away"))
        poster, answer = in_thread(lambda: post_continue(url, tid))
        assert gate.entered.wait(30), "the continue never read its state"
        attached = threading.Event()
        reader, streamed = in_thread(lambda: read_stream(url, tid, attached))
        assert attached.wait(30)
        gate.open.set()
        poster.join(60)
        reader.join(30)
        assert not reader.is_alive(), "a stream opened while the start ran never ended"
        assert answer["status"] == 503 and answer["body"]["error"]["code"] == "database_unavailable", answer
        assert task_result(c, tid) == old
        assert c.get(f"/v1/ui/tasks/{tid}", params={"brief": True}).json()["output_start"] == start
    # the stream's output never ran: it ends empty, stopped
    assert streamed == {"text": "", "final": streamed["final"]} and streamed["final"]["finish_reason"] == "stopped"
