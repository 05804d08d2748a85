"""Hostile and malformed input against a real server: bad stop rules, lone surrogates, bodies that
do not parse or nest deeply, limits (max_tokens, list bounds, the queue, connections, half-open
connections), another key's templates, failures after submission, bounded state bytes and two
servers on one SQLite file. Each is refused before anything is submitted or stored (or ends
cleanly), nothing is left running or half-created, and the server keeps serving."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import httpx
import pytest
from util_server import inprocess_server, running_server, server_fixture

K1, K2 = "hard-key-1", "hard-key-2"
A1, A2 = {"Authorization": f"Bearer {K1}"}, {"Authorization": f"Bearer {K2}"}
MAX_TOKENS_LIMIT = 1_000_000  # below the API's own bound (1,048,576)
server = server_fixture(env={"RWKV_API_KEYS": f"{K1},{K2}", "RWKV_MAX_BATCH": "8", "RWKV_MAX_QUEUE": "4",
                             "RWKV_MAX_TOKENS_LIMIT": str(MAX_TOKENS_LIMIT)})
RAW_JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def c1(server):
    with httpx.Client(base_url=server.url, headers=A1, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def c2(server):
    with httpx.Client(base_url=server.url, headers=A2, timeout=30) as c:
        yield c


def err(r: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    assert e["code"] is not None, e
    if param != "<any>":
        assert e["param"] == param, e
    return e


def idle(c: httpx.Client, timeout: float = 10.0) -> dict:
    """/health once nothing runs or waits (fails the test if sequences keep running)."""
    deadline = time.monotonic() + timeout
    while True:
        h = c.get("/health").json()
        if h.get("running") == 0 and h.get("waiting") == 0:
            return h
        assert time.monotonic() < deadline, f"sequences still running: {h}"
        time.sleep(0.1)


def finished(c: httpx.Client, task_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = c.get(f"/v1/tasks/{task_id}/get_result").json()
        if body.get("finished"):
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def unfinished_tasks(c: httpx.Client) -> list[dict]:
    items = c.get("/v1/tasks/list", params={"limit": 1000}).json()["tasks"]
    return [t for t in items if t["status"] != 3]


BAD_STOPS = [
    ({"stop_token_ids": [99999999999999999999999]}, "stop_token_ids"),
    ({"stop_token_ids": [65536]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
]


# --- 1. bad stop rules: refused before anything is submitted or stored --------------------------
@pytest.mark.parametrize("extra,param", BAD_STOPS)
@pytest.mark.parametrize("route", ["/v1/tasks/create", "/v1/tasks/tmp"])
def test_bad_stop_token_ids_refused_before_submission(c1, route, extra, param):
    before = len(unfinished_tasks(c1))
    err(c1.post(route, json={"prompt": "Hello", "max_tokens": 50, **extra}), 422, param)
    idle(c1)
    assert len(unfinished_tasks(c1)) == before


@pytest.mark.parametrize("route", ["/v1/tasks/create", "/v1/tasks/tmp"])
def test_lone_surrogate_stop_string_refused(c1, route):
    body = b'{"prompt": "Hello", "max_tokens": 50, "stop": ["\\ud800"]}'
    err(c1.post(route, content=body, headers=RAW_JSON), 422, "stop")
    idle(c1)
    assert unfinished_tasks(c1) == []


@pytest.mark.parametrize("op", ["continue", "fork"])
def test_bad_stop_on_continue_and_fork_leaves_the_task_usable(c1, op):
    tid = c1.post("/v1/tasks/create", json={"prompt": "Hi", "max_tokens": 2}).json()["task_id"]
    finished(c1, tid)
    err(c1.post(f"/v1/tasks/{tid}/{op}", json={"max_tokens": 50, "stop_token_ids": [10**22]}), 422)
    raw = b'{"max_tokens": 5, "stop": ["ok", "\\udfff"]}'
    err(c1.post(f"/v1/tasks/{tid}/{op}", content=raw, headers=RAW_JSON), 422, "stop")
    idle(c1)
    assert c1.get(f"/v1/tasks/{tid}/status").json()["status"] == 3
    r = c1.post(f"/v1/tasks/{tid}/{op}", json={"max_tokens": 2})  # not 409: nothing got stuck
    assert r.status_code == 200, r.text
    finished(c1, r.json()["task_id"])


def test_max_tokens_beyond_the_server_limit_is_refused_naming_it(c1):
    over = MAX_TOKENS_LIMIT + 1
    e = err(c1.post("/v1/tasks/tmp", json={"prompt": "x", "max_tokens": over}), 422, "max_tokens")
    assert str(MAX_TOKENS_LIMIT) in e["message"]
    err(c1.post("/v1/completions", json={"prompt": "x", "max_tokens": over}), 400, "max_tokens")
    msgs = [{"role": "user", "content": "hi"}]
    err(c1.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": over}), 400,
        "max_completion_tokens")
    idle(c1)


def test_the_max_tokens_limit_caps_the_default():
    from server.config import Settings

    assert Settings.from_env({"RWKV_MAX_TOKENS_LIMIT": "16"}).default_max_tokens == 16
    assert Settings(max_tokens_limit=1000, default_max_tokens=300).default_max_tokens == 300
    assert Settings().default_max_tokens == 256 and Settings().max_tokens_limit == 0


# --- 1b. a failure after submission stops what the request started --------------------------------
@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    """A real uvicorn server in this process, so a test can make a step after submission fail."""
    from server.config import Settings

    db = tmp_path_factory.mktemp("inproc") / "tasks.db"
    with inprocess_server(Settings(device="cpu", db=str(db), stats_interval=0, max_batch=8)) as (url, _):
        yield url


def _broken(*args, **kwargs):
    raise RuntimeError("injected failure after submission")


LONG = {"max_tokens": 1_000_000, "ignore_eos": True, "stream": True}


def test_a_failure_after_submission_aborts_every_choice(inproc, monkeypatch):
    from server.api.openai import render

    monkeypatch.setattr(render, "completion_renderer", _broken)
    with httpx.Client(base_url=inproc, timeout=30) as c:
        err(c.post("/v1/completions", json={"prompt": "x", "n": 4, **LONG}), 500)
        idle(c)


def test_a_failure_after_a_task_started_stops_and_settles_it(inproc, monkeypatch):
    from server.api.tasks import routes

    monkeypatch.setattr(routes, "TaskStream", _broken)
    with httpx.Client(base_url=inproc, timeout=30) as c:
        for path in ("/v1/tasks/create", "/v1/tasks/tmp"):
            err(c.post(path, json={"prompt": "x", **LONG}), 500)
        idle(c)
        deadline = time.monotonic() + 10  # a TASK_ settles once its final row is written
        while unfinished_tasks(c):
            assert time.monotonic() < deadline, unfinished_tasks(c)
            time.sleep(0.05)
        assert {t["finish_reason"] for t in c.get("/v1/tasks/list").json()["tasks"]} == {"stopped"}


# --- 2. completions echo with a lone surrogate --------------------------------------------------
def test_completions_lone_surrogate_prompt_is_400_and_nothing_runs(c1):
    raw = b'{"prompt": "a\\udfffb", "echo": true, "stream": true, "n": 4, "max_tokens": 1000000}'
    e = err(c1.post("/v1/completions", content=raw, headers=RAW_JSON), 400, "prompt")
    assert "surrogate" in e["message"] or "UTF-8" in e["message"]
    idle(c1)
    raw = b'{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 5}'
    err(c1.post("/v1/chat/completions", content=raw, headers=RAW_JSON), 400)
    idle(c1)


# --- 3. templates are private to their key unless published ---------------------------------------
def test_templates_are_private_to_their_key(c1, c2):
    tid = c1.post("/v1/tasks/create", json={"prompt": "secret prompt", "max_tokens": 0}).json()["task_id"]
    finished(c1, tid)
    r = c1.post(f"/v1/tasks/{tid}/as_template", params={"name": "k1private"})
    assert r.status_code == 200, r.text
    tpl = r.json()["task_id"]
    assert tpl == "_k1private"
    for path in (f"/v1/tasks/{tpl}/get_result", f"/v1/tasks/{tpl}/status", f"/v1/tasks/{tpl}/stream"):
        err(c2.get(path), 404)
    err(c2.post(f"/v1/tasks/{tpl}/fork", json={"prompt": "x", "max_tokens": 1}), 404)
    err(c2.post(f"/v1/tasks/{tpl}/fork", params={"tmp": "true"}, json={"max_tokens": 1}), 404)
    err(c2.post(f"/v1/tasks/{tpl}/as_template", params={"name": "stolen"}), 404)
    for op in ("continue", "stop", "delete"):
        err(c2.post(f"/v1/tasks/{tpl}/{op}", params={"force": "true"}, json={}), 404)
    assert tpl not in [t["task_id"] for t in c2.get("/v1/tasks/list").json()["tasks"]]
    # names are per key: k2 may use the same name for its own template, and k1 keeps its own
    own = c2.post("/v1/tasks/create", json={"prompt": "a longer prompt of key two", "max_tokens": 0}).json()
    finished(c2, own["task_id"])
    r = c2.post(f"/v1/tasks/{own['task_id']}/as_template", params={"name": "k1private"})
    assert r.status_code == 200, r.text
    assert r.json()["task_id"] == tpl  # the same name, k2's own template
    mine = c1.get(f"/v1/tasks/{tpl}/get_result").json()
    theirs = c2.get(f"/v1/tasks/{tpl}/get_result").json()
    assert mine["prompt_tokens"] != theirs["prompt_tokens"], (mine, theirs)
    fork1 = c1.post(f"/v1/tasks/{tpl}/fork", json={"max_tokens": 1}).json()["task_id"]
    fork2 = c2.post(f"/v1/tasks/{tpl}/fork", json={"max_tokens": 1}).json()["task_id"]
    assert finished(c1, fork1)["finished"] and finished(c2, fork2)["finished"]
    err(c1.get(f"/v1/tasks/{fork2}/get_result"), 404)


def test_published_template_is_readable_and_forkable_by_every_key(c1, c2):
    tid = c1.post("/v1/tasks/create", json={"prompt": "shared prompt", "max_tokens": 0}).json()["task_id"]
    finished(c1, tid)
    r = c1.post(f"/v1/tasks/{tid}/as_template", params={"name": "k1public", "public": "true"})
    assert r.status_code == 200, r.text
    tpl = r.json()["task_id"]
    assert c2.get(f"/v1/tasks/{tpl}/get_result").status_code == 200
    assert tpl in [t["task_id"] for t in c2.get("/v1/tasks/list").json()["tasks"]]
    fork = c2.post(f"/v1/tasks/{tpl}/fork", json={"max_tokens": 1})
    assert fork.status_code == 200, fork.text
    err(c1.get(f"/v1/tasks/{fork.json()['task_id']}/get_result"), 404)  # the fork is k2's own
    err(c2.post(f"/v1/tasks/{tpl}/delete", params={"force": "true"}, json={}), 403)  # read-only for others
    err(c2.post(f"/v1/tasks/{tpl}/continue", params={"force": "true"}, json={}), 403)


# --- 4. list bounds --------------------------------------------------------------------------------
@pytest.mark.parametrize("params,param", [({"offset": 10**30}, "offset"), ({"limit": 10**30}, "limit"),
                                          ({"offset": -1}, "offset"), ({"limit": 0}, "limit")])
def test_list_bounds(c1, params, param):
    err(c1.get("/v1/tasks/list", params=params), 422, param)


# --- 5. parse errors and schema gaps answer in the route family's shape ----------------------------
BAD_BODIES = [
    (b'{"prompt": "\xff\xfe"}', None),  # invalid UTF-8
    (b'{"prompt": ' + b"[" * 1200 + b"]" * 1200 + b"}", None),  # nested 1,200 deep
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),  # a 5,000-digit integer
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_unparseable_bodies_on_task_routes_are_422(c1, body, param):
    e = err(c1.post("/v1/tasks/create", content=body, headers=RAW_JSON), 422)
    assert e["code"] == "invalid_request"
    if param is not None:
        assert e["param"] == param


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_unparseable_bodies_on_openai_routes_are_400(c1, body, param):
    e = err(c1.post("/v1/completions", content=body, headers=RAW_JSON), 400)
    assert e["code"] == "invalid_request"


def test_lone_surrogate_persistent_prompt_is_422_and_creates_nothing(c1):
    before = c1.get("/v1/tasks/list", params={"limit": 1000}).json()
    raw = b'{"prompt": "hi \\ud83d there", "max_tokens": 3}'
    e = err(c1.post("/v1/tasks/create", content=raw, headers=RAW_JSON), 422, "prompt")
    assert "surrogate" in e["message"] or "UTF-8" in e["message"]
    after = c1.get("/v1/tasks/list", params={"limit": 1000}).json()
    assert after["total_count"] == before["total_count"]
    assert after["cpu_tasks"] == before["cpu_tasks"]


@pytest.mark.parametrize("prompt", ["", [], [False], [True, 5], [1.5], [-3], [65536]])
def test_bad_prompts_refused_by_the_schema(c1, prompt):
    err(c1.post("/v1/tasks/tmp", json={"prompt": prompt, "max_tokens": 1}), 422, "prompt")


def test_the_schema_says_a_prompt_is_never_empty(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    body = schema["paths"]["/v1/tasks/create"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    while "$ref" in body:
        body = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
    branches = body["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1}.items() <= next(b for b in branches if b.get("type") == "string").items()
    arr = next(b for b in branches if b.get("type") == "array")
    assert arr["minItems"] == 1 and arr["items"]["minimum"] == 0, arr


# --- 6. the OpenAPI schema tells the truth ----------------------------------------------------------
def test_openapi_documents_error_statuses_and_sse(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    need = {
        ("/v1/tasks/create", "post"): {"200", "401", "413", "422", "429", "503"},
        ("/v1/tasks/{task_id}/get_result", "get"): {"200", "401", "404", "422"},
        ("/v1/tasks/{task_id}/continue", "post"): {"200", "403", "404", "409", "422", "429"},
        ("/v1/tasks/{task_id}/delete", "post"): {"200", "403", "404"},
        ("/v1/chat/completions", "post"): {"200", "400", "401", "413", "429", "503"},
        ("/v1/completions", "post"): {"200", "400", "413", "429"},
    }
    for (path, method), codes in need.items():
        responses = paths[path][method]["responses"]
        assert codes <= set(responses), (path, method, sorted(responses))
        for code in codes - {"200"}:
            content = responses[code].get("content", {})
            assert "application/json" in content, (path, code)
    for path in ("/v1/tasks/create", "/v1/tasks/tmp", "/v1/chat/completions", "/v1/completions"):
        assert "text/event-stream" in paths[path]["post"]["responses"]["200"]["content"], path
    assert "text/event-stream" in paths["/v1/tasks/{task_id}/stream"]["get"]["responses"]["200"]["content"]
    # the probes are routes like any other, HEAD included (a load balancer's check)
    assert "503" in paths["/health"]["get"]["responses"]
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert httpx.head(server.url + "/health").status_code == 200


def test_the_docs_page_points_to_the_schema_when_its_cdn_is_unreachable(server):
    page = httpx.get(server.url + "/docs").text
    assert "SwaggerUIBundle" in page and "typeof SwaggerUIBundle" in page and "/openapi.json" in page


# --- 9. a request that can never fit is a 400, not a 429 ----------------------------------------------
def test_more_sequences_than_the_queue_holds_is_400(c1):
    idle(c1)
    e = err(c1.post("/v1/completions", json={"prompt": "x", "n": 16, "max_tokens": 2}), 400, "n")
    assert "max_queue" in e["message"] or "queue" in e["message"]
    r = c1.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    err(r, 400, "n")
    assert c1.post("/v1/completions", json={"prompt": "x", "n": 4, "max_tokens": 2}).status_code == 200


# --- 10. finished TMP tasks keep their text, not their states ----------------------------------------
def test_tmp_states_are_bounded_in_bytes_and_tmp_tasks_stay_usable(tmp_path):
    with running_server(tmp_path, env={"RWKV_TMP_STATE_BYTES": "200000"}) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        ids = [c.post("/v1/tasks/tmp", json={"prompt": f"p{i}", "max_tokens": 3}).json()["task_id"]
               for i in range(12)]
        texts = [finished(c, t)["result"] for t in ids]
        metrics = c.get("/metrics").text
        line = next(ln for ln in metrics.splitlines() if ln.startswith('rwkv_state_cache_bytes{tier="tmp"}'))
        assert float(line.split()[-1]) <= 200000, line
        assert [c.get(f"/v1/tasks/{t}/get_result").json()["result"] for t in ids] == texts
        fork = c.post(f"/v1/tasks/{ids[0]}/fork", params={"tmp": "true"}, json={"max_tokens": 2})
        assert fork.status_code == 200, fork.text  # its state was dropped: rebuilt from its tokens
        assert finished(c, fork.json()["task_id"])["finish_reason"] in ("length", "stop")


def test_database_bytes_gauge_drops_at_delete(tmp_path):
    def db_bytes(c: httpx.Client) -> float:
        for ln in c.get("/metrics").text.splitlines():
            if ln.startswith('rwkv_state_cache_bytes{tier="database"}'):
                return float(ln.split()[-1])
        raise AssertionError("no database tier in /metrics")

    with running_server(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        tid = c.post("/v1/tasks/create", json={"prompt": "keep me", "max_tokens": 3}).json()["task_id"]
        finished(c, tid)
        deadline = time.monotonic() + 10
        while db_bytes(c) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        full = db_bytes(c)
        assert full > 0
        assert c.post(f"/v1/tasks/{tid}/delete", json={}).status_code == 200
        assert db_bytes(c) < full


# --- 7. two servers on one SQLite file: writes wait for the lock instead of failing -------------------
def test_two_servers_one_sqlite_file_no_500(tmp_path):
    db = str(tmp_path / "shared.db")
    with running_server(tmp_path / "a", db=db) as a, running_server(tmp_path / "b", db=db) as b:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as c:
                async def one(i: int) -> int:
                    url = (a if i % 2 else b).url
                    r = await c.post(url + "/v1/tasks/create", json={"prompt": f"x{i}", "max_tokens": 1})
                    return r.status_code
                return await asyncio.gather(*(one(i) for i in range(300)))

        codes = asyncio.run(burst())
        assert all(code in (200, 503) for code in codes), sorted(set(codes))
        assert codes.count(200) >= 290, codes.count(200)
        assert "database is locked" not in a.log_tail(400) + b.log_tail(400)


# --- 8. slow clients are cut off; connections are bounded ---------------------------------------------
def test_half_open_connections_are_closed_after_the_read_timeouts(tmp_path):
    env = {"RWKV_HEADER_TIMEOUT": "1.5", "RWKV_BODY_TIMEOUT": "1.5"}
    with running_server(tmp_path, env=env) as srv:
        socks = []
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            if i % 2:
                s.sendall(b"POST /v1/tasks/tmp HTTP/1.1\r\nHost: x\r\nContent-Type: applic")  # headers unfinished
            else:
                s.sendall(b"POST /v1/tasks/tmp HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
            socks.append(s)
        time.sleep(4)
        answered = 0
        for s in socks:
            s.settimeout(2)
            data, closed = b"", False
            try:
                while chunk := s.recv(4096):
                    data += chunk
                closed = True  # EOF: the server closed the connection
            except ConnectionResetError:
                closed = True
            except socket.timeout:
                pass  # still open: the server is waiting for the rest
            s.close()
            assert closed, f"connection still open after the timeouts ({data[:100]!r})"
            assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:200]
            answered += bool(data)
            assert data == b"" or re.search(rb"\r\nx-request-id: [0-9a-f]{32}\r\n", data), data[:300]
        assert answered, "no connection got its 408"
        assert httpx.get(srv.url + "/health").status_code == 200


def test_connection_limit_answers_503(tmp_path):
    with running_server(tmp_path, env={"RWKV_MAX_CONNECTIONS": "4"}) as srv:
        clients = [httpx.Client(base_url=srv.url, timeout=10) for _ in range(8)]
        try:
            codes = [c.get("/v1/models").status_code for c in clients]  # each keeps its connection
            assert codes == [200] * 4 + [503] * 4, codes  # exactly the bound: 4 connections
            over = clients[-1].get("/v1/models")
            assert over.headers["content-type"] == "application/json" and over.headers["retry-after"] == "1"
            assert over.json()["error"]["code"] == "too_many_connections" and len(over.headers["x-request-id"]) == 32
            assert httpx.get(srv.url + "/health").status_code == 200  # probes stay answered at the bound
        finally:
            for c in clients:
                c.close()
        deadline = time.monotonic() + 10  # the closed connections free their places once the server sees them go
        while (code := httpx.get(srv.url + "/v1/models").status_code) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert code == 200


def _nested(depth: int) -> str:
    """JSON text of an object nested `depth` levels (built as text: json.dumps recurses)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


@pytest.mark.parametrize("depth", [400, 900])
@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
                             '"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": '
                             '{"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 1, "metadata": {"k": DEEP}}'),
])  # fmt: skip
def test_deep_free_form_fields_are_never_a_500(c1, route, body, depth):
    """Free-form JSON (a tool's parameters, a schema, metadata) nested past Python's recursion
    limit but within the JSON parser's: a 4xx in the route's shape or an answer, never a 500, and
    the server still answers (the lone-surrogate scan of the body walked it recursively)."""
    r = c1.post(route, content=body.replace("DEEP", _nested(depth)), headers=RAW_JSON)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err(r, r.status_code)
    idle(c1)
    assert c1.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
