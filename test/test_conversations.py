"""OpenAI's Conversations API (/v1/conversations) and `conversation` on /v1/responses, with the
official SDK against a real server: each response of a conversation starts from the state of the
last one (cached_tokens) across a restart, its input and output join the conversation, items
added or deleted between responses are honoured (after the head's state, or the whole history
prefilled when the head's state holds a deleted item), a tool loop, a response that is cancelled
joining nothing, and bad input refused with nothing created or changed."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from util_server import sdk, server_fixture, wait_committed

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
# the grammar ends each answer with EOS, which the state consumes: the next response's cached
# tokens are then exactly the previous one's input + output
TEXT = {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True}]
H = {"Authorization": "Bearer k1"}

server = server_fixture(env={"RWKV_API_KEYS": "k1,k2", "RWKV_MAX_PROMPT_TOKENS": "700"})


def user(text: str, **extra) -> dict:
    return {"type": "message", "role": "user", "content": text, **extra}


def items_of(client, cid: str) -> list:
    return list(client.conversations.items.list(cid, order="asc", limit=100))


def texts(items) -> list[str]:
    return [i.content[0].text if i.type == "message" else i.type for i in items]


def held(r) -> int:
    """The tokens a response's state holds at its end (its answer ended by EOS: all of them)."""
    return r.usage.input_tokens + r.usage.output_tokens


def test_responses_start_from_the_last_ones_state_across_a_restart(server):
    client = sdk(server, key="k1")
    conv = client.conversations.create(items=[user("Hello.")], metadata={"topic": "numbers"})
    assert conv.object == "conversation" and conv.metadata == {"topic": "numbers"}
    r1 = client.responses.create(model="m", conversation=conv.id, input="Pick a number.", text=TEXT,
                                 max_output_tokens=30)
    assert r1.status == "completed" and r1.conversation.id == conv.id and r1.previous_response_id is None
    assert r1.usage.input_tokens_details.cached_tokens == 0
    chain = [r1]
    for step in range(3):
        if step == 1:
            server.restart()  # the conversation, its items and its head live in the database
            client = sdk(server, key="k1")
        count = client.responses.input_tokens.count(model="m", conversation={"id": conv.id}, input=f"Next ({step}).",
                                                    text=TEXT).input_tokens  # fmt: skip
        r = client.responses.create(model="m", conversation={"id": conv.id}, input=f"Next ({step}).", text=TEXT,
                                    max_output_tokens=30)  # fmt: skip
        assert r.status == "completed" and r.conversation.id == conv.id and r.previous_response_id is None
        assert r.usage.input_tokens_details.cached_tokens == held(chain[-1])  # forked: nothing prefilled again
        assert r.usage.input_tokens == count
        chain.append(r)
    got = items_of(client, conv.id)
    want = ["Hello."]
    for step, r in enumerate(chain):
        want += ["Pick a number." if step == 0 else f"Next ({step - 1}).", r.output_text]
    assert texts(got) == want
    assert [i.role for i in got] == ["user", "user", "assistant"] * 1 + ["user", "assistant"] * 3
    assert got[2].id == r1.output[0].id and got[2].status == "completed"
    assert client.responses.retrieve(chain[-1].id).conversation.id == conv.id
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "numbers"}


def test_items_added_or_deleted_between_responses(server):
    """An item added after the head is rendered after its state; one deleted that the head's state
    holds makes the next response prefill the whole history, exactly as the same items sent as a
    stateless input."""
    client = sdk(server, key="k1")
    conv = client.conversations.create()
    r1 = client.responses.create(model="m", conversation=conv.id, input="One.", text=TEXT, max_output_tokens=30)
    added = client.conversations.items.create(conv.id, items=[user("An aside.", id="msg_aside")])
    assert [i.id for i in added.data] == ["msg_aside"] and added.first_id == added.last_id == "msg_aside"
    r2 = client.responses.create(model="m", conversation=conv.id, input="Two.", text=TEXT, max_output_tokens=30)
    assert r2.usage.input_tokens_details.cached_tokens == held(r1)
    assert texts(items_of(client, conv.id)) == ["One.", r1.output_text, "An aside.", "Two.", r2.output_text]
    after = client.conversations.items.delete("msg_aside", conversation_id=conv.id)
    assert after.id == conv.id and after.object == "conversation"
    history = [i.model_dump(exclude_none=True) for i in items_of(client, conv.id)]
    stateless = client.responses.input_tokens.count(model="m", input=[*history, user("Three.")], text=TEXT)
    assert client.responses.input_tokens.count(model="m", conversation=conv.id, input="Three.",
                                               text=TEXT).input_tokens == stateless.input_tokens  # fmt: skip
    r3 = client.responses.create(model="m", conversation=conv.id, input="Three.", text=TEXT, max_output_tokens=30)
    assert r3.usage.input_tokens_details.cached_tokens == 0 and r3.usage.input_tokens == stateless.input_tokens
    r4 = client.responses.create(model="m", conversation=conv.id, input="Four.", text=TEXT, max_output_tokens=30)
    assert r4.usage.input_tokens_details.cached_tokens == held(r3)  # r3 is the head again
    client.responses.delete(r4.id)  # the head's response deleted: the history is prefilled
    r5 = client.responses.create(model="m", conversation=conv.id, input="Five.", text=TEXT, max_output_tokens=30)
    assert r5.usage.input_tokens_details.cached_tokens == 0 and r5.usage.input_tokens > held(r4)


