"""Tools on the Responses API (/v1/responses), with the official SDK against a real server (the
random synthetic model: forced calls are valid only through the grammar): tool loops of forced
calls then a final answer, through previous_response_id and statelessly (the client sends the
items back), across a restart; the SDK's stream helper; the input items listing; the prompt
rendered as chat renders the same history; bad input refused with nothing created."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI
from util_server import sdk, server_fixture, task_result

from server.api.metrics import parse_metrics
from server.tokenizer import get_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "get_time", "description": "The time", "parameters": ZONE, "strict": True}]
PARAMS = {"get_weather": WEATHER, "get_time": ZONE}
QUESTION = "What is the weather in Paris?"
FORCED = {"model": "m", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
          "max_output_tokens": 60}


server = server_fixture()


def created(server) -> tuple[list[str], float]:
    """The ids of the tasks, and the prompt tokens the engine was given so far (a refusal changes
    neither; a row's other fields change as its state is written behind)."""
    metrics = parse_metrics(httpx.get(server.url + "/metrics").text)
    tasks = httpx.get(server.url + "/v1/tasks/list").json()["tasks"]
    return sorted(t["task_id"] for t in tasks), metrics["rwkv_prompt_tokens_total"]


def one_call(r):
    """The response's one function call, checked: completed, ids, arguments valid for its tool."""
    assert r.status == "completed", r
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.output[-1] is call and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    return call


def result(call, text: str) -> dict:
    return {"type": "function_call_output", "call_id": call.call_id, "output": text}


def test_a_tool_loop_through_previous_response_id_across_a_restart(server):
    """Two rounds of forced calls, each answered by its result, then a final answer: every
    response starts from the previous one's state, and the chain survives a restart."""
    client = sdk(server)
    r = client.responses.create(input=QUESTION, instructions="Use the tools.", **FORCED)
    chain = [r]
    for step in range(3):
        call = one_call(r)
        if step == 2:
            server.restart()  # the chain, its calls and their ids live in the database
            client = sdk(server)
        last = step == 2
        r = client.responses.create(previous_response_id=r.id, input=[result(call, f"result {step}")],
                                    **{**FORCED, "tool_choice": "none" if last else "required"})
        prev = chain[-1]
        assert r.previous_response_id == prev.id and r.instructions is None
        assert r.usage.input_tokens_details.cached_tokens >= prev.usage.input_tokens + prev.usage.output_tokens
        # the new turns only, after the turn break: the result and the answer's start (the tools
        # are described once)
        turn = f'\n\nTool: {{"name": "{call.name}", "content": "result {step}"}}\n\nAssistant:'
        new = len(get_tokenizer().encode(turn + ("" if last else " <tool_call>")))
        assert r.usage.input_tokens == prev.usage.input_tokens + prev.usage.output_tokens + new
        chain.append(r)
    assert [o.type for o in r.output] == ["message"] and r.output_text
    for old in chain:  # every step stays readable, its calls named alike
        got = client.responses.retrieve(old.id)
        assert got.output == old.output and got.instructions == old.instructions
        assert got.tools == old.tools and got.tool_choice == old.tool_choice
    assert chain[0].instructions == "Use the tools." and chain[0].tool_choice == "required"
    assert [t.name for t in chain[0].tools] == ["get_weather", "get_time"] and chain[0].tools[0].strict


def test_a_stateless_tool_loop_sends_the_items_back_across_a_restart(server):
    """The client keeps the conversation: the output items and the results go back as input."""
    client = sdk(server)
    items: list = [{"role": "user", "content": QUESTION}]
    r = client.responses.create(input=items, **FORCED)
    for step in range(3):
        call = one_call(r)
        items += [*r.output, result(call, f"result {step}")]  # (SDK objects, as the SDK's guide does)
        if step == 1:
            server.restart()
            client = sdk(server)
        r = client.responses.create(input=items, **{**FORCED, "tool_choice": "none" if step == 2 else "required"})
        assert r.previous_response_id is None and r.usage.input_tokens_details.cached_tokens == 0
    assert [o.type for o in r.output] == ["message"]
    listed = list(client.responses.input_items.list(r.id, order="asc"))
    assert [i.type for i in listed] == ["message"] + ["function_call", "function_call_output"] * 3
    assert [i.call_id for i in listed[1::2]] == [i.call_id for i in listed[2::2]]


def test_allowed_tools_restrict_the_calls_not_the_prompt(server):
    """tool_choice allowed_tools: the output calls only the tools listed (required: one or more of
    them; auto: those or text), while the system turn describes them all, so the next turn of a
    tool loop that allows others reuses the state (its prompt's tools are described once)."""
    client = sdk(server)
    allow = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    r = client.responses.create(**{**FORCED, "tool_choice": allow}, input=QUESTION)
    assert [(o.type, o.name) for o in r.output] == [("function_call", "get_time")]
    jsonschema.validate(json.loads(r.output[0].arguments), ZONE)
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"
    every = client.responses.create(**FORCED, input=QUESTION)  # (required, every tool: the same prompt)
    assert every.usage.input_tokens == r.usage.input_tokens
    weather = {**allow, "tools": [{"type": "function", "name": "get_weather"}]}
    then = client.responses.create(**{**FORCED, "tool_choice": weather}, previous_response_id=r.id,
                                   input=[result(one_call(r), "12:00")])
    assert [o.name for o in then.output] == ["get_weather"]
    cached = then.usage.input_tokens_details.cached_tokens
    assert cached >= r.usage.input_tokens + r.usage.output_tokens - 1  # from the state: nothing described again


def test_max_tool_calls_bounds_built_in_tools_only(server):
    """OpenAI's max_tool_calls counts calls to built-in tools, none here: accepted, echoed (on
    create and on retrieve), the forced function call made as without it."""
    client = sdk(server)
    r = client.responses.create(**FORCED, input=QUESTION, max_tool_calls=0)
    assert r.max_tool_calls == 0 and [o.type for o in r.output] == ["function_call"]
    assert client.responses.retrieve(r.id).max_tool_calls == 0
    assert client.responses.create(**FORCED, input=QUESTION).max_tool_calls is None


def test_the_prompt_is_chats_rendering_of_the_same_history():
    """Responses items -> the text chat renders for the same messages (one shared renderer)."""
    from server.api.openai.chat_format import build_prompt
    from server.api.openai.messages import turns
    from server.api.openai.schemas import ChatMessage
    from server.api.openai.tools import plan
    from server.api.responses.agent import ResponseTools, prompt_and_meta
    from server.api.responses.schemas import ResponseRequest

    args = '{"city": "Rome", "days": 2}'
    body = ResponseRequest.model_validate({"tools": TOOLS, "tool_choice": "required", "input": [
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": args},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone": "UTC"}'},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "rain"}]}]})
    flat = plan(TOOLS, "required", False, flat=True)
    text, meta = prompt_and_meta(body, ResponseTools(flat, flat, flat.grammar()), None)
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in TOOLS]
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
             {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]]
    chat = plan(chat_tools, "required", False)
    assert text == build_prompt(turns(messages, chat)).text + chat.prompt_suffix()
    assert flat.grammar() == chat.grammar() and meta["calls"] == {"c1": "get_weather", "c2": "get_time"}
    assert [i["id"].split("_")[0] for i in meta["input"]] == ["msg", "msg", "fc", "fc", "fco", "fco"]


def test_the_sdk_stream_helper_takes_a_streamed_call(server):
    client = sdk(server)
    with client.responses.stream(input=QUESTION, **FORCED) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.output_index == 0
    call = one_call(final)
    assert delta.delta == done.arguments == call.arguments and delta.item_id == done.item_id == call.id
    fields = lambda c: (c.id, c.call_id, c.name, c.arguments, c.status)  # noqa: E731
    assert fields(item_done.item) == fields(call) and call.parsed_arguments == json.loads(call.arguments)
    (read,) = client.responses.retrieve(final.id).output  # the same ids when read back
    assert fields(read) == fields(call)


def test_input_items_pages_as_openai_lists_them(server):
    client = sdk(server)
    inp = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    r = client.responses.create(model="m", input=inp, instructions="Be brief.", max_output_tokens=2)
    assert client.responses.retrieve(r.id).instructions == "Be brief."
    get = lambda **q: httpx.get(f"{server.url}/v1/responses/{r.id}/input_items", params=q)  # noqa: E731
    first = get(limit=2).json()  # desc by default: the last item first
    texts = [[c["text"] for c in i["content"]][0] for i in first["data"]]
    assert texts == ["message 4", "message 3"] and first["object"] == "list" and first["has_more"]
    assert all(i["id"].startswith("msg_") and i["role"] == "user" for i in first["data"])
    assert (first["first_id"], first["last_id"]) == (first["data"][0]["id"], first["data"][1]["id"])
    rest = get(limit=2, after=first["last_id"]).json()
    end = get(limit=2, after=rest["last_id"]).json()
    assert [len(p["data"]) for p in (rest, end)] == [2, 1] and rest["has_more"] and not end["has_more"]
    asc = [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc", limit=2)]
    assert asc == [f"message {i}" for i in range(5)]  # (the SDK follows has_more / after)
    assert get(include=["message.input_image.image_url"]).json()["data"] == get().json()["data"]  # ignored
    for q, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                     ({"after": "msg_nope"}, "after")]:
        bad = get(**q)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    missing = httpx.get(f"{server.url}/v1/responses/resp_{'0' * 32}/input_items")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"


def test_a_response_stored_before_items_were_kept_lists_none():
    """Older rows have no `meta`: no instructions, an empty listing, the message output."""
    from server.api.responses.items import page
    from server.api.responses.render import meta, response
    from server.tasks.output import Output
    from server.tasks.records import TASK, Task

    t = Task(id="TASK_" + "a" * 32, kind=TASK, params={"max_tokens": 5, "stop": ["\n\n"]},
             prompt="User: x\n\nAssistant:", out=Output(" hi"), finish_reason="stop", tag="response")
    assert page(meta(t).get("input") or [], 20, "desc", None) == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    body = response(t, "m")
    assert body["instructions"] is None and body["tools"] == [] and body["output"][0]["content"][0]["text"] == "hi"


def auto_task(text: str, **params):
    from server.api.openai.tools import plan
    from server.tasks.output import Output
    from server.tasks.params import grammar_fields
    from server.tasks.records import TASK, Task

    grammar = grammar_fields(plan(TOOLS, "auto", None, flat=True).grammar())
    return Task(id="TASK_" + "b" * 32, kind=TASK, params={"grammar": grammar, **params},
                prompt="User: x\n\nAssistant:", out=Output(text, [len(text)]), finish_reason="stop")


CALL_TEXT = '<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]'


def test_an_auto_answer_splits_its_text_from_its_calls():
    """tool_choice auto: the text before the marker is the message, the calls follow it."""
    from server.api.responses.render import calls, known_calls, output

    t = auto_task(" Checking. " + CALL_TEXT, meta={"calls": {"call_x": "f"}})
    msg, call = output(t)
    assert msg["content"][0]["text"] == "Checking. " and call["name"] == "get_time"
    assert (call["id"], call["call_id"]) == ("fc_" + "b" * 32 + "00", "call_" + "b" * 32 + "00")
    assert known_calls(t, calls(t)) == {"call_x": "f", call["call_id"]: "get_time"}


@pytest.mark.parametrize("text,deltas,items", [
    (" Checking. " + CALL_TEXT, ["Checking. "], ["message", "function_call"]),
    (" " + CALL_TEXT, [], ["function_call"]),  # calls only: no message item
    (" Just text <tool", ["Just text ", "<tool"], ["message"]),  # a held-back marker start comes at the end
    (" ", [], ["message"]),  # no text, no call: an empty message
])
def test_a_streamed_auto_answer_opens_its_message_with_its_text(text, deltas, items):
    import asyncio

    from server.api.responses.stream import ResponseStream

    async def events() -> list[dict]:
        s = ResponseStream(auto_task(text), "m", on_abort=lambda: None)
        body = b"".join(s.preamble) + b"".join([c async for c in s.rest()])
        return [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: ")]

    evs = asyncio.run(events())
    assert [e["delta"] for e in evs if e["type"] == "response.output_text.delta"] == deltas
    assert [e["item"]["type"] for e in evs if e["type"] == "response.output_item.added"] == items
    assert [e["item"]["type"] for e in evs if e["type"] == "response.output_item.done"] == items
    assert evs[-1]["type"] == "response.completed" and len(evs[-1]["response"]["output"]) == len(items)


def test_the_task_keeps_its_call_grammar_for_a_fork_after_a_restart(server):
    """The grammar is a task parameter: a /v1/tasks fork of a forced-call response (after a
    restart) writes a valid call list too; a response_format given lifts it."""
    r = sdk(server).responses.create(input=QUESTION, **FORCED)
    one_call(r)
    server.restart()
    tid = "TASK_" + r.id.split("_", 1)[1]
    http = httpx.Client(base_url=server.url, timeout=60)
    fork = http.post(f"/v1/tasks/{tid}/fork", json={"prompt": "\n\nUser: Again.\n\nAssistant: <tool_call>",
                                                    "max_tokens": 60, "seed": 3})
    assert fork.status_code == 200, fork.text
    res = task_result(http, fork.json()["task_id"])
    assert res["finish_reason"] == "stop", res
    (c,) = json.loads(res["result"])
    jsonschema.validate(c["arguments"], PARAMS[c["name"]])


def test_task_params_keep_one_grammar():
    from server.tasks.errors import TaskInvalid
    from server.tasks.params import clean_params, sampling_params

    g = {"kind": "json_schema", "source": json.dumps(WEATHER), "trigger": "<tool_call>"}
    p = clean_params({"grammar": g, "meta": {"x": 1}}, 65536)
    assert p == {"grammar": g, "meta": {"x": 1}, "response_format": {"type": "text"}}
    assert sampling_params(p, 16).grammar.trigger == "<tool_call>"
    assert clean_params({"response_format": {"type": "json_object"}}, 65536)["grammar"] == {}  # lifts a fork's
    for bad in ({"grammar": {"kind": "nope", "source": "x"}}, {"grammar": "x"}, {"meta": [1]},
                {"grammar": g, "response_format": {"type": "json_object"}}):
        with pytest.raises(TaskInvalid):
            clean_params(bad, 65536)


def bad_bodies():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'}
    user = {"role": "user", "content": "x"}
    yield {"tools": [{**TOOLS[0], "name": "bad name"}]}, "tools[0].name", "invalid_request"
    yield {"tools": [{"type": "web_search"}]}, "tools[0]", "invalid_request"
    yield {"tools": [{**TOOLS[0], "bogus": 1}]}, "tools[0].bogus", "invalid_request"  # (was taken, ignored)
    yield {"tools": [{**TOOLS[0], "defer_loading": True}]}, "tools[0].defer_loading", "unsupported_field"
    yield {"tools": [TOOLS[0], {**TOOLS[1], "parameters": "x"}]}, "tools[1].parameters", "invalid_request"
    yield {"tools": [{**TOOLS[0], "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}]}, \
        "tools", "invalid_schema"
    yield {"tools": [{**TOOLS[0], "parameters": {"type": "array"}}]}, "tools[0].parameters", "invalid_request"
    deep: dict = {"type": "string"}
    for _ in range(40):  # (a grammar's compile time grows fast with its depth: bounded as text.format's)
        deep = {"type": "object", "properties": {"a": deep}}
    yield {"tools": [{**TOOLS[0], "parameters": deep}]}, "tools[0].parameters", "invalid_request"
    yield {"tools": [TOOLS[0], TOOLS[0]]}, "tools", "invalid_request"
    yield {"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "invalid_request"
    chat_shape = {"type": "function", "function": {"name": "get_time"}}
    yield {"tools": TOOLS, "tool_choice": chat_shape}, "tool_choice", "invalid_request"
    yield {"tool_choice": "required"}, "tool_choice", "invalid_request"
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    yield {"tools": TOOLS, "tool_choice": {**allowed, "mode": "none"}}, "tool_choice.mode", "invalid_request"
    yield {"tools": TOOLS, "tool_choice": {**allowed, "tools": []}}, "tool_choice.tools", "invalid_request"
    yield {"tools": TOOLS, "tool_choice": {**allowed, "tools": [{"type": "function", "name": "get_time"},
                                                                {"type": "function", "name": "nope"}]}}, \
        "tool_choice.tools[1]", "invalid_request"
    yield {"tools": TOOLS, "tool_choice": {**allowed, "tools": [{"type": "mcp", "server_label": "x"}]}}, \
        "tool_choice.tools[0]", "invalid_request"  # (no built-in or MCP tools here)
    yield {"tools": TOOLS, "tool_choice": {**allowed, "tools": [chat_shape]}}, "tool_choice.tools[0]", "invalid_request"
    yield {"tools": TOOLS, "tool_choice": {**allowed, "bogus": 1}}, "tool_choice", "invalid_request"
    yield {"tools": TOOLS, "tool_choice": {**allowed, "tools": [{"type": "function", "name": ["get_time"]}]}}, \
        "tool_choice.tools[0]", "invalid_request"  # (was a 500)
    yield {"tool_choice": allowed}, "tool_choice", "invalid_request"  # (no tools)
    bad_format = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}  # (with tools: still its own)
    yield {"tools": TOOLS, "text": {"format": bad_format}}, "text.format", "invalid_schema"
    yield {"input": [user, {**call, "call_id": "call_2"}, {"type": "function_call_output", "call_id": "call_1",
                                                           "output": "r"}]}, "input[2].call_id", "invalid_request"
    yield {"input": [user, {**call, "arguments": "{not json"}]}, "input[1].arguments", "invalid_request"
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "r"}  # (call_2 has none)
    yield {"input": [user, call, {**call, "call_id": "call_2"}, answer]}, "input", "invalid_request"
    yield {"input": [{k: v for k, v in call.items() if k != "call_id"}]}, "input[0].call_id", "invalid_request"
    yield {"input": [{**user, "id": "msg_1"}, {**user, "id": "msg_1"}]}, "input[1].id", "invalid_request"
    image = [{"type": "input_image", "image_url": "x"}]
    yield {"input": [call, {"type": "function_call_output", "call_id": "call_1", "output": image}]}, \
        "input[1].output[0].type", "invalid_request"  # (the part named by its place)


@pytest.mark.parametrize("body,param,code", list(bad_bodies()),
                         ids=lambda v: v if isinstance(v, str) and not v.startswith(("invalid", "unsupp")) else None)
def test_bad_tool_input_is_a_400_naming_the_field_and_creates_nothing(server, body, param, code):
    before = created(server)
    r = httpx.post(server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text
    assert created(server) == before


def test_a_result_for_a_call_of_another_chain_is_refused(server):
    """previous_response_id gives the calls of its chain only: another response's call is unknown."""
    client = sdk(server)
    other, prev = (client.responses.create(input=QUESTION, **FORCED) for _ in range(2))
    before = created(server)
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "previous_response_id": prev.id, "input": [result(one_call(prev), "r"), result(one_call(other), "r")],
        "max_output_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].call_id", r.text
    assert created(server) == before


def test_a_format_with_tools_that_cannot_be_called_runs(server):
    """tool_choice "none": no call grammar, so the format's grammar alone runs (chat alike); the
    Agents SDK's agents with tools and an output_type send such a last turn."""
    fmt = {"type": "json_schema", "name": "n", "strict": True,
           "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["n"], "additionalProperties": False}}  # fmt: skip
    r = sdk(server).responses.create(model="m", input="x", tools=TOOLS, tool_choice="none", text={"format": fmt},
                                     max_output_tokens=20)
    assert r.status == "completed" and json.loads(r.output_text)["n"] in range(10)
    chat = sdk(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=20, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": fmt["schema"]}},
    )
    assert json.loads(chat.choices[0].message.content)["n"] in range(10)


def test_a_call_of_the_chain_sent_back_is_not_written_twice(server):
    """A client that sends the previous response's function_call item back with its result and
    previous_response_id: the call is in the state already, so the prompt is the result's alone."""
    client = sdk(server)
    r = client.responses.create(input=QUESTION, **FORCED)
    call = one_call(r)
    answer = result(call, "sunny")
    alone = client.responses.create(previous_response_id=r.id, input=[answer], **{**FORCED, "tool_choice": "none",
                                                                                  "max_output_tokens": 1})
    echoed = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    both = client.responses.create(previous_response_id=r.id, input=[echoed, answer],
                                   **{**FORCED, "tool_choice": "none", "max_output_tokens": 1})
    assert both.usage.input_tokens == alone.usage.input_tokens
    listed = client.responses.input_items.list(both.id).data
    assert [it.type for it in reversed(listed)] == ["function_call", "function_call_output"]


PARALLEL = {"model": "m", "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 120, "temperature": 1.0,
            "top_p": 1.0}  # fmt: skip


def parallel_calls(client: OpenAI):
    """A response of two or more parallel calls (the first seed whose answer has them)."""
    for seed in range(8):
        r = client.responses.create(input=QUESTION, extra_body={"seed": seed}, **PARALLEL)
        calls = [o for o in r.output if o.type == "function_call"]
        if r.status == "completed" and len(calls) >= 2:
            return r, calls
    raise AssertionError("no seed gave parallel calls")


def test_every_call_of_the_previous_response_must_be_answered(server):
    """As OpenAI: with previous_response_id, the input answers every call of that response
    (some of its parallel calls, or none: a new message, is a 400 naming input, in OpenAI's
    words, and creates nothing, streamed or not); answering them all runs."""
    client = sdk(server)
    r, calls = parallel_calls(client)
    before = created(server)
    for inp, missing in [([result(calls[0], "r")], calls[1]), ("And now?", calls[0]),
                         ([{"role": "user", "content": "x"}, result(calls[1], "r")], calls[0])]:
        for stream in (False, True):
            bad = httpx.post(server.url + "/v1/responses", timeout=60, json={
                "model": "m", "previous_response_id": r.id, "input": inp, "max_output_tokens": 2, "stream": stream})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"] == {"message": f"No tool output found for function call {missing.call_id}.",
                                           "type": "invalid_request_error", "param": "input",
                                           "code": "invalid_request"}  # fmt: skip
    assert created(server) == before
    done = client.responses.create(previous_response_id=r.id, input=[result(c, "r") for c in reversed(calls)],
                                   **{**FORCED, "tool_choice": "none", "max_output_tokens": 2})
    assert done.previous_response_id == r.id and done.status in ("completed", "incomplete")
