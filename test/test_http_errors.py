"""Bad-input battery against a real server with API keys and tight limits: every answer has the
right status and the OpenAI error shape (never FastAPI's {"detail": ...}), and the server keeps
serving afterwards."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from util_server import running_server, server_fixture

KEY = "test-key-1"
LATIN_KEY, WIDE_KEY = "clé-3", "密钥-4"  # non-ASCII keys: one Latin-1 can carry, one it cannot
server = server_fixture(env={"RWKV_API_KEYS": f"{KEY},other-key,{LATIN_KEY},{WIDE_KEY}", "RWKV_MAX_BODY_BYTES": "65536",
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
    ({"messages": MSG, "max_tokens": 2_000_000}, "max_tokens"),  # the shared bound (types.LIMITS)
    ({"messages": MSG, "max_completion_tokens": 2_000_000}, "max_completion_tokens"),
    ({"messages": MSG, "frequency_penalty": -11}, "frequency_penalty"),
    ({"messages": MSG, "seed": -1}, "seed"),
    ({"messages": MSG, "presence_penalty": 11}, "presence_penalty"),
    ({"messages": MSG, "penalty_decay": 1.5}, "penalty_decay"),
    ({"messages": MSG, "stop": ["a"] * 40}, "stop"),
    ({"messages": MSG, "stop": [""]}, "stop"),
    ({"messages": MSG, "stop": ["x" * 300]}, "stop"),
    ({"messages": MSG, "stop_token_ids": [70000]}, "stop_token_ids"),  # outside the vocabulary
    ({"messages": MSG, "frequency_penalty": 1, "repetition_penalty": 1}, "frequency_penalty"),
    ({"messages": MSG, "stream": "maybe"}, "stream"),
    # strict types: never coerced (OpenAI refuses these too)
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stream": 1}, "stream"),
    ({"messages": MSG, "max_tokens": "5"}, "max_tokens"),
    ({"messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 2.0}, "max_tokens"),
    ({"messages": MSG, "n": True}, "n"),
    ({"messages": MSG, "temperature": "0.5"}, "temperature"),
    ({"messages": MSG, "seed": "7"}, "seed"),
    ({"messages": MSG, "logprobs": "true"}, "logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    # nested objects are strict too (stream_options' bools were coerced: "yes" read as true)
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    # stream_options asks for nothing without a stream (OpenAI refuses it; it was ignored)
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    # metadata is OpenAI's: at most 16 pairs of text (any JSON value was taken)
    ({"messages": MSG, "metadata": {"k": {"nested": 1}}}, "metadata.k"),
    ({"messages": MSG, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"messages": MSG, "metadata": {"k" * 65: "v"}}, "metadata"),
])
def test_chat_bad_fields_400_naming_the_field(http, body, param):
    assert_error(http.post(CHAT, json=body), 400, param)


@pytest.mark.parametrize("body,param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [70000]}, "prompt"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),  # OpenAI's legacy bound: 0..5
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completions_bad_fields_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


def test_a_validators_message_is_its_own_words(http):
    # pydantic's "Value error, " prefix was shown: "invalid 'prompt': Value error, prompt must ..."
    r = http.post("/v1/completions", json={"prompt": []})
    assert r.json()["error"]["message"] == "invalid 'prompt': prompt must not be an empty list", r.text


def test_a_lone_surrogate_stop_string_is_refused_naming_it(http):
    for path, body, status in ((CHAT, {"messages": MSG}, 400), ("/v1/completions", {"prompt": "x"}, 400),
                               ("/v1/tasks/tmp", {"prompt": "x"}, 422)):
        raw = orjson.dumps({**body, "max_tokens": 1})[:-1] + b', "stop": ["a\\ud800"]}'  # JSON text: "a\ud800"
        err = assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), status)
        assert err["param"] == "stop" and "surrogate" in err["message"], err


def test_unknown_fields_are_refused_naming_them(http):
    err = assert_error(http.post(CHAT, json={"messages": MSG, "max_tokens": 1, "bogus_field": 1}), 400, "bogus_field")
    assert "unknown field" in err["message"] and "bogus_field" in err["message"]
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperatur": 0}), 400, "temperatur")
    assert_error(http.post(CHAT, json={"messages": [{"role": "user", "content": "x", "mood": 1}]}), 400,
                 "messages[0].mood")
    assert_error(http.post(CHAT, json={"messages": MSG, "stream": True, "stream_options": {"usage": True}}),
                 400, "stream_options.usage")
    assert_error(http.post("/v1/tasks/tmp", json={"prompt": "x", "n": 2}), 422, "n")  # an OpenAI field


@pytest.mark.parametrize("extra", [
    {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": False,
     "prompt_cache_key": "k", "safety_identifier": "s", "reasoning_effort": "low", "verbosity": "medium",
     "prediction": {"type": "content", "content": "x"}, "prompt_cache_retention": "in_memory"},
    {"tool_choice": "none", "function_call": "auto", "modalities": ["text"], "response_format": {"type": "text"},
     "logit_bias": {}, "logprobs": False, "top_logprobs": 0, "n": None, "stream_options": None},
    {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": "hi", "name": "me"},
                  {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": []},
                  {"role": "user", "content": "again"}]},
], ids=["ignored", "harmless", "stream_options", "message_fields"])
def test_chat_accepts_the_openai_fields_it_can_ignore(http, extra):
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f"}]}, "functions"),  # tools, logprobs, response_format: test_openai_agents.py
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"mode": "block"}}, "moderation"),
    ({"messages": [{"role": "assistant", "audio": {"id": "1"}}]}, "messages[0].content"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_chat_refuses_the_openai_fields_that_would_change_the_answer(http, extra, param):
    err = assert_error(http.post(CHAT, json={"messages": MSG, "max_tokens": 2, **extra}), 400, param)
    assert "not supported" in err["message"]


def test_completions_openai_fields(http):
    ok = {"prompt": "x", "max_tokens": 2, "user": "u", "logit_bias": {}, "best_of": 1, "echo": False, "suffix": None}
    assert http.post("/v1/completions", json=ok).status_code == 200
    for extra, param in (({"best_of": 3}, "best_of"), ({"logit_bias": {"1": 1}}, "logit_bias"),
                         ({"logprobs": 6}, "logprobs")):  # OpenAI's bound: at most 5
        assert_error(http.post("/v1/completions", json={"prompt": "x", **extra}), 400, param)
    scored = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 0}).json()
    assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == 2


def _wait_finished(http, task_id: str, timeout: float = 30) -> None:
    """Poll a task until it ends, so that it holds no queue place (this server's max_queue is 1)."""
    end = time.monotonic() + timeout
    while not http.get(f"/v1/tasks/{task_id}/get_result").json()["finished"]:
        assert time.monotonic() < end, f"task {task_id} still running after {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain",
                                          "application/json; charset=utf-8"])
