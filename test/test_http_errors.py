"""Bad-input battery against a real server with API keys and tight limits: every answer has the
right status and the OpenAI error shape (never FastAPI's {"detail": ...}), and the server keeps
serving afterwards."""

from __future__ import annotations

import httpx
import pytest
from util_server import server_fixture

KEY = "test-key-1"
server = server_fixture(env={"RWKV_API_KEYS": f"{KEY},other-key", "RWKV_MAX_BODY_BYTES": "65536",
                             "RWKV_MAX_PROMPT_TOKENS": "64", "RWKV_MAX_BATCH": "2", "RWKV_MAX_QUEUE": "1"})
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param != "<any>":
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,param", [
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": 9}, "temperature"),
    ({"messages": MSG, "top_p": 1.5}, "top_p"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "n": 1000}, "n"),
    ({"messages": MSG, "max_tokens": -1}, "max_tokens"),
    ({"messages": MSG, "presence_penalty": 11}, "presence_penalty"),
    ({"messages": MSG, "penalty_decay": 1.5}, "penalty_decay"),
    ({"messages": MSG, "stop": ["a"] * 40}, "stop"),
    ({"messages": MSG, "stop": [""]}, "stop"),
    ({"messages": MSG, "stream": "maybe"}, "stream"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
])
def test_chat_bad_fields_400_naming_the_field(http, body, param):
    assert_error(http.post(CHAT, json=body), 400, param)


@pytest.mark.parametrize("body,param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [70000]}, "prompt"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
])
def test_completions_bad_fields_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


def test_malformed_json(http):
    for path, status in ((CHAT, 400), ("/v1/completions", 400), ("/v1/tasks/create", 422)):
        r = http.post(path, content=b'{"messages": [', headers={"content-type": "application/json"})
        if r.status_code == 404 and path.startswith("/v1/tasks"):
            pytest.skip("task routes not mounted")
        assert_error(r, status, None)
    assert_error(http.post(CHAT, content=b"not json"), 400, None)  # no content-type


def test_task_routes_validation_is_422(http):
    r = http.post("/v1/tasks/create", json={"prompt": "x", "temperature": "hot"})
    if r.status_code == 404:
        pytest.skip("task routes not mounted")
    assert_error(r, 422, "temperature")


def test_unknown_ids_routes_and_methods(http):
    err = assert_error(http.get("/v1/tasks/TASK_0123456789abcdef0123456789abcdef/get_result"), 404)
    assert err["type"] == "not_found_error"
    assert_error(http.get("/v1/no/such/route"), 404, None)
    assert_error(http.get("/nothing"), 404, None)
    assert_error(http.delete("/v1/models"), 405, None)
    assert_error(http.get(CHAT), 405, None)


def test_huge_bodies_413(http):
    big = {"messages": [{"role": "user", "content": "x" * 100_000}]}
    err = assert_error(http.post(CHAT, json=big), 413)
    assert err["type"] == "request_too_large"

    def chunks():
        for _ in range(20):
            yield b" " * 8192

    assert_error(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)


def test_prompt_too_long_413(http):
    err = assert_error(http.post("/v1/completions", json={"prompt": "word " * 200, "max_tokens": 1}), 413)
    assert err["code"] == "prompt_too_long"
    assert_error(http.post(CHAT, json={"messages": [{"role": "user", "content": "word " * 200}]}), 413)


def test_queue_full_429_with_retry_after(http):
    # 2 slots + a queue of 1: a request for 4 sequences cannot all be accepted
    r = http.post("/v1/completions", json={"prompt": "x", "n": 4, "max_tokens": 2000, "ignore_eos": True})
    assert_error(r, 429)
    assert int(r.headers["retry-after"]) >= 1


def test_api_keys(server):
    url = server.url
    err = assert_error(httpx.get(url + "/v1/models"), 401)
    assert err["type"] == "authentication_error"
    assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_error(httpx.post(url + "/v1/tasks/create", json={"prompt": "x"}), 401)
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer other-key"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_request_id_header(http):
    r = http.get("/v1/models", headers={"X-Request-Id": "my-req-42"})
    assert r.headers["x-request-id"] == "my-req-42"
    r2 = http.post(CHAT, json={})
    assert len(r2.headers["x-request-id"]) >= 16
    r3 = http.get("/v1/models", headers={"X-Request-Id": "bad id with spaces"})
    assert r3.headers["x-request-id"] != "bad id with spaces"


def test_still_serving_after_the_battery(http, server):
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert server.alive
    assert "Traceback" not in server.log_tail(400)


def test_tasks_belong_to_the_key_that_made_them(http, server):
    r = http.post("/v1/tasks/create", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    task_id = r.json()["task_id"]
    other = {"Authorization": "Bearer other-key"}
    assert_error(httpx.get(f"{server.url}/v1/tasks/{task_id}/get_result", headers=other), 404)
    assert http.get(f"/v1/tasks/{task_id}/get_result").status_code == 200
