"""/openapi.json lists the statuses the layers below the routes give (server.api.openapi.HTTP_LAYER) on
the operations that can get them, with the error model: 408 (the read deadlines of
server.api.http_limits) on every operation, 413 (the middleware's body limit) and 415 (a Content-
Encoding) on every operation with a body. Checked against a real server, whose actual 408 and 413
answers are then matched with what its document says for those operations."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import orjson
import pytest
from util_server import server_fixture

server = server_fixture(env={"RWKV_HEADER_TIMEOUT": "1", "RWKV_BODY_TIMEOUT": "1", "RWKV_MAX_BODY_BYTES": "4096"})
ERROR_REF = "#/components/schemas/ErrorResponse"


@pytest.fixture(scope="module")
def doc(server) -> dict[str, Any]:
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m.upper(), p, op) for p, ops in doc["paths"].items() for m, op in ops.items()]


def error_model(doc: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    schema = response["content"]["application/json"]["schema"]
    assert schema == {"$ref": ERROR_REF}, schema
    return doc["components"]["schemas"]["ErrorResponse"]


def test_every_operation_lists_408_and_every_body_413_and_415(doc):
    ops = operations(doc)
    assert len(ops) > 30 and any("requestBody" in op for _, _, op in ops)
    for method, path, op in ops:
        responses = op["responses"]
        assert "408" in responses, (method, path, sorted(responses))
        if "requestBody" in op:
            assert "413" in responses and "415" in responses, (method, path, sorted(responses))
            assert "--body-timeout" in responses["408"]["description"], (method, path)
        else:
            assert "--body-timeout" not in responses["408"]["description"], (method, path)
        error_model(doc, responses["408"])  # the deadline's body is ours on every route family
        assert list(responses) == sorted(responses, key=lambda s: (not s.isdigit(), s)), (method, path)


def test_the_lightning_routes_list_what_they_answer(doc):
    paths = doc["paths"]
    for path in ("/state/status", "/state/delete"):  # the middleware's body limit
        error_model(doc, paths[path]["post"]["responses"]["413"])
    assert "409" in paths["/state/delete"]["post"]["responses"]  # a session running on another replica
    # a 413 a route declares itself keeps its family's description and schema
    mine = paths["/v2/chat/completions"]["post"]["responses"]["413"]
    assert mine["description"] == "a prompt or the body is too large", mine
    upload = paths["/v1/states/{name}"]["post"]["responses"]["413"]
    assert upload["description"] == "the file is over state_upload_bytes", upload


def _raw(server, request: bytes, wait: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as it is (and nothing more), read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        s.sendall(request)
        data = b""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _documented(doc: dict[str, Any], method: str, path: str, status: int, body: bytes) -> None:
    """The answer's status is listed for the operation, and its body has the listed model's shape."""
    responses = doc["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, (method, path, status, sorted(responses))
    model = error_model(doc, responses[str(status)])
    err = orjson.loads(body)
    assert set(err) == set(model["required"]) == {"error"}, err
    detail = doc["components"]["schemas"][model["properties"]["error"]["$ref"].rsplit("/", 1)[-1]]
    assert set(err["error"]) == set(detail["properties"]), err


@pytest.mark.parametrize(("method", "path", "url"), [
    ("POST", "/state/status", "/state/status"),
    ("POST", "/v1/chat/completions", "/v1/chat/completions"),
    ("POST", "/v1/tasks/{task_id}/continue", "/v1/tasks/TASK_x/continue"),
])
def test_a_late_body_is_a_documented_408(server, doc, method, path, url):
    status, headers, body = _raw(server, f"{method} {url} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                         f"content-length: 100\r\n\r\n{{\"a\":".encode())
    assert status == 408 and headers["connection"] == "close", (status, body)
    _documented(doc, method, path, status, body)


def test_late_headers_are_a_documented_408(server, doc):
    status, _, body = _raw(server, b"GET /v1/tasks/list HTTP/1.1\r\nhost: x\r\n")
    assert status == 408, body
    _documented(doc, "GET", "/v1/tasks/list", status, body)


@pytest.mark.parametrize("path", ["/state/status", "/state/delete", "/v1/tasks/create"])
def test_a_body_over_the_limit_is_a_documented_413(server, doc, path):
    r = httpx.post(server.url + path, content=b'{"x": "' + b"y" * 5000 + b'"}', timeout=30)
    assert r.status_code == 413, r.text
    _documented(doc, "POST", path, r.status_code, r.content)


@pytest.mark.parametrize("path", ["/state/status", "/v1/tasks/create", "/v1/chat/completions"])
def test_a_compressed_body_is_a_documented_415_and_a_get_is_answered(server, doc, path):
    r = httpx.post(server.url + path, content=b"\x1f\x8b", headers={"content-encoding": "gzip"}, timeout=30)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_encoding", r.text
    _documented(doc, "POST", path, r.status_code, r.content)
    # a GET's body is never read: its Content-Encoding changes nothing
    r = httpx.get(server.url + "/v1/tasks/list", headers={"content-encoding": "gzip"}, timeout=30)
    assert r.status_code == 200, r.text
