"""State export (GET /v1/tasks/{id}/state) and import (POST /v1/states/{name}) against a real server:
export -> import -> generate gives the original task's greedy tokens; the round trip is bit-exact."""

from __future__ import annotations

import io
import time

import httpx
import pytest
import torch
from util_server import server_fixture

from server.model.synthetic import PRESETS

server = server_fixture()
GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}
SHAPE = PRESETS["tiny"]


def _wait(srv, task_id: str) -> dict:
    deadline = time.monotonic() + 60
    while not (r := httpx.get(f"{srv.url}/v1/tasks/{task_id}/get_result").json())["finished"]:
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def _fork(srv, source: str, **body) -> str:
    r = httpx.post(f"{srv.url}/v1/tasks/{source}/fork", json={**GREEDY, "max_tokens": 16, **body})
    assert r.status_code == 200, r.text
    return _wait(srv, r.json()["task_id"])["result"]


def _export(srv, task_id: str, fmt: str = "full") -> httpx.Response:
    r = httpx.get(f"{srv.url}/v1/tasks/{task_id}/state", params={"format": fmt})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    return r


def _load(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.fixture(scope="module")
def task(server) -> str:
    r = httpx.post(server.url + "/v1/tasks/create", json={"prompt": "The history of the city begins", "max_tokens": 8,
                                                         **GREEDY})
    assert r.status_code == 200, r.text
    return _wait(server, r.json()["task_id"])["task_id"]


def test_export_import_generate_equals_the_original(server, task):
    exported = _export(server, task)
    assert exported.headers["x-rwkv-state-format"] == "full" and exported.headers["x-rwkv-pending-count"] == "1"
    r = httpx.post(server.url + "/v1/states/copy", content=exported.content)
    assert r.status_code == 201, r.text
    assert r.json()["format"] == "full" and r.json()["pending_tokens"] == 1
    for prompt in ("\n\nThe next chapter", None):  # with a new prompt, and going on from where it stopped
        body = {"prompt": prompt} if prompt else {}
        original, imported = _fork(server, task, **body), _fork(server, "_copy", **body)
        assert original == imported and original
    again = _load(_export(server, "_copy").content)  # the round trip is bit-exact, pending tokens included
    first = _load(exported.content)
    assert set(again) == set(first) and len(first) == SHAPE.n_layer + 4
    for key, value in first.items():
        if key != "rwkv_server.meta":
            assert torch.equal(again[key], value), key


def test_plain_export_is_the_bare_file_other_tools_load(server, task):
    r = _export(server, task, "rwkv")
    sd = _load(r.content)
    assert sorted(sd) == [f"blocks.{i}.att.time_state" for i in range(SHAPE.n_layer)]
    assert sd["blocks.0.att.time_state"].shape == (SHAPE.n_head, SHAPE.head_size, SHAPE.head_size)
    full = _load(_export(server, task).content)
    assert all(torch.equal(sd[k], full[k]) for k in sd)
    pending = full["rwkv_server.pending"].tolist()
    assert r.headers["x-rwkv-pending-tokens"] == ",".join(map(str, pending))
    assert r.headers["x-rwkv-model"] == SHAPE.signature()
    imported = httpx.post(server.url + "/v1/states/plain", content=r.content)
    assert imported.status_code == 201 and imported.json()["pending_tokens"] == 0
    again = _load(_export(server, "_plain").content)
    assert torch.equal(again["rwkv_server.att_shift"], torch.zeros_like(full["rwkv_server.att_shift"]))
    assert all(torch.equal(again[k], full[k]) for k in sd)  # the WKV part is exact; shifts start at zero


def test_export_errors(server):
    r = httpx.get(server.url + "/v1/tasks/TASK_0123/state")
    assert r.status_code == 404 and r.json()["error"]["code"] == "task_not_found"
    r = httpx.get(server.url + "/v1/tasks/_nothing/state", params={"format": "zip"})
    assert r.status_code == 422
    t = httpx.post(server.url + "/v1/tasks/create", json={"prompt": "Once", "max_tokens": 100000,
                                                         "ignore_eos": True}).json()["task_id"]
    try:
        r = httpx.get(f"{server.url}/v1/tasks/{t}/state")
        assert r.status_code == 409 and "running" in r.json()["error"]["message"]
    finally:
        httpx.post(f"{server.url}/v1/tasks/{t}/stop", json={})
    _wait(server, t)
    assert _load(_export(server, t).content)["rwkv_server.pending"].numel() == 1
    one = httpx.post(server.url + "/v1/tasks/create", json={"prompt": "Once", "max_tokens": 0}).json()["task_id"]
    _wait(server, one)  # its one token is pending: no state was computed, none was dropped
    r = httpx.get(f"{server.url}/v1/tasks/{one}/state")
    assert r.status_code == 409 and r.json()["error"]["code"] == "state_not_kept"
    assert "max_tokens of at least 1" in r.json()["error"]["message"] and "budget" not in r.json()["error"]["message"]
