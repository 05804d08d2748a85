"""GET /v1/tasks/list's prompt preview (`prompt_preview` on every listed task) and prompt search
(`prompt_contains`) against a real server with API keys: the search combines with `kind` and the
paging, its counts are the matches', it keeps to what the key may list, its `%`, `_` and quotes
are text, and a bad value is a 422 in the task routes' error shape. The SQL on SQLite and
PostgreSQL: test_store_listing.py."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from util_server import server_fixture

K1, K2 = "list-key-1", "list-key-2"
server = server_fixture(env={"RWKV_API_KEYS": f"{K1},{K2}", "RWKV_MAX_BATCH": "8"})


@pytest.fixture(scope="module")
def c1(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {K1}"}, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def c2(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {K2}"}, timeout=30) as c:
        yield c


def make(c: httpx.Client, prompt, route: str = "create") -> str:
    """A prefill-only task of `prompt` (text or token ids), finished."""
    r = c.post(f"/v1/tasks/{route}", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 200, r.text
    tid = r.json()["task_id"]
    deadline = time.monotonic() + 30
    while c.get(f"/v1/tasks/{tid}/status").json()["status"] != 3:
        assert time.monotonic() < deadline, tid
        time.sleep(0.05)
    return tid


def listed(c: httpx.Client, **params) -> dict:
    r = c.get("/v1/tasks/list", params={"limit": 1000, **params})
    assert r.status_code == 200, r.text
    return r.json()


def ids(c: httpx.Client, **params) -> list[str]:
    return [t["task_id"] for t in listed(c, **params)["tasks"]]


def test_every_listed_task_has_a_prompt_preview(c1, c2):
    mark = uuid.uuid4().hex
    long = f"{mark} a long prompt " + "ab" * 100
    made = {"long": make(c1, long), "short": make(c1, f"{mark}\nshort", "tmp"), "ids": make(c1, [1, 2, 3])}
    tpl = c1.post(f"/v1/tasks/{made['long']}/as_template", params={"public": "true"})
    assert tpl.status_code == 200, tpl.text
    made["template"] = tpl.json()["task_id"]
    previews = {t["task_id"]: t["prompt_preview"] for t in listed(c1)["tasks"]}
    assert previews[made["long"]] == long[:80] + "…" and len(previews[made["long"]]) == 81
    assert previews[made["short"]] == f"{mark}\nshort"  # a TMP_ task, from memory
    assert previews[made["ids"]] == ""  # a prompt of token ids has no text
    assert previews[made["template"]] == long[:80] + "…"
    assert all(isinstance(p, str) for p in previews.values())
    theirs = {t["task_id"]: t["prompt_preview"] for t in listed(c2, kind="template")["tasks"]}
    assert theirs[made["template"]] == long[:80] + "…"  # a public template's, for another key too
    assert listed(c1, kind="tmp")["tasks"][0]["prompt_preview"] is not None


def test_prompt_search_combines_with_kind_paging_and_counts(c1):
    mark = uuid.uuid4().hex
    made = {
        "pct": make(c1, f"{mark}: 100% sure"),
        "num": make(c1, f"{mark}: 1000 sure", "tmp"),
        "und": make(c1, f"{mark}: a_b"),
        "axb": make(c1, f"{mark}: AXB", "tmp"),
    }
    newest_first = [made[k] for k in ("axb", "und", "num", "pct")]
    every = listed(c1, prompt_contains=mark.upper())  # ASCII letters of either case
    assert [t["task_id"] for t in every["tasks"]] == newest_first
    assert (every["total_count"], every["database_count"]) == (4, 2)
    assert set(every["db_tasks"]) == {made["pct"], made["und"]}
    # in memory: the TMP_ tasks, and the TASK_ ones still held there; no other task of the key's
    assert {made["num"], made["axb"]} <= set(every["cpu_tasks"]) <= set(made.values())
    assert every["cpu_cache_count"] == len(every["cpu_tasks"])
    assert ids(c1, prompt_contains=f"{mark}: 100%") == [made["pct"]]  # % is a character, not a wildcard
    assert ids(c1, prompt_contains="%", kind="tmp") == []
    assert ids(c1, prompt_contains=f"{mark}: a_b") == [made["und"]]  # so is _
    assert ids(c1, prompt_contains=f"{mark}: a_") == [made["und"]]
    assert ids(c1, prompt_contains=f"{mark}: axb") == [made["axb"]]
    tmp = listed(c1, prompt_contains=mark, kind="tmp")
    assert [t["task_id"] for t in tmp["tasks"]] == [made["axb"], made["num"]] and tmp["total_count"] == 2
    task = listed(c1, prompt_contains=mark, kind="task")
    assert [t["task_id"] for t in task["tasks"]] == [made["und"], made["pct"]]
    assert task["total_count"] == 2 and set(task["cpu_tasks"]) <= {made["und"], made["pct"]}
    pages = [listed(c1, prompt_contains=mark, limit=1, offset=i) for i in range(5)]
    assert [t["task_id"] for p in pages for t in p["tasks"]] == newest_first
    assert {p["total_count"] for p in pages} == {4}
    assert listed(c1, prompt_contains="no such prompt " + mark)["total_count"] == 0


def test_prompt_search_keeps_to_what_the_key_may_list(c1, c2):
    mark = uuid.uuid4().hex
    own = make(c1, f"{mark} of key one")
    src = make(c1, f"{mark} for templates")
    public = c1.post(f"/v1/tasks/{src}/as_template", params={"public": "true"}).json()["task_id"]
    private = c1.post(f"/v1/tasks/{src}/as_template").json()["task_id"]
    assert set(ids(c1, prompt_contains=mark)) == {own, src, public, private}
    assert ids(c2, prompt_contains=mark) == [public]  # another key: the public template only
    theirs = make(c2, f"{mark} of key two")
    assert theirs not in ids(c1, prompt_contains=mark)
    assert listed(c2, prompt_contains=mark)["total_count"] == 2


@pytest.mark.parametrize("value,why", [("", "too short"), ("x" * 257, "too long"), ("a\x00b", "NUL"),
                                       ("\uffff", "U+FFFF")])
def test_a_bad_prompt_search_is_a_422(c1, value, why):
    r = c1.get("/v1/tasks/list", params={"prompt_contains": value})
    assert r.status_code == 422, (why, r.text)
    assert r.json()["error"]["param"] == "prompt_contains" and r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]


def test_search_text_is_a_parameter_not_sql(c1):
    mark = uuid.uuid4().hex
    quoted = make(c1, f"{mark} it's '); DROP TABLE tasks; --")
    before = listed(c1)["total_count"]
    for text in ("'); DROP TABLE tasks; --", "' OR '1'='1", "%' OR 1=1 --", "\\", "x" * 256):
        found = listed(c1, prompt_contains=text)
        assert found["total_count"] == len(found["tasks"]) <= 1, (text, found)
    assert ids(c1, prompt_contains=f"{mark} it's '); DROP TABLE tasks; --") == [quoted]
    assert listed(c1)["total_count"] == before  # the table is still there, every row in it


@pytest.mark.parametrize("raw", ["%FF", "a%ED%A0%80", "%C3"])
def test_a_search_whose_bytes_are_not_utf8_is_a_422_and_a_real_u_fffd_is_searched(c1, raw):
    r = c1.get(f"/v1/tasks/list?prompt_contains={raw}")
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt_contains", r.text
    assert "not UTF-8" in r.json()["error"]["message"]
    r = c1.get("/v1/tasks/list?prompt_contains=%EF%BF%BD")  # U+FFFD itself, sent as UTF-8
    assert r.status_code == 200, r.text