def test_a_tool_loop_in_a_conversation(server):
    client = sdk(server, key="k1")
    conv = client.conversations.create()
    forced = {"model": "m", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
              "max_output_tokens": 40, "conversation": conv.id}
    r1 = client.responses.create(input="Weather in Paris?", **forced)
    (call,) = [o for o in r1.output if o.type == "function_call"]
    tasks = _tasks(server)
    with pytest.raises(Exception) as ei:  # the call must be answered first
        client.responses.create(input="Something else.", **forced)
    assert ei.value.status_code == 400 and call.call_id in ei.value.body["message"]
    assert _tasks(server) == tasks
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    r2 = client.responses.create(input=[out], **{**forced, "tool_choice": "none", "max_output_tokens": 5})
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 1
    got = items_of(client, conv.id)
    assert [i.type for i in got] == ["message", "function_call", "function_call_output", "message"]
    assert got[1].call_id == call.call_id and json.loads(got[1].arguments)["city"] in ("Paris", "Rome")
    assert got[2].output == "sunny" and got[3].content[0].text == r2.output_text


def test_a_cancelled_response_joins_nothing(server):
    client = sdk(server, key="k1")
    conv = client.conversations.create()
    r1 = client.responses.create(model="m", conversation=conv.id, input="One.", text=TEXT, max_output_tokens=30)
    body = {"model": "m", "conversation": conv.id, "input": "Go on and on.", "max_output_tokens": 4000,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=H, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and '"response.created"' in line:
                rid = json.loads(line[5:])["response"]["id"]
            if "output_text.delta" in line:
                break  # the client leaves: the run stops
    for _ in range(100):
        if client.responses.retrieve(rid).status != "in_progress":
            break
        time.sleep(0.1)
    assert client.responses.retrieve(rid).status == "cancelled"
    assert texts(items_of(client, conv.id)) == ["One.", r1.output_text]
    r2 = client.responses.create(model="m", conversation=conv.id, input="Two.", text=TEXT, max_output_tokens=30)
    assert r2.usage.input_tokens_details.cached_tokens == held(r1)  # r1 still the head


def _tasks(server, key: str = "k1") -> list[str]:
    r = httpx.get(server.url + "/v1/tasks/list", headers={"Authorization": f"Bearer {key}"})
    return sorted(t["task_id"] for t in r.json()["tasks"])


def _call(server, method: str, path: str, key: str = "k1", json_body=None) -> httpx.Response:
    """One request; the body as ASCII JSON (a lone surrogate escaped, as a client may send one)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    content = None if json_body is None else json.dumps(json_body)
    return httpx.request(method, server.url + path, headers=headers, content=content, timeout=30)


@pytest.mark.parametrize("body,status,param", [
    ({"previous_response_id": "resp_" + "0" * 32}, 400, "conversation"),
    ({"store": False}, 400, "store"),
    ({"conversation": "conv_unknown"}, 404, "conversation"),
    ({"conversation": {"nope": 1}}, 400, "conversation.nope"),
    ({"conversation": {"id": ""}}, 400, "conversation"),
    ({"input": [user("x", id="msg_first")]}, 400, "input[0].id"),  # an item's id of the conversation
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "?"}]}, 400, "input[0].call_id"),
    ({"conversation": {"id": "conv_x", "bogus": 1}}, 400, "conversation.bogus"),
    ({"input": [user("x", id="m" * 201)]}, 400, "input[0].id"),
    ({"input": [user("x", id="msg/1")]}, 400, "input[0].id"),  # (the item's routes take it in their path)
])  # fmt: skip
def test_bad_responses_in_a_conversation_change_nothing(server, body, status, param):
    client = sdk(server, key="k1")
    conv = client.conversations.create(items=[user("first", id="msg_first")])
    before, tasks = items_of(client, conv.id), _tasks(server)
    r = _call(server, "POST", "/v1/responses", json_body={"model": "m", "input": "hi", "conversation": conv.id, **body})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert items_of(client, conv.id) == before and _tasks(server) == tasks


def test_another_keys_conversation_is_not_found(server):
    conv = sdk(server, key="k1").conversations.create(items=[user("mine")])
    for method, path, body in [("GET", f"/v1/conversations/{conv.id}", None),
                               ("GET", f"/v1/conversations/{conv.id}/items", None),
                               ("POST", f"/v1/conversations/{conv.id}/items", {"items": [user("x")]}),
                               ("DELETE", f"/v1/conversations/{conv.id}", None),
                               ("POST", "/v1/responses", {"model": "m", "input": "x", "conversation": conv.id})]:  # fmt: skip
        r = _call(server, method, path, key="k2", json_body=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found", (path, r.text)
    assert texts(items_of(sdk(server, key="k1"), conv.id)) == ["mine"]


@pytest.mark.parametrize("items,param", [
    ([user(str(i)) for i in range(21)], "items"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}], "items[0].arguments"),
    ([user("a", id="msg_1"), user("b", id="msg_1")], "items[1].id"),
    ([user("a", id="msg_first")], "items[0].id"),  # taken in the conversation
    ([{"type": "reasoning", "summary": []}], "items[0].type"),
    ([user("\ud800")], "items[0].content"),
    ([user("a", id="m" * 201)], "items[0].id"),
    ([user("a", id="a/b")], "items[0].id"),
    ([user("a", id="..")], "items[0].id"),  # (a client resolves it as a path segment)
    ([user("a", id="")], "items[0].id"),
    ([user("a", id="a\u0000b")], "items[0].id"),
    ([user("a", id="\uffffa")], "items[0].id"),
])  # fmt: skip
def test_bad_items_change_nothing(server, items, param):
    client = sdk(server, key="k1")
    conv = client.conversations.create(items=[user("first", id="msg_first")])
    r = _call(server, "POST", f"/v1/conversations/{conv.id}/items", json_body={"items": items})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert texts(items_of(client, conv.id)) == ["first"]
    if param != "items[0].id":  # creating a conversation with them is refused alike, nothing made
        r = _call(server, "POST", "/v1/conversations", json_body={"items": items})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_listing_pages_and_single_items(server):
    client = sdk(server, key="k1")
    conv = client.conversations.create(items=[user(str(i), id=f"msg_{i}") for i in range(5)])
    page = client.conversations.items.list(conv.id, limit=2)  # desc by default: the last first
    assert [i.id for i in page.data] == ["msg_4", "msg_3"] and page.has_more
    assert [i.id for i in client.conversations.items.list(conv.id, limit=2, after="msg_3").data] == ["msg_2", "msg_1"]
    assert [i.id for i in client.conversations.items.list(conv.id)] == [f"msg_{i}" for i in (4, 3, 2, 1, 0)]
    one = client.conversations.items.retrieve("msg_2", conversation_id=conv.id)
    assert one.content[0].text == "2" and one.status == "completed"
    assert _call(server, "GET", f"/v1/conversations/{conv.id}/items?after=msg_9").json()["error"]["param"] == "after"
    r = _call(server, "GET", f"/v1/conversations/{conv.id}/items/msg_9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "item_not_found"
    assert _call(server, "DELETE", f"/v1/conversations/{conv.id}/items/msg_9").status_code == 404
    assert client.conversations.update(conv.id, metadata={"a": "b"}).metadata == {"a": "b"}
    assert client.conversations.update(conv.id, metadata=None).metadata == {}
    assert client.conversations.delete(conv.id).deleted
    assert _call(server, "GET", f"/v1/conversations/{conv.id}/items").status_code == 404
    assert _call(server, "GET", "/v1/conversations").status_code == 404


@pytest.mark.parametrize("moved", [False, True], ids=["as-ended", "run-again"])
def test_a_join_cut_by_a_kill_is_done_after_the_restart(server, moved):
    """The server killed after a response ended but before its items joined (simulated: the
    join undone in the file while the server is down, its run row put back as it was): the first
    read after the restart joins them, and the response is the head the next one starts from.
    A run whose task ran again since (its version moved: a continue) joins nothing: the task no
    longer shows the response's output."""
    import sqlite3

    client = sdk(server, key="k1")
    conv = client.conversations.create(items=[user("Hello.")])
    r1 = client.responses.create(model="m", conversation=conv.id, input="One.", text=TEXT, max_output_tokens=30)
    joined = texts(items_of(client, conv.id))
    assert joined == ["Hello.", "One.", r1.output_text]
    # its state is written behind: the kill comes once it is (else the next response cannot fork it)
    wait_committed(server.db, "TASK_" + r1.id[5:], lambda row: row["state_id"] is not None)
    server.kill()
    with sqlite3.connect(server.db) as db:
        db.execute("DELETE FROM conversation_items WHERE conversation_id = ? AND seq > 1", (conv.id,))
        db.execute("UPDATE conversations SET last_seq = 1, head_task = NULL, head_seq = 0 WHERE id = ?", (conv.id,))
        db.execute("INSERT INTO conversation_runs (conversation_id, task_id, base_seq, base_cuts, task_version, "
                   "created_at) VALUES (?, ?, 1, 0, ?, 0.0)", (conv.id, "TASK_" + r1.id[5:], -1 if moved else 0))
    server.start()
    client = sdk(server, key="k1")
    assert texts(items_of(client, conv.id)) == (["Hello."] if moved else joined)
    r2 = client.responses.create(model="m", conversation=conv.id, input="Two.", text=TEXT, max_output_tokens=30)
    assert r2.usage.input_tokens_details.cached_tokens == (0 if moved else held(r1))


def test_a_response_continued_at_once_joins_as_it_ended(server):
    """A client that continues a response's task (/v1/tasks) the moment it has the answer: the
    conversation gets the response's own output, and the next response does not start from that
    task's state (it holds the continue's turn, which no item has)."""
    client = sdk(server, key="k1")
    conv = client.conversations.create(items=[user("Hello.")])
    r1 = client.responses.create(model="m", conversation=conv.id, input="One.", text=TEXT, max_output_tokens=30)
    tid = "TASK_" + r1.id[5:]
    r = _call(server, "POST", f"/v1/tasks/{tid}/continue", json_body={"prompt": "\n\nUser: more\n\nAssistant:",
                                                                       "max_tokens": 5})  # fmt: skip
    assert r.status_code == 200, r.text
    assert texts(items_of(client, conv.id)) == ["Hello.", "One.", r1.output_text]
    r2 = client.responses.create(model="m", conversation=conv.id, input="Two.", text=TEXT, max_output_tokens=30)
    assert r2.usage.input_tokens_details.cached_tokens == 0  # the whole history prefilled
    assert texts(items_of(client, conv.id))[3:] == ["Two.", r2.output_text]


def test_a_whole_history_over_the_prompt_limit_names_the_conversation(server):
    """Each response prefills only what came after the last one's state; once a deleted item
    drops that state, the whole history is prefilled, and past --max-prompt-tokens (700 here)
    that is a 413 naming the conversation and saying what to do. Nothing is created."""
    client = sdk(server, key="k1")
    long = " ".join(["word"] * 340)
    conv = client.conversations.create(items=[user("Hi.", id="msg_hi"), user(long)])
    client.responses.create(model="m", conversation=conv.id, input="One.", max_output_tokens=3)
    client.conversations.items.create(conv.id, items=[user(long)])
    r2 = client.responses.create(model="m", conversation=conv.id, input="Two.", max_output_tokens=3)
    assert r2.usage.input_tokens > 700  # (its own prefill was the new part only)
    client.conversations.items.delete("msg_hi", conversation_id=conv.id)
    before, tasks = items_of(client, conv.id), _tasks(server)
    r = _call(server, "POST", "/v1/responses", json_body={"model": "m", "conversation": conv.id, "input": "Three."})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "conversation" and "delete items" in err["message"], err
    assert items_of(client, conv.id) == before and _tasks(server) == tasks
