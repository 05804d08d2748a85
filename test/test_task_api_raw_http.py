"""Task routes over raw HTTP on a real server with API keys: the SSE format of docs/task-api.md,
resuming with ?pos=, nothing lost, max_tokens=0 streams, disconnects, error codes and shapes,
owners. (Through the `rwkv-api` SDK: test_task_api_sdk.)"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from util_server import server_fixture

server = server_fixture(env={"RWKV_API_KEYS": "k1,k2", "RWKV_DEFAULT_MAX_TOKENS": "8"})
G = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url + "/v1/tasks", timeout=30,
                      headers={"Authorization": "Bearer k1"}) as c:
        yield c


def sse(resp) -> list:
    """Parse an SSE body strictly: `data: <compact JSON>` + blank line; comments allowed."""
    out, lines = [], resp.text.split("\n")
    assert lines[-2:] == ["", ""], "the body ends with a blank line"
    for i, line in enumerate(lines):
        if line.startswith("data: "):
            assert lines[i + 1] == "", "each data line is followed by a blank line"
            raw = line[6:]
            out.append("[DONE]" if raw == "[DONE]" else orjson.loads(raw))
            if raw != "[DONE]":
                assert raw == orjson.dumps(out[-1]).decode(), "compact JSON"
        else:
            assert line == "" or line.startswith(":"), line
    return out


def text_of(events) -> str:
    return "".join(e["data"] for e in events if isinstance(e, dict) and "data" in e)


def wait_done(http, tid):
    for _ in range(600):
        r = http.get(f"/{tid}/get_result").json()
        if r["finished"]:
            return r
        time.sleep(0.05)
    raise AssertionError("task did not finish")


def test_sse_format_and_exact_resume(http):
    ev = sse(http.post("/create", json={"prompt": "Format", "max_tokens": 12, "stream": True, **G}))
    head, texts, final = ev[0], ev[1:-2], ev[-2]
    assert set(head) == {"task_id", "prefill_time"} and ev[-1] == "[DONE]"
    assert all(set(e) >= {"data", "task_id", "gen_time", "speed", "pos"} for e in texts)
    assert final["finished"] and final["finish_reason"] == "length" and "data" not in final
    assert final["usage"]["completion_tokens"] == 12 and texts[-1]["pos"] <= 12
    tid = head["task_id"]
    assert text_of(ev) == wait_done(http, tid)["result"]
    for i, e in enumerate(texts):  # resume after any event: exactly the rest
        assert text_of(sse(http.get(f"/{tid}/stream", params={"pos": e["pos"]}))) == text_of(texts[i + 1:])


def test_task_runs_count_in_the_latency_metrics(http, server):
    from server.api.metrics import parse_metrics

    def metrics() -> dict[str, float]:
        return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)

    before = metrics()
    ev = sse(http.post("/create", json={"prompt": "Latency", "max_tokens": 6, "stream": True, **G}))
    wait_done(http, ev[0]["task_id"])
    key = 'rwkv_http_streams_total{path="task_direct_ended"}'  # written by server.api.streaming.direct
    deadline = time.monotonic() + 10  # a stream is counted after its last bytes went out
    while (after := metrics()).get(key, 0) < before.get(key, 0) + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert after["rwkv_time_to_first_token_seconds_count"] == before["rwkv_time_to_first_token_seconds_count"] + 1
    assert after["rwkv_request_duration_seconds_count"] == before["rwkv_request_duration_seconds_count"] + 1
    gaps = after["rwkv_inter_token_latency_seconds_count"] - before["rwkv_inter_token_latency_seconds_count"]
    assert gaps == 5  # 6 tokens: the first is TTFT, each later one one gap (batched gaps count per token)
    assert after[key] == before.get(key, 0) + 1
    runs = 'rwkv_task_events_total{event="runs"}'  # the task layer's counters
    assert after[runs] == before.get(runs, 0) + 1


def test_nothing_lost_when_the_task_finishes_before_the_client_reads(http):
    with http.stream("POST", "/tmp", json={"prompt": "Fast", "max_tokens": 10, "stream": True, **G}) as r:
        time.sleep(1.0)  # the task is long finished before the first line is read
        body = "".join(r.iter_text())
    ev = sse(httpx.Response(200, text=body))
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 10
    assert text_of(ev) == wait_done(http, ev[0]["task_id"])["result"]


def test_max_tokens_zero_stream_ends_and_attach_to_running(http):
    ev = sse(http.post("/tmp", json={"prompt": "prefill only", "max_tokens": 0, "stream": True}))
    assert len(ev) == 3 and ev[1]["finished"] and ev[1]["usage"]["completion_tokens"] == 0
    tid = http.post("/create", json={"prompt": "attach", "max_tokens": 120, **G}).json()["task_id"]
    ev = sse(http.request("GET", f"/{tid}/stream", json={}))  # the SDK sends {} on this GET
    assert ev[-2]["finished"] and text_of(ev) == wait_done(http, tid)["result"]
    assert http.request("GET", f"/{tid}/status", json={"x": 1}).json()["generated_buf"] == 120


def test_disconnect_aborts_a_tmp_stream_but_not_a_task(http):
    ids = {}
    for route in ("/tmp", "/create"):
        with http.stream("POST", route, json={"prompt": "forever", "max_tokens": 100000, "stream": True,
                                              "ignore_eos": True}) as r:  # (sampled: never ends by itself)
            lines = r.iter_lines()
            ids[route] = orjson.loads(next(lines)[6:])["task_id"]
            next(lines), next(lines)
    deadline = time.time() + 5
    while http.get(f"/{ids['/tmp']}/status").json()["status"] != 3 and time.time() < deadline:
        time.sleep(0.05)
    assert http.get(f"/{ids['/tmp']}/status").json()["finish_reason"] == "stopped"
    assert http.get(f"/{ids['/create']}/status").json()["status"] != 3  # a TASK_ keeps going
    assert http.post(f"/{ids['/create']}/continue", json={}).status_code == 409
    assert http.post(f"/{ids['/create']}/stop", json={}).json()["status"] == 3


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "bogus": 1}, "bogus"), ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": [1, "a"]}, "prompt"), ({"max_tokens": 3}, "prompt"), ({"prompt": [70000]}, "prompt"),
    # strict types: a wrong JSON type is refused, never converted
    ({"prompt": "x", "max_tokens": True}, "max_tokens"), ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"), ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"), ({"prompt": "x", "top_k": 1.5}, "top_k"),
])
def test_invalid_bodies_are_422_naming_the_field(http, body, param):
    r = http.post("/tmp", json=body)
    err = r.json()["error"]
    assert r.status_code == 422 and set(err) == ERROR_KEYS and param in (err["param"] or "") + err["message"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_as_such(http, value):
    # Python's JSON parser reads these; the bounds alone would call NaN "above the maximum"
    r = http.post("/tmp", content=f'{{"prompt": "x", "temperature": {value}}}',
                  headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 422 and err["param"] == "temperature" and "finite" in err["message"], r.text


def test_status_codes_and_error_shapes(http):
    bad = http.post("/tmp", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and set(bad.json()["error"]) == ERROR_KEYS
    for method, path in [("GET", "get_result"), ("GET", "status"), ("GET", "stream"), ("POST", "fork"),
                         ("POST", "continue"), ("POST", "stop"), ("POST", "as_template"), ("POST", "delete")]:
        r = http.request(method, f"/TASK_{'0' * 32}/{path}", json={} if method == "POST" else None)
        assert r.status_code == 404 and r.json()["error"]["code"] == "task_not_found", path
    tid = wait_done(http, http.post("/create", json={"prompt": "t", "max_tokens": 0}).json()["task_id"])["task_id"]
    assert http.post(f"/{tid}/stop", json={"extra": 1}).status_code == 422
    tpl = http.post(f"/{tid}/as_template", params={"name": "named-1"}, json={}).json()["task_id"]
    assert tpl == "_named-1" and http.post(f"/{tid}/as_template", params={"name": "named-1"}).status_code == 409
    assert http.post(f"/{tid}/as_template", params={"name": "bad name!"}).status_code == 422
    auto = http.post(f"/{tid}/as_template", params={"name": "TMPL_" + "0a" * 16})  # an unnamed template's form
    assert auto.status_code == 422 and "unnamed template" in auto.json()["error"]["message"], auto.text
    r = http.post(f"/{tpl}/continue", json={"max_tokens": 1})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert http.post(f"/{tpl}/delete", params={"force": "true"}, json={}).json()["task_id"] == tpl
    assert httpx.get(http.base_url.join("list")).status_code == 401  # no key


def test_tasks_belong_to_their_key(http, server):
    k2 = httpx.Client(base_url=server.url + "/v1/tasks", timeout=30, headers={"Authorization": "Bearer k2"})
    tid = wait_done(http, http.post("/create", json={"prompt": "mine", "max_tokens": 1}).json()["task_id"])["task_id"]
    assert k2.get(f"/{tid}/get_result").status_code == 404
    assert tid not in str(k2.get("/list").json()) and tid in http.get("/list").json()["db_tasks"]
    tpl = http.post(f"/{tid}/as_template", json={}).json()["task_id"]
    assert k2.get(f"/{tpl}/get_result").status_code == 404  # templates: private to their key by default
    assert k2.post(f"/{tpl}/fork", params={"tmp": "true"}, json={"prompt": " x"}).status_code == 404
    pub = http.post(f"/{tid}/as_template", params={"public": "true"}, json={}).json()["task_id"]
    assert k2.get(f"/{pub}/get_result").status_code == 200  # published: readable by every key
    parents = {key: [t["parent_id"] for t in c.get("/list", params={"kind": "template"}).json()["tasks"]
                     if t["task_id"] == pub] for key, c in (("k1", http), ("k2", k2))}
    assert parents == {"k1": [tid], "k2": [None]}  # k1's own task is not named to k2
    ui = server.url + f"/v1/ui/tasks/{pub}"
    assert httpx.get(ui, headers={"Authorization": "Bearer k2"}).json()["parent_id"] is None
    assert httpx.get(ui, headers={"Authorization": "Bearer k1"}).json()["parent_id"] == tid
    f = k2.post(f"/{pub}/fork", params={"tmp": "true"}, json={"prompt": " x", "max_tokens": 2}).json()
    assert f["task_id"].startswith("TMP_") and wait_done(k2, f["task_id"])["finished"]
    assert k2.post(f"/{pub}/delete", params={"force": "true"}, json={}).status_code == 403
    page = http.get("/list", params={"limit": 1, "kind": "template"}).json()
    assert page["tasks"][0]["task_id"] == pub and page["database_count"] >= 1 and len(page["tasks"]) == 1
    assert http.get("/list", params={"limit": 0}).status_code == 422
    k2.close()


def test_a_private_template_shadows_a_public_one_in_the_list(http, server):
    """k1 publishes `_pubt`, k2 makes its own private `_pubt`: k2's list shows `_pubt` once, the
    one every route reaches (its own), in memory and stored alike, counts and pages included."""
    k2 = httpx.Client(base_url=server.url + "/v1/tasks", timeout=30, headers={"Authorization": "Bearer k2"})
    src1 = wait_done(http, http.post("/create", json={"prompt": "one", "max_tokens": 1}).json()["task_id"])["task_id"]
    src2 = wait_done(k2, k2.post("/create", json={"prompt": "two", "max_tokens": 1}).json()["task_id"])["task_id"]
    assert http.post(f"/{src1}/as_template", params={"name": "pubt", "public": "true"}).json()["task_id"] == "_pubt"
    assert k2.post(f"/{src2}/as_template", params={"name": "pubt"}).json()["task_id"] == "_pubt"
    assert k2.get("/_pubt/get_result").status_code == 200 and http.get("/_pubt/get_result").status_code == 200
    mine = k2.get("/list", params={"kind": "template"}).json()
    rows = [t for t in mine["tasks"] if t["task_id"] == "_pubt"]
    assert len(rows) == 1 and rows[0]["parent_id"] == src2 and not rows[0]["public"], mine
    assert mine["db_tasks"].count("_pubt") == 1 and mine["cpu_tasks"].count("_pubt") == 1, mine
    assert mine["database_count"] == len(mine["db_tasks"]) == len(mine["tasks"]), mine
    pages = [k2.get("/list", params={"kind": "template", "limit": 1, "offset": i}).json()["tasks"]
             for i in range(mine["database_count"] + 1)]
    assert [t["task_id"] for p in pages for t in p] == [t["task_id"] for t in mine["tasks"]] and pages[-1] == []
    theirs = http.get("/list", params={"kind": "template"}).json()  # k1 still lists its public one
    assert [t["parent_id"] for t in theirs["tasks"] if t["task_id"] == "_pubt"] == [src1], theirs
    k2.close()


def test_a_name_of_a_keys_own_public_template_is_taken_for_its_private_one(http):
    """docs/task-api.md: the name is taken by this key's own template of that name. k1's public
    `_ownpub` would be shadowed from k1 itself by a private `_ownpub`: 409, nothing made."""
    src = wait_done(http, http.post("/create", json={"prompt": "one", "max_tokens": 1}).json()["task_id"])["task_id"]
    assert http.post(f"/{src}/as_template", params={"name": "ownpub", "public": "true"}).status_code == 200
    r = http.post(f"/{src}/as_template", params={"name": "ownpub"})
    assert r.status_code == 409 and r.json()["error"]["param"] == "name", r.text
    listed = [t for t in http.get("/list", params={"kind": "template"}).json()["tasks"] if t["task_id"] == "_ownpub"]
    assert len(listed) == 1 and listed[0]["public"], listed


def test_a_name_of_a_keys_own_private_template_is_taken_for_its_public_one(http, server):
    """The other direction: k1's private `_ownpriv` would shadow a public `_ownpriv` from k1
    itself (k1 could not read or delete it): 409 task_conflict, nothing made."""
    k2 = httpx.Client(base_url=server.url + "/v1/tasks", timeout=30, headers={"Authorization": "Bearer k2"})
    src = wait_done(http, http.post("/create", json={"prompt": "one", "max_tokens": 1}).json()["task_id"])["task_id"]
    assert http.post(f"/{src}/as_template", params={"name": "ownpriv"}).status_code == 200
    r = http.post(f"/{src}/as_template", params={"name": "ownpriv", "public": "true"}, json={})
    assert r.status_code == 409, r.text
    assert r.json()["error"] == {"message": "template '_ownpriv' already exists (private)", "type": "conflict_error",
                                 "param": "name", "code": "task_conflict"}
    assert k2.get("/_ownpriv/get_result").status_code == 404  # no public one was made
    listed = [t for t in http.get("/list", params={"kind": "template"}).json()["tasks"] if t["task_id"] == "_ownpriv"]
    assert len(listed) == 1 and not listed[0]["public"] and listed[0]["parent_id"] == src, listed
    assert http.post("/_ownpriv/delete", params={"force": "true"}).status_code == 200  # k1's own, private
    assert http.post(f"/{src}/as_template", params={"name": "ownpriv", "public": "true"}).status_code == 200
    assert k2.get("/_ownpriv/get_result").status_code == 200  # the name is free once the private one is gone
    k2.close()


def test_query_values_are_parsed_as_the_doc_says_and_get_bodies_are_ignored(http):
    """docs/task-api.md, Query parameters: query text is converted (booleans in their spellings,
    integers with a zero fraction), unknown parameters are ignored; a GET's body is never read."""
    src = wait_done(http, http.post("/create", json={"prompt": "q", "max_tokens": 1}).json()["task_id"])["task_id"]
    for v in ("yes", "1", "ON", "t"):
        f = http.post(f"/{src}/fork", params={"tmp": v}, json={"max_tokens": 0})
        assert f.status_code == 200 and f.json()["task_id"].startswith("TMP_"), (v, f.text)
    for v in ("no", "0", "OFF", "f"):
        assert http.post(f"/{src}/fork", params={"tmp": v}, json={"max_tokens": 0}).json()["task_id"].startswith("TASK_")
    for v in ("2", "1.0", "", " yes"):
        assert http.post(f"/{src}/fork", params={"tmp": v}, json={"max_tokens": 0}).status_code == 422, v
    assert http.get("/list", params={"limit": "5.0", "bogus": "x"}).json()["limit"] == 5
    for v in ("5.5", "1e1", ""):
        r = http.get("/list", params={"limit": v})
        assert r.status_code == 422 and r.json()["error"]["param"] == "limit", v
    same = [sse(http.get(f"/{src}/stream", params={"pos": v})) for v in ("1.0", "1")]
    assert same[0] == same[1] and same[0][-2]["pos"] == 1  # the finished task's stream from pos 1
    for path in ("status", "get_result", "stream"):
        r = http.request("GET", f"/{src}/{path}", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 200, (path, r.text)


def test_a_continue_streams_the_new_text_and_null_is_absent(http):
    tid = http.post("/create", json={"prompt": "Grow", "max_tokens": 4, "ignore_eos": True, **G}).json()["task_id"]
    first = wait_done(http, tid)["result"]
    ev = sse(http.post(f"/{tid}/continue", json={"max_tokens": 3, "stream": True}))
    texts, final = [e for e in ev if isinstance(e, dict) and "data" in e], ev[-2]
    assert texts and all(e["pos"] > 4 for e in texts), "only this run's tokens are streamed"
    assert final["pos"] == 7 and final["usage"]["completion_tokens"] == 7
    whole = wait_done(http, tid)["result"]
    assert whole.endswith(text_of(ev)) and whole.startswith(first.rstrip("\ufffd"))
    assert text_of(sse(http.get(f"/{tid}/stream"))) == whole, "stream?pos=0 still replays the whole output"
    # a JSON null is an absent field: stream (JSON answer) and fim's suffix (none)
    r = http.post(f"/{tid}/continue", json={"max_tokens": 1, "stream": None})
    assert r.status_code == 200 and r.json()["task_id"] == tid
    r = http.post("/fim", json={"prefix": "a", "suffix": None, "max_tokens": 1, "stream": None})
    assert r.status_code == 200 and r.json()["task_id"].startswith("TMP_")


@pytest.mark.parametrize("running", [True, False])
def test_overlapping_deletes_delete_a_task_once(http, server, running):
    from concurrent.futures import ThreadPoolExecutor

    n = 100000 if running else 1
    tid = http.post("/create", json={"prompt": "Long", "max_tokens": n, "ignore_eos": True}).json()["task_id"]
    if not running:
        wait_done(http, tid)

    def delete(_):
        with httpx.Client(base_url=server.url + "/v1/tasks", headers={"Authorization": "Bearer k1"}, timeout=30) as c:
            return c.post(f"/{tid}/delete").status_code

    with ThreadPoolExecutor(6) as pool:
        codes = sorted(pool.map(delete, range(6)))
    assert codes == [200] + [404] * 5, codes
    assert http.get(f"/{tid}/status").status_code == 404
