"""rwkv_lightning's state sessions through a real server: a session continues its state (the
second call prefills only its new prompt), branches by dialogue_idx fork a node, sessions are
listed and deleted, survive a restart, and bad input changes nothing."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from util_lightning import GREEDY, idle, metric, sse, texts_by_index
from util_server import running_server, server_fixture

from server.tokenizer import get_tokenizer

server = server_fixture(env={"RWKV_MAX_BATCH": "16", "RWKV_MAX_PROMPT_TOKENS": "4096"})
ASK = "User: Tell me about the sea.\n\nAssistant:"


@pytest.fixture(scope="module")
def c(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def ntok(text: str) -> int:
    return len(get_tokenizer().encode(text))


def state(c: httpx.Client, sid: str, prompt: str, path: str = "/state/chat/completions", **kw) -> dict:
    r = c.post(path, json={"session_id": sid, "contents": [prompt], "max_tokens": 5, **GREEDY, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def prefilled(c: httpx.Client, fn) -> tuple[float, object]:
    """(prompt tokens the engine prefilled while fn ran, fn's result)."""
    before = metric(c, "rwkv_prompt_tokens_total")
    out = fn()
    return metric(c, "rwkv_prompt_tokens_total") - before, out


def status(c: httpx.Client) -> dict:
    r = c.post("/state/status", json={})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_session_continues_its_state(c):
    n1, first = prefilled(c, lambda: state(c, "sea", ASK))
    assert n1 == ntok(ASK)  # the first call starts from the zero state
    assert set(first) == {"id", "object", "model", "choices"} and first["id"] == "rwkv7-batch"
    more = "User: And the mountains?\n\nAssistant:"
    n2, _ = prefilled(c, lambda: state(c, "sea", more))
    # only the new prompt (with lightning's "\n\n" in front) and the one token the last call left pending
    assert n2 == ntok("\n\n" + more) + 1
    n3, _ = prefilled(c, lambda: state(c, "sea", "\n\nUser: Thanks.\n\nAssistant:"))
    assert n3 == ntok("\n\nUser: Thanks.\n\nAssistant:") + 1  # a leading blank line is not doubled
    fresh, _ = prefilled(c, lambda: state(c, "lake", more))
    assert fresh == ntok(more)  # another session starts from zero


def test_a_session_streams_native_chunks(c):
    events = sse(c.post("/state/chat/completions", json={"session_id": "stream-s", "contents": [ASK],
                                                         "max_tokens": 6, "stream": True, "chunk_size": 2, **GREEDY}))
    assert events[-1] == "[DONE]"
    assert all(set(e) == {"object", "choices"} for e in events[:-1])
    assert set(texts_by_index(events)) == {0}
    again = state(c, "stream-s-2", ASK, max_tokens=6)  # the same prompt from zero: the same text
    assert texts_by_index(events)[0] == again["choices"][0]["message"]["content"]


def test_multi_state_branches_fork_a_node(c):
    root = state(c, "tree", ASK, path="/multi_state/chat/completions", dialogue_idx=0)
    assert (root["id"], root["dialogue_idx"]) == ("rwkv7-multi-state", 1)
    follow = "User: Why?\n\nAssistant:"
    n, a = prefilled(c, lambda: state(c, "tree", follow, path="/multi_state/chat/completions", dialogue_idx=1))
    assert a["dialogue_idx"] == 2 and n == ntok("\n\n" + follow) + 1
    b = state(c, "tree", follow, path="/multi_state/chat/completions", dialogue_idx=1)
    assert b["dialogue_idx"] == 3  # node 1 continued twice: two branches from the same state
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    other = state(c, "tree", ASK, path="/multi_state/chat/completions", dialogue_idx=0)
    assert other["dialogue_idx"] == 4 and other["choices"] == root["choices"]  # a new root: the zero state
    events = sse(c.post("/multi_state/chat/completions", json={"session_id": "tree", "dialogue_idx": 3,
                                                               "contents": [follow], "max_tokens": 3,
                                                               "stream": True, **GREEDY}))
    assert events[-1] == "[DONE]"
    assert events[-2] == {"object": "multi_state.dialogue_idx", "session_id": "tree:5", "dialogue_idx": 5}
    names = {s["session_id"] for s in status(c)["sessions"]}
    assert {"tree:1", "tree:2", "tree:3", "tree:4", "tree:5"} <= names


def test_status_and_delete(c):
    state(c, "del-me", ASK)
    for i in (0, 1):
        state(c, "del-tree", ASK, path="/multi_state/chat/completions", dialogue_idx=i)
    st = status(c)
    assert st["status"] == "success"
    assert st["total_sessions"] == st["l1_cache_count"] + st["l2_cache_count"] + st["database_count"]
    assert st["total_sessions"] == len(st["sessions"])
    entry = next(s for s in st["sessions"] if s["session_id"] == "del-me")
    assert entry["cache_level"] in ("L1 (VRAM)", "L2 (RAM)", "Database (Disk)") and entry["timestamp"] > 0
    r = c.post("/state/delete", json={"session_id": "del-me"})
    assert r.status_code == 200 and r.json()["status"] == "success"
    r = c.post("/state/delete", json={"session_id": "del-me"})
    assert r.status_code == 404 and r.json()["status"] == "not_found"
    r = c.post("/state/delete", json={"session_id": "del-me", "delete_prefix": None})  # null: false, as there
    assert r.status_code == 404 and r.json()["status"] == "not_found", r.text
    r = c.post("/state/delete", json={"session_id": "del-tree", "delete_prefix": True})
    assert r.status_code == 200
    names = {s["session_id"] for s in status(c)["sessions"]}
    assert not any(n == "del-me" or n.startswith("del-tree:") for n in names)
    n, _ = prefilled(c, lambda: state(c, "del-me", ASK))  # a deleted session starts over
    assert n == ntok(ASK)


def test_bad_session_requests_change_nothing(c):
    state(c, "keep", ASK)
    before = status(c)
    tokens = metric(c, "rwkv_prompt_tokens_total")
    cases = [
        ("/multi_state/chat/completions", {"session_id": "keep", "dialogue_idx": 99, "contents": ["x"]}, 404,
         {"error": "State not found for dialogue_idx=99"}),
        ("/multi_state/chat/completions", {"session_id": "keep", "contents": ["x"]}, 400,
         {"error": "Missing dialogue_idx parameter"}),
        ("/multi_state/chat/completions", {"session_id": "keep", "dialogue_idx": -1, "contents": ["x"]}, 404,
         {"error": "State not found for dialogue_idx=-1"}),  # lightning's answer: no such node
        ("/state/chat/completions", {"session_id": "k" * 201, "contents": ["x"]}, 400, None),
        ("/state/chat/completions", {"session_id": "k" * 201 + ":1", "contents": ["x"]}, 400, None),
        ("/multi_state/chat/completions", {"session_id": "k" * 201, "dialogue_idx": 0, "contents": ["x"]}, 400, None),
        ("/state/chat/completions", {"contents": ["x"]}, 400, {"error": "Missing session_id parameter"}),
        ("/state/chat/completions", {"session_id": "keep", "contents": ["a", "b"]}, 400, None),
        ("/state/chat/completions", {"session_id": "keep", "contents": []}, 400, None),
        ("/state/delete", {"session_id": "no-such-session"}, 404,
         {"status": "not_found", "message": "Session no-such-session not found"}),
        ("/state/delete", {}, 400, {"error": "Missing session_id parameter"}),
        ("/state/chat/completions", {"session_id": "keep", "contents": ["x"], "stop_tokens": ["s"] * 17}, 400, None),
        ("/state/chat/completions", {"session_id": "k\x00p", "contents": ["x"]}, 400,
         {"error": "session_id must not contain the NUL character"}),
    ]
    for path, body, code, want in cases:
        r = c.post(path, json=body)
        assert r.status_code == code, (path, body, r.text)
        if want is not None:
            assert r.json() == want
    r = c.post("/state/chat/completions", json={"session_id": "keep", "contents": ["sea " * 5000]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "contents", r.text  # lightning's field
    idle(c)
    assert metric(c, "rwkv_prompt_tokens_total") == tokens
    assert status(c)["sessions"] == before["sessions"]


def _while_running(server, session_id: str, check) -> None:
    """check() while a streaming /state call on `session_id` generates; then that client leaves."""
    body = {"session_id": session_id, "contents": [ASK], "max_tokens": 100_000, "stream": True, "chunk_size": 1,
            **GREEDY}  # fmt: skip
    started, leave = threading.Event(), threading.Event()

    def read(r: httpx.Response) -> None:  # keeps reading (a client that stopped reading is gone)
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
            if leave.is_set():
                break  # httpx closes the connection: the client left

    with httpx.Client(base_url=server.url, timeout=120) as other, other.stream("POST", "/state/chat/completions",
                                                                              json=body) as r:
        reader = threading.Thread(target=read, args=(r,), daemon=True)
        reader.start()
        assert started.wait(60)
        try:
            check()
        finally:
            leave.set()
            reader.join(60)
    for _ in range(100):  # the client left: its run stops
        if _running(server) == 0:
            break
        threading.Event().wait(0.1)


def _running(server) -> int:
    return httpx.get(server.url + "/health").json()["running"]


def test_one_session_is_written_by_one_call_at_a_time(c, server):
    def second_call() -> None:
        second = c.post("/state/chat/completions", json={"session_id": "busy", "contents": ["more"]})
        assert second.status_code == 409, second.text
        err = second.json()["error"]  # named by the session, not by the task under it
        assert err["param"] == "session_id" and "session 'busy' is busy" in err["message"], err
        assert "TASK_" not in err["message"]

    _while_running(server, "busy", second_call)
    # the streaming client left: its run stopped, and the session goes on from what it generated
    assert state(c, "busy", "User: ok\n\nAssistant:")["choices"]
    idle(c)


def test_a_branch_from_a_generating_node_names_the_node(c, server):
    node = state(c, "gen", ASK, path="/multi_state/chat/completions", dialogue_idx=0)["dialogue_idx"]

    def branch() -> None:
        r = c.post("/multi_state/chat/completions", json={"session_id": "gen", "dialogue_idx": node, "contents": ["b"]})
        assert r.status_code == 409, r.text
        err = r.json()["error"]  # the branch only reads that node: the session is not what is busy
        assert err["param"] == "session_id" and f"node gen:{node} is generating" in err["message"], err

    _while_running(server, f"gen:{node}", branch)
    idle(c)
    assert state(c, "gen", "User: b\n\nAssistant:", path="/multi_state/chat/completions", dialogue_idx=node)


def test_sessions_survive_a_restart(tmp_path):
    with running_server(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        first = state(c, "kept", ASK)
        state(c, "kept-tree", ASK, path="/multi_state/chat/completions", dialogue_idx=0)
        srv.restart()
        levels = {s["session_id"]: s["cache_level"] for s in status(c)["sessions"]}
        assert levels == {"kept": "Database (Disk)", "kept-tree:1": "Database (Disk)"}
        more = "User: Again?\n\nAssistant:"
        n, _ = prefilled(c, lambda: state(c, "kept", more))
        assert n == ntok("\n\n" + more) + 1  # the stored state goes on: only the new prompt is prefilled
        branch = state(c, "kept-tree", more, path="/multi_state/chat/completions", dialogue_idx=1)
        assert branch["dialogue_idx"] == 2
        assert first["choices"][0]["message"]["content"]


def test_dialogue_idx_null_is_a_new_root(c):
    """lightning reads `int(dialogue_idx or 0)`: null is 0, a new root (only a missing key is a 400)."""
    root = state(c, "null-root", ASK, path="/multi_state/chat/completions", dialogue_idx=0)
    other = state(c, "null-root", ASK, path="/multi_state/chat/completions", dialogue_idx=None)
    assert (root["dialogue_idx"], other["dialogue_idx"]) == (1, 2) and other["choices"] == root["choices"]


def test_a_node_of_a_long_session_id_is_usable(c):
    """A node's name `<session_id>:<n>` may be longer than the 200 characters a session_id may
    have: every name the server made is usable on /state, /multi_state and /state/delete."""
    sid = "s" * 200
    root = state(c, sid, ASK, path="/multi_state/chat/completions", dialogue_idx=0)
    node = f"{sid}:{root['dialogue_idx']}"
    more = "User: And then?\n\nAssistant:"
    n, _ = prefilled(c, lambda: state(c, node, more))  # /state continues the node's state
    assert n == ntok("\n\n" + more) + 1
    nested = state(c, node, ASK, path="/multi_state/chat/completions", dialogue_idx=0)  # a node's name as a session
    nested_name = f"{node}:{nested['dialogue_idx']}"
    assert state(c, nested_name, more)["choices"]
    names = {s["session_id"] for s in status(c)["sessions"]}
    assert {node, nested_name} <= names
    for name in (nested_name, node):
        r = c.post("/state/delete", json={"session_id": name})
        assert r.status_code == 200, r.text


def test_empty_stop_strings_are_dropped_and_chunk_size_zero_is_one(c):
    r = c.post("/state/chat/completions", json={"session_id": "stops", "contents": [ASK], "max_tokens": 3,
                                                **GREEDY, "stop_tokens": [""] * 17})  # none of them counts
    assert r.status_code == 200, r.text
    body = {"contents": [ASK], "max_tokens": 6, "stream": True, **GREEDY}
    per_token = sse(c.post("/state/chat/completions", json={"session_id": "cs-1", "chunk_size": 1, **body}))
    zero = sse(c.post("/state/chat/completions", json={"session_id": "cs-0", "chunk_size": 0, **body}))
    # lightning's state stream: max(1, chunk_size) (the chunking itself depends on how many tokens
    # each stream wake-up finds, so the texts are compared, not the events)
    assert texts_by_index(zero) == texts_by_index(per_token) and len(zero) >= 2
    once = sse(c.post("/state/chat/completions", json={"session_id": "cs-big", "chunk_size": 10**9, **body}))
    assert len(once) == 2 and texts_by_index(once) == texts_by_index(per_token)  # one flush, at the end


def test_a_prompt_too_long_is_named_by_its_field(c):
    long = "sea " * 5000
    for body, field in (({"contents": [long]}, "contents"),
                        ({"messages": [{"role": "user", "content": long}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi"}], "system": long}, "system"),
                        ({"messages": [{"role": "user", "content": "hi"}], "contents": [long]}, "contents")):
        r = c.post("/openai/v1/chat/completions", json=body)
        assert r.status_code == 413 and r.json()["error"]["param"] == field, (field, r.text)
    # one wording on every lightning route: the batch route and a session name `contents` alike
    for path, extra in (("/v1/chat/completions", {}), ("/state/chat/completions", {"session_id": "long"}),
                        ("/multi_state/chat/completions", {"session_id": "long-m", "dialogue_idx": 0})):
        err = c.post(path, json={"contents": [long], **extra}).json()["error"]
        assert err["code"] == "prompt_too_long" and err["param"].startswith("contents"), (path, err)
        assert re.fullmatch(r"'contents(\[0\])?' has \d+ tokens; the limit is 4096", err["message"]), (path, err)
    idle(c)


def _generating(c: httpx.Client) -> None:
    for _ in range(600):
        if c.get("/health").json()["running"] >= 1 and metric(c, "rwkv_generation_tokens_total") > 0:
            return
        threading.Event().wait(0.05)
    raise AssertionError("the call did not start")


def test_a_session_deleted_while_a_call_generates_answers_so(c, server):
    """/state/delete stops a call generating on the session: its answer is an error
    (`session_deleted`), not a whole-looking answer with finish_reason "stop"."""
    endless = {"contents": [ASK], "max_tokens": 100_000, **GREEDY}
    for path, extra in (("/state/chat/completions", {}), ("/multi_state/chat/completions", {"dialogue_idx": 0})):
        out: dict[str, httpx.Response] = {}
        sid = "doomed" + path.split("/")[1]

        def call(path=path, extra=extra, out=out, sid=sid) -> None:
            with httpx.Client(base_url=server.url, timeout=120) as other:
                out["r"] = other.post(path, json={"session_id": sid, **endless, **extra})

        th = threading.Thread(target=call)
        th.start()
        _generating(c)
        r = c.post("/state/delete", json={"session_id": sid, "delete_prefix": True})
        assert r.status_code == 200, r.text
        th.join(60)
        r = out["r"]
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("session_deleted", "session_id") and "was deleted" in err["message"]
        assert sid not in {s["session_id"].split(":")[0] for s in status(c)["sessions"]}

    lines: list[str] = []
    with httpx.Client(base_url=server.url, timeout=120) as other, other.stream(
            "POST", "/multi_state/chat/completions",
            json={"session_id": "doomed-stream", "dialogue_idx": 0, "stream": True, "chunk_size": 1, **endless}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 3:
                    assert c.post("/state/delete", json={"session_id": "doomed-stream:1"}).status_code == 200
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["error"]["code"] == "session_deleted", lines[-3:]  # no node event: the node is gone
    assert all("multi_state.dialogue_idx" not in ln for ln in lines)
    idle(c)
