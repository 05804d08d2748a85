"""rwkv_lightning sessions and a server shutdown (SIGTERM): a session call that is generating when
the server stops ends `interrupted`, as a task-API run does (docs/task-api.md: `stopped` is a
/stop or a client that left), and the session goes on from it after the restart."""

from __future__ import annotations

import threading
import time

import httpx
from util_lightning import GREEDY
from util_server import running_server

ASK = "User: Tell me about the sea.\n\nAssistant:"
ENDLESS = {"max_tokens": 100_000, **GREEDY}


def _running(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health", timeout=10).json().get("running", 0) < n:
        assert time.monotonic() < deadline, "the session calls did not start"
        time.sleep(0.05)


def test_a_session_generating_at_shutdown_ends_interrupted_and_goes_on(tmp_path):
    with running_server(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        out: dict[str, object] = {}
        started = threading.Event()

        def stream() -> None:
            body = {"session_id": "streamed", "contents": [ASK], "stream": True, "chunk_size": 1, **ENDLESS}
            with httpx.stream("POST", srv.url + "/state/chat/completions", json=body, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started.set()
                        lines.append(line)
                out["stream"] = lines

        def plain() -> None:
            body = {"session_id": "plain", "contents": [ASK], **ENDLESS}
            out["plain"] = httpx.post(srv.url + "/state/chat/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(60), srv.log_tail()
        _running(srv.url, 2)
        srv.stop(timeout=20)
        for t in threads:
            t.join(timeout=20)
        lines = out["stream"]
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]" and '"shutting_down"' in lines[-2], lines[-3:]
        plain_answer = out["plain"]
        assert isinstance(plain_answer, httpx.Response) and plain_answer.status_code == 503, plain_answer

        srv.start()
        assert "Traceback" not in srv.log_tail(400), srv.log_tail()
        tasks = {t["task_id"]: t for t in c.get("/v1/tasks/list").json()["tasks"]}
        assert len(tasks) == 2, tasks
        for t in tasks.values():
            assert (t["status"], t["finish_reason"]) == (3, "interrupted"), t
            assert t["generated_buf"] > 0, t
        # both sessions go on from what they had generated (their tasks, not new ones)
        for sid in ("streamed", "plain"):
            r = c.post("/state/chat/completions", json={"session_id": sid, "contents": ["User: more\n\nAssistant:"],
                                                        "max_tokens": 3, **GREEDY})
            assert r.status_code == 200, r.text
        after = {t["task_id"]: t for t in c.get("/v1/tasks/list").json()["tasks"]}
        assert set(after) == set(tasks)
        assert all(t["finish_reason"] == "length" for t in after.values()), after
