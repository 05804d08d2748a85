"""POST /v1/responses with a field of OpenAI's Responses API this server cannot honour, or a tool in
chat's shape, against a real server: a 400 whose code and param say what to change (docs/agents.md,
"Not supported" and "Tools on /v1/responses"), and nothing created (no task, no prompt token given
to the engine)."""

from __future__ import annotations

import httpx
import openai
import pytest
from util_server import sdk, server_fixture

from server.api.metrics import parse_metrics

server = server_fixture()

TOOL = {"type": "function", "name": "get_time", "description": "The time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


def created(server) -> tuple[list[str], float]:
    """The ids of the tasks, and the prompt tokens the engine was given so far (a refusal changes
    neither; a store: false response is no listed task, but its prompt is given to the engine)."""
    metrics = parse_metrics(httpx.get(server.url + "/metrics").text)
    tasks = httpx.get(server.url + "/v1/tasks/list").json()["tasks"]
    return sorted(t["task_id"] for t in tasks), metrics["rwkv_prompt_tokens_total"]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("value", ["conv_1", {"id": "conv_1"}], ids=["id", "object"])  # the SDK's: an id, or {"id"}
@pytest.mark.parametrize("extra", [{}, {"stream": True}], ids=["plain", "stream"])
def test_an_unknown_conversation_is_not_found(server, value, extra):
    """(Conversations are supported: test_conversations.py.) One that does not exist is a 404 naming
    the field, nothing created; store: false in a conversation is a 400 naming store."""
    before = created(server)
    r = post(server, {"conversation": value, **extra})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("conversation", "conversation_not_found"), err
    r = post(server, {"conversation": value, "store": False, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store", r.text
    assert created(server) == before


@pytest.mark.parametrize("field,value", [
    ("prompt", {"id": "pmpt_1", "version": "2", "variables": {"city": "Paris"}}),  # a stored prompt
    ("prompt", {"id": "pmpt_1"}),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("extra", [{}, {"stream": True}, {"store": False}], ids=["plain", "stream", "not-stored"])
def test_a_stored_prompt_is_unsupported_naming_it(server, field, value, extra):
    """As its neighbours in the docs (access_programs, image, ...): 400 unsupported_field
    naming the field, with why (was 400 invalid_request "invalid 'prompt': Input should be None",
    which reads as a malformed value)."""
    before = created(server)
    r = post(server, {field: value, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (field, "unsupported_field", "invalid_request_error"), err
    msg = err["message"]
    assert msg.startswith(field) and msg.endswith(" is not supported on /v1/responses"), msg
    assert "Input should be" not in msg and len(msg) > len(f"{field} is not supported on /v1/responses"), msg
    assert created(server) == before


def test_the_sdk_sees_the_refusal(server):
    before = created(server)
    with pytest.raises(openai.BadRequestError) as ei:
        sdk(server).responses.create(model="m", input="x", max_output_tokens=2, prompt={"id": "pmpt_1", "version": "1"})
    assert (ei.value.code, ei.value.param) == ("unsupported_field", "prompt")
    with pytest.raises(openai.NotFoundError) as nf:
        sdk(server).responses.create(model="m", input="x", max_output_tokens=2, conversation="conv_1")
    assert (nf.value.code, nf.value.param) == ("conversation_not_found", "conversation")
    assert created(server) == before


@pytest.mark.parametrize("field", ["conversation", "prompt"])
def test_null_is_accepted(server, field):
    """null is the default (SDKs send null for a field not set)."""
    r = post(server, {field: None})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function"),
    ({"tools": [CHAT_TOOL]}, "tools[0].function"),
    ({"tools": [TOOL, {**CHAT_TOOL, "function": {**CHAT_TOOL["function"], "name": "other"}}]}, "tools[1].function"),
    ({"tools": [CHAT_TOOL], "tool_choice": "required"}, "tools[0].function"),
    ({"tools": [CHAT_TOOL], "tool_choice": "none"}, "tools[0].function"),
    ({"tools": [{**TOOL, "function": {"name": "get_time"}}]}, "tools[0].function"),  # both shapes at once
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_tool_in_chats_shape_names_its_function_key(server, body, param):
    """docs/agents.md: a Responses tool is {"type": "function", "name", "parameters", ...}; "Any
    other key is a 400 naming it". Chat's {"type": "function", "function": {...}} names `function`
    and says where its fields go (was "tools[0].name: a tool name is 1-64 letters...", though a name
    was given), as a chat-shaped tool_choice's message gives the Responses shape."""
    before = created(server)
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "invalid_request"), err
    msg = err["message"]
    assert "1-64" not in msg and param in msg, msg
    assert '{"type": "function", "name"' in msg and "top level" in msg, msg
    assert created(server) == before


def test_the_sdk_sees_the_chat_shaped_tool_refusal(server):
    before = created(server)
    with pytest.raises(openai.BadRequestError) as ei:
        sdk(server).responses.create(model="m", input="x", max_output_tokens=2, tools=[CHAT_TOOL])  # type: ignore[list-item]
    assert (ei.value.code, ei.value.param) == ("invalid_request", "tools[0].function")
    assert created(server) == before


def test_a_chat_shaped_tool_choice_gives_the_responses_shape(server):
    """(Unchanged: the message the tool's refusal is consistent with.)"""
    r = post(server, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("tool_choice", "invalid_request") and '"name"' in err["message"], err


def test_the_responses_shape_still_works(server):
    r = sdk(server).responses.create(model="m", input="x", max_output_tokens=80, tools=[TOOL], tool_choice="required",
                                     parallel_tool_calls=False)
    assert r.status == "completed" and [o.type for o in r.output][-1] == "function_call", r
    chat = sdk(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=80,
                                               tools=[CHAT_TOOL], tool_choice="required",  # (chat: its shape)
                                               parallel_tool_calls=False)
    assert chat.choices[0].message.tool_calls, chat
