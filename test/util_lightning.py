"""Helpers of the rwkv_lightning tests (test/test_lightning*.py): SSE parsing, metrics reads."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson

from server.api.metrics import parse_metrics

GREEDY = {"temperature": 0.0, "stop_tokens": [], "ignore_eos": True}
"""Deterministic, fixed-length answers (lightning has no seed; greedy decoding is reproducible)."""


def sse(r: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE answer, in order ("[DONE]" kept as the string)."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out: list[Any] = []
    for line in r.text.split("\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else orjson.loads(data))
        else:
            assert line == "" or line.startswith(":"), line
    return out


def texts_by_index(events: list[Any]) -> dict[int, str]:
    """Concatenated native delta text per choice index."""
    out: dict[int, str] = {}
    for ev in events:
        if isinstance(ev, dict) and ev.get("object") == "chat.completion.chunk":
            for ch in ev["choices"]:
                out[ch["index"]] = out.get(ch["index"], "") + ch["delta"].get("content", "")
    return out


def metric(c: httpx.Client, name: str) -> float:
    return parse_metrics(c.get("/metrics").text).get(name, 0.0)


def idle(c: httpx.Client) -> dict[str, Any]:
    """/health once nothing runs or waits (what a refused request must leave behind)."""
    h = c.get("/health").json()
    assert h["running"] == 0 and h["waiting"] == 0, h
    return h


def post_escaped(c: httpx.Client, path: str, body: Any, **kw: Any) -> httpx.Response:
    """POST body as ASCII JSON: a lone surrogate in it travels as its "\\ud800" escape (httpx's
    `json=` writes UTF-8, which cannot carry one)."""
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return c.post(path, content=json.dumps(body).encode("ascii"), headers=headers, **kw)
