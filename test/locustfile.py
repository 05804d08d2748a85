"""Locust load test for the server (not part of pytest).

    rwkv-server --model synthetic:tiny --port 8000 &                 # or a real model
    locust -f test/locustfile.py --headless -u 50 -r 10 -t 60s --host http://127.0.0.1:8000

Users (weights in brackets): ChatStreamUser [3] streams /v1/chat/completions; TaskPollUser [1]
creates a task and polls get_result; TemplateForkUser [1] forks a shared template and streams it.
Besides the HTTP rows, custom rows report per-request figures through Locust's request event:
`TTFT <kind>` (ms from sending the request to the first generated text) and `TOK/S <kind>` (the
"response time" column holds that request's decode speed in tokens/s after its first token; read
its percentiles).
Env: LOCUST_API_KEY (Bearer key), LOCUST_MAX_TOKENS (default 32).
"""

from __future__ import annotations

import json
import os
import threading
import time

from locust import HttpUser, between, events, task

MAX_TOKENS = int(os.environ.get("LOCUST_MAX_TOKENS", "32"))
API_KEY = os.environ.get("LOCUST_API_KEY", "")
TEMPLATE_PROMPT = ("System: You are a helpful assistant who answers in one short sentence.\n\n"
                   "User: What is the capital of France?\n\nAssistant: Paris.\n\n")
_template: dict[str, str] = {}
_template_lock = threading.Lock()


def record(kind: str, name: str, value: float, exc: Exception | None = None) -> None:
    events.request.fire(request_type=kind, name=name, response_time=value, response_length=0,
                        exception=exc, context={})


def sse_lines(response):
    """`data:` payloads of an SSE response (comments and blank lines skipped)."""
    for raw in response.iter_lines():
        line = raw.decode() if isinstance(raw, bytes) else raw
        if line.startswith("data: "):
            yield line[6:]


class _Base(HttpUser):
    abstract = True
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def _stream(self, method: str, path: str, body: dict, name: str, kind: str, text_of) -> None:
        """Run one SSE request; record TTFT and tokens/s. text_of(obj) -> (text, tokens or None)."""
        t0 = time.perf_counter()
        first = None
        tokens = 0
        with self.client.request(method, path, json=body, stream=True, name=name, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            try:
                for data in sse_lines(r):
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        raise RuntimeError(obj["error"].get("message"))
                    text, n = text_of(obj)
                    if text and first is None:
                        first = time.perf_counter()
                    if n is not None:
                        tokens = n
                else:
                    raise RuntimeError("stream ended without [DONE]")
            except Exception as exc:  # noqa: BLE001
                r.failure(str(exc))
                return
            r.success()
        end = time.perf_counter()
        if first is not None:
            record("TTFT", kind, (first - t0) * 1000)
            if tokens > 1 and end > first:
                record("TOK/S", kind, (tokens - 1) / (end - first))  # decode speed after the first token


class ChatStreamUser(_Base):
    weight = 3

    @task
    def chat_stream(self) -> None:
        body = {"model": "rwkv", "stream": True, "max_tokens": MAX_TOKENS, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}

        def text_of(obj):
            if obj.get("usage"):
                return "", obj["usage"]["completion_tokens"]
            ch = obj.get("choices") or [{}]
            return (ch[0].get("delta") or {}).get("content") or "", None

        self._stream("POST", "/v1/chat/completions", body, "/v1/chat/completions [stream]", "chat", text_of)


class TaskPollUser(_Base):
    weight = 1

    @task
    def create_and_poll(self) -> None:
        t0 = time.perf_counter()
        r = self.client.post("/v1/tasks/create", json={"prompt": "User: Tell me a fact.\n\nAssistant:",
                                                       "max_tokens": MAX_TOKENS})
        if r.status_code != 200:
            return
        task_id = r.json()["task_id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            g = self.client.get(f"/v1/tasks/{task_id}/get_result", name="/v1/tasks/[id]/get_result")
            if g.status_code != 200 or g.json().get("finished"):
                break
            time.sleep(0.2)
        else:
            record("TASK", "poll timeout", (time.perf_counter() - t0) * 1000, RuntimeError("not finished in 120s"))
            return
        body = g.json() if g.status_code == 200 else {}
        record("TASK", "create->finished", (time.perf_counter() - t0) * 1000)
        if body.get("speed"):
            record("TOK/S", "task", float(body["speed"]))
        self.client.post(f"/v1/tasks/{task_id}/delete", json={}, name="/v1/tasks/[id]/delete")


class TemplateForkUser(_Base):
    weight = 1

    def _template_id(self) -> str | None:
        with _template_lock:
            if "id" in _template:
                return _template["id"]
            r = self.client.post("/v1/tasks/create", json={"prompt": TEMPLATE_PROMPT, "max_tokens": 0},
                                 name="template setup: create")
            if r.status_code != 200:
                return None
            tid = r.json()["task_id"]
            for _ in range(600):
                g = self.client.get(f"/v1/tasks/{tid}/get_result", name="template setup: wait")
                if g.status_code == 200 and g.json().get("finished"):
                    break
                time.sleep(0.1)
            t = self.client.post(f"/v1/tasks/{tid}/as_template", json={}, name="template setup: as_template")
            if t.status_code != 200:
                return None
            _template["id"] = t.json()["task_id"]
            return _template["id"]

    @task
    def fork_and_stream(self) -> None:
        tid = self._template_id()
        if tid is None:
            return
        body = {"prompt": "User: And of Germany?\n\nAssistant:", "max_tokens": MAX_TOKENS, "stream": True}

        def text_of(obj):
            if obj.get("finished"):
                return "", (obj.get("usage") or {}).get("completion_tokens")
            return obj.get("data") or "", None

        self._stream("POST", f"/v1/tasks/{tid}/fork?tmp=true", body, "/v1/tasks/[tmpl]/fork [stream]", "fork",
                     text_of)
