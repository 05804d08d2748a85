"""POST /v1/responses/input_tokens with the official SDK against a real server: the count is the
`usage.input_tokens` the same fields give on create (instructions, input items, tools, a chain
through previous_response_id, a tool loop's call outputs), nothing is created or run, and bad
fields are refused as create refuses them."""

from __future__ import annotations

import json

import httpx
import pytest
from util_server import sdk, server_fixture

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER,
          "strict": True}]

server = server_fixture(env={"RWKV_API_KEYS": "k1,k2"})


def state(server) -> tuple[list[str], str]:
    """The key's task ids and the engine's prompt-token counter: a count changes neither."""
    r = httpx.get(server.url + "/v1/tasks/list", headers={"Authorization": "Bearer k1"})
    fed = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
           if line.startswith("rwkv_prompt_tokens_total")]
    return sorted(t["task_id"] for t in r.json()["tasks"]), "".join(fed)


def counted(client, **fields) -> int:
    got = client.responses.input_tokens.count(**fields)
    assert got.object == "response.input_tokens"
    return got.input_tokens


@pytest.mark.parametrize("fields", [
    {"input": "Hello there."},
    {"input": "Hello there.", "instructions": "Answer briefly."},
    {"input": [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
               {"role": "user", "content": [{"type": "input_text", "text": "Three?"}]}]},
    {"input": "Weather?", "tools": TOOLS},
    {"input": "Weather?", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    {"input": "Weather?", "tools": TOOLS, "tool_choice": "none"},
], ids=["text", "instructions", "items", "tools", "forced", "tools-none"])
def test_the_count_is_creates_input_tokens(server, fields):
    client = sdk(server, key="k1")
    before = state(server)
    n = counted(client, model="m", **fields)
    assert state(server) == before  # nothing created, nothing fed to the engine
    r = client.responses.create(model="m", max_output_tokens=1, **fields)
    assert n == r.usage.input_tokens > 0


def test_a_chain_counts_its_history(server):
    client = sdk(server, key="k1")
    first = client.responses.create(model="m", input="Pick a number.", max_output_tokens=5)
    n = counted(client, model="m", input="Another one.", previous_response_id=first.id)
    assert n > first.usage.input_tokens + first.usage.output_tokens - 1
    second = client.responses.create(model="m", input="Another one.", previous_response_id=first.id,
                                     max_output_tokens=5)
    assert n == second.usage.input_tokens
    # no input: the history and the next assistant turn's opening
    alone = counted(client, model="m", previous_response_id=second.id)
    assert second.usage.input_tokens + second.usage.output_tokens <= alone < n + 40


def test_a_tool_loop_counts_the_call_outputs(server):
    client = sdk(server, key="k1")
    call = client.responses.create(model="m", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=40)
    fc = next(o for o in call.output if o.type == "function_call")
    answer = [{"type": "function_call_output", "call_id": fc.call_id, "output": '{"temp": 21}'}]
    n = counted(client, model="m", input=answer, previous_response_id=call.id, tools=TOOLS)
    r = client.responses.create(model="m", input=answer, previous_response_id=call.id, tools=TOOLS,
                                max_output_tokens=1)
    assert n == r.usage.input_tokens
    with pytest.raises(Exception) as ei:  # the call left unanswered: refused as on create
        counted(client, model="m", input="What now?", previous_response_id=call.id, tools=TOOLS)
    assert getattr(ei.value, "status_code", None) == 400


@pytest.mark.parametrize("body,status,param,code", [
    ({"previous_response_id": "resp_" + "0" * 32}, 404, "previous_response_id", "response_not_found"),
    ({"conversation": "conv_1"}, 404, "conversation", "conversation_not_found"),
    ({"tools": [{"type": "function", "name": "f g"}]}, 400, "tools[0].name", "invalid_request"),
    ({"max_output_tokens": 5}, 400, "max_output_tokens", "invalid_request"),  # create's only
    ({"personality": "friendly"}, 400, "personality", "invalid_request"),
    ({"input": "\ud800"}, 400, "input", "invalid_request"),
    ({"input": []}, 400, "input", "invalid_request"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400,
     "text.format", "invalid_schema"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_fields_are_refused_in_the_openai_shape(server, body, status, param, code):
    before = state(server)
    r = httpx.post(server.url + "/v1/responses/input_tokens", content=json.dumps({"input": "x", **body}),
                   headers={"Authorization": "Bearer k1", "Content-Type": "application/json"})  # (\ud800 escaped)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), r.text
    assert state(server) == before


def test_another_keys_response_is_not_counted(server):
    mine = sdk(server, key="k1").responses.create(model="m", input="x", max_output_tokens=2)
    r = httpx.post(server.url + "/v1/responses/input_tokens", json={"input": "x", "previous_response_id": mine.id},
                   headers={"Authorization": "Bearer k2"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert httpx.post(server.url + "/v1/responses/input_tokens", json={"input": "x"}).status_code == 401


def test_a_response_its_client_left_is_counted_once_settled(server):
    """A stream the client closed stops its response; a count that comes at once waits for the
    run to settle, as create's fork does (it read the history mid-stop: one token short)."""
    headers = {"Authorization": "Bearer k1"}
    for _ in range(2):
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", server.url + "/v1/responses", headers=headers,
                          json={"input": "long", "max_output_tokens": 3000, "stream": True}) as r:
                lines = r.iter_lines()  # (held: dropping it would close the stream early)
                rid = next(json.loads(x[5:])["response"]["id"] for x in lines if x.startswith("data:"))
                for n, _line in enumerate(lines):  # a few tokens in
                    if n > 20:
                        break
            body = {"input": "z", "previous_response_id": rid}
            count = c.post(server.url + "/v1/responses/input_tokens", json=body, headers=headers)
            while count.status_code == 409:  # (not yet seen as stopping)
                count = c.post(server.url + "/v1/responses/input_tokens", json=body, headers=headers)
            assert count.status_code == 200, count.text
            made = c.post(server.url + "/v1/responses", json={**body, "max_output_tokens": 1}, headers=headers)
            assert made.json()["usage"]["input_tokens"] == count.json()["input_tokens"]


def test_the_counts_path_is_no_response_id(server):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, server.url + "/v1/responses/input_tokens", headers={"Authorization": "Bearer k1"})
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
        assert r.headers["allow"] == "POST"