def test_a_json_body_is_read_whatever_its_content_type(http, content_type):
    """curl -d sends a form content type; some clients send none: a body that parses as JSON is
    JSON on every route."""
    headers = {} if content_type is None else {"content-type": content_type}
    for path, body in ((CHAT, {"messages": MSG, "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/tasks/tmp", {"prompt": "x", "max_tokens": 1})):
        r = http.post(path, content=orjson.dumps(body), headers=headers)
        assert r.status_code == 200, (path, r.text)
    _wait_finished(http, r.json()["task_id"])  # the tmp task answers at once: let it end first
    form = {"content-type": "application/x-www-form-urlencoded"}
    err = assert_error(http.post(CHAT, content=b"messages=hi", headers=form), 400, None)
    assert "not valid JSON" in err["message"]


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


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_a_task_prompt_past_the_limit_is_a_413_also_prefill_only(http, max_tokens):
    """64 tokens at most: 64 ids are taken, 65 refused naming 65, whether the run generates or
    only prefills (its last token held back: it was not counted, so 65 passed)."""
    for route in ("/v1/tasks/tmp", "/v1/tasks/create"):
        ok = http.post(route, json={"prompt": [261] * 64, "max_tokens": max_tokens})
        assert ok.status_code == 200, ok.text
        _wait_finished(http, ok.json()["task_id"])  # (2 slots, 1 waiting: the next test's room)
        err = assert_error(http.post(route, json={"prompt": [261] * 65, "max_tokens": max_tokens}), 413)
        assert err["code"] == "prompt_too_long" and "65" in err["message"], err


def test_queue_full_429_with_retry_after(http):
    """2 slots + a queue of 1: once two long runs hold the slots and a third waits, a request that
    an idle server would take is refused for now (429, Retry-After). One that could never fit is
    a 400 (test_hardening.py)."""
    long_run = {"prompt": "x", "max_tokens": 1_000_000, "ignore_eos": True}
    ids: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while True:  # until both slots and the queue's one place are taken
            r = http.post("/v1/tasks/create", json=long_run)
            if r.status_code == 200:
                ids.append(r.json()["task_id"])
            elif len(ids) >= 3:
                break
            else:  # the engine had not yet moved the first ones into slots
                assert_error(r, 429)
                time.sleep(0.1)
            assert time.monotonic() < deadline, "the queue never filled"
        assert_error(r, 429)
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        err = assert_error(r, 429)
        assert err["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    finally:
        for task_id in ids:
            http.post(f"/v1/tasks/{task_id}/delete", json={})
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


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


def test_non_ascii_keys_are_matched_as_bytes_and_never_fail_the_request(server):
    """A key with non-ASCII characters works as a browser sends it (Latin-1 bytes) and as other
    clients do (UTF-8); a wrong non-ASCII key is a 401 like any wrong key (it used to be a 500:
    hmac.compare_digest refuses non-ASCII str), with its request id."""
    url = server.url + "/v1/models"
    for key in (LATIN_KEY.encode("latin-1"), LATIN_KEY.encode(), WIDE_KEY.encode()):
        assert httpx.get(url, headers={"Authorization": b"Bearer " + key}).status_code == 200, key
    for wrong in ("sécret".encode("latin-1"), "sécret".encode(), "wrong".encode(), "密钥-5".encode()):
        r = httpx.get(url, headers={"Authorization": b"Bearer " + wrong})
        assert_error(r, 401)
        assert r.headers["x-request-id"]
    # the lightning body's password: a JSON string, compared as its UTF-8
    body = {"contents": ["hi"], "max_tokens": 1, "temperature": 0}
    r = httpx.post(server.url + "/v2/chat/completions", json={**body, "password": "sécret"})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized: invalid or missing password"}, r.text
    r = httpx.post(server.url + "/v2/chat/completions", json={**body, "password": WIDE_KEY})
    assert r.status_code == 200, r.text


def _requests_counted(http, route: str, code: int) -> int:
    text = http.get("/metrics").text
    line = f'rwkv_http_requests_total{{method="POST",route="{route}",code="{code}"}} '
    return sum(int(float(x[len(line):])) for x in text.splitlines() if x.startswith(line))


def test_refusals_before_routing_are_counted_under_their_route(http):
    """A wrong key or a body over the limit by its Content-Length is refused before the router
    runs; its metrics line still names the route ("other" is for paths without one)."""
    before = _requests_counted(http, "/v1/completions", 401)
    r = http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401
    assert _requests_counted(http, "/v1/completions", 401) == before + 1
    before = _requests_counted(http, CHAT, 413)
    assert http.post(CHAT, content=b" " * 70_000, headers={"content-type": "application/json"}).status_code == 413
    assert _requests_counted(http, CHAT, 413) == before + 1


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_json_in_another_unicode_encoding_is_refused(http, encoding):
    """JSON bodies are UTF-8 (RFC 8259); json.loads alone would read UTF-16 and UTF-32 too."""
    for path, status in (("/v1/completions", 400), ("/v1/tasks/tmp", 422)):
        body = orjson.dumps({"prompt": "x", "max_tokens": 1}).decode().encode(encoding)
        err = assert_error(http.post(path, content=body, headers={"content-type": "application/json"}), status, None)
        assert "not UTF-8" in err["message"], err


def test_a_utf8_bom_is_read_past(http):
    body = b"\xef\xbb\xbf" + orjson.dumps({"prompt": "x", "max_tokens": 1})
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_compressed_bodies_are_refused_naming_the_encoding(http):
    body = orjson.dumps({"prompt": "x", "max_tokens": 1})
    err = assert_error(http.post("/v1/completions", content=body, headers={"content-encoding": "gzip"}), 415, None)
    assert "gzip" in err["message"]
    assert http.post("/v1/completions", content=body, headers={"content-encoding": "identity"}).status_code == 200


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


def test_the_log_says_why_requests_were_refused_and_stays_quiet_about_answers(http, server):
    """(Runs after the battery.) Refused requests are logged at INFO with their reason; answered
    ones only at DEBUG (the server runs at INFO); the start-up facts say API keys are on."""
    http.post(CHAT, json={"messages": MSG, "temperature": 9})
    httpx.get(server.url + "/v1/models")  # no key: 401
    for _ in range(3):
        assert http.get("/v1/models").status_code == 200
    log = server.log_tail(100000)
    assert "API keys   on (4 keys)" in log
    lines = [ln for ln in log.splitlines() if '"POST /v1/chat/completions" 400' in ln]
    assert any("invalid 'temperature'" in ln for ln in lines), lines[-5:]
    assert any('"GET /v1/models" 401' in ln and "missing API key" in ln for ln in log.splitlines())
    assert not [ln for ln in log.splitlines() if '"GET /v1/models" 200' in ln]
    assert all(ln.split()[1] == "INFO" for ln in lines)


def test_the_access_log_says_every_answer_at_info(tmp_path):
    """--access-log: one INFO line per answered request (probes stay out of it)."""
    with running_server(tmp_path, env={"RWKV_ACCESS_LOG": "1"}) as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        log = srv.log_tail(100000).splitlines()
    (line,) = [ln for ln in log if '"GET /v1/models" 200' in ln]
    assert line.split()[1] == "INFO" and line.rstrip().endswith("ms")
    assert not [ln for ln in log if '"GET /health"' in ln]


def test_the_client_cannot_forge_log_lines(http, server):
    """A path or a field name with a line break is logged escaped, on its own request's line."""
    http.get("/x%0A23:59:59 WARNING server.app [-] FORGED")
    http.post(CHAT, json={"messages": MSG, "bogus\nFORGED2": 1})
    log = server.log_tail(100000).splitlines()
    assert not [ln for ln in log if ln.startswith(("23:59:59 WARNING", "FORGED2"))], log[-5:]
    assert any("/x\\x0a23:59:59 WARNING server.app [-] FORGED" in ln for ln in log), log[-5:]


def test_a_key_does_not_start_from_another_key_s_system_prompt(http, server):
    """The chat-prefix cache is per API key, as the conversation cache is: a second key sending
    a system prompt another key used gets no cached tokens (it would learn that the prompt was
    used, from cached_tokens and the time to first token)."""
    import uuid

    system = f"You are the assistant of project {uuid.uuid4().hex}."  # (this server: 64 prompt tokens)
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}], "max_tokens": 1}

    def cached(headers) -> int:
        r = httpx.post(server.url + CHAT, json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(AUTH) == 0 and cached(AUTH) > 0  # the key's own prefix: kept
    assert cached({"Authorization": "Bearer other-key"}) == 0
