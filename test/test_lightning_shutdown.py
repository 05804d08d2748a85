"""rwkv_lightning sessions and a server shutdown (SIGTERM): a session call that is generating when
the server stops ends `interrupted`, as a task-API run does (docs/task-api.md: `stopped` is a
/stop or a client that left), and the session goes on from it after the restart. A stream the
shutdown cuts sends the text it held (chunk_size) before its `shutting_down` event."""

from __future__ import annotations

import json
import threading
import time

import httpx
from util_lightning import GREEDY
from util_server import running_server

from server.api.metrics import parse_metrics

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


def test_a_stream_cut_by_the_shutdown_sends_the_text_it_held_first(tmp_path):
    """A stream whose chunk_size holds its text until the end (lightning has no bound: one flush
    at the end) sends what it holds before its `shutting_down` event: the client keeps the text
    generated for it, on the batch routes (one prompt: direct writes; two: the loop), the
    OpenAI-style route and a session."""
    huge = {"stream": True, "chunk_size": 10**9, **ENDLESS}
    calls = {
        "one": ("/v1/chat/completions", {"contents": [ASK], **huge}),
        "two": ("/v2/chat/completions", {"contents": [ASK, "Once upon a time"], **huge}),
        "chat": ("/openai/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **huge}),
        "session": ("/state/chat/completions", {"session_id": "held", "contents": [ASK], **huge}),
    }
    with running_server(tmp_path) as srv:
        out: dict[str, list[str]] = {}

        def stream(name: str) -> None:
            path, body = calls[name]
            with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
                out[name] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=stream, args=(name,)) for name in calls]
        for t in threads:
            t.start()
        _running(srv.url, 5)
        deadline = time.monotonic() + 60
        while _generated(srv.url) < 200:  # a few dozen tokens each, none of them sent yet
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.05)
        srv.stop(timeout=20)
        for t in threads:
            t.join(timeout=20)
    for name, lines in out.items():
        assert lines[-1] == "data: [DONE]" and '"shutting_down"' in lines[-2], (name, lines[-3:])
        events = [json.loads(line[6:]) for line in lines[:-2]]
        text = "".join(ch["delta"].get("content", "") for ev in events for ch in ev["choices"])
        assert text, (name, lines)  # without the flush: nothing but the shutting_down event
    assert len({ch["index"] for ev in (json.loads(x[6:]) for x in out["two"][:-2]) for ch in ev["choices"]}) == 2


def _generated(url: str) -> float:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text).get("rwkv_generation_tokens_total", 0.0)
