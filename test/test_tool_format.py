"""Tools together with a JSON output format (response_format on chat, text.format on /v1/responses),
as OpenAI's Agents SDK sends them for an agent with tools and an output_type: with tool_choice
auto the answer is either the call envelope from its first character or the formatted JSON reply
(one any_of grammar: tools.ToolPlan.with_format), with required / a named function it is the call
list. A real server with the random tiny model, where only the grammar makes an output valid: over
seeds, every answer is valid calls or JSON valid for the schema, and both kinds occur."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from util_server import sdk, server_fixture, task_result

from server.api.openai import tools
from server.engine.types import GrammarSpec

server = server_fixture()
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
ANSWER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
TEXT_FORMAT = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
SEEDS = range(18, 22)
"""Seeds whose answers (temperature 1, this prompt, after the gap: agents.ready_grammar, the same
on both routes) hold both kinds: seed 19 calls, the others answer in the format (checked by
running; the tests assert both kinds occur)."""
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "parallel_tool_calls": False}
USER = [{"role": "user", "content": "Weather?"}]


def chat_body(seed: int, **extra) -> dict:
    return {"model": "m", "messages": USER, "tools": CHAT_TOOLS, "response_format": CHAT_FORMAT, "max_tokens": 60,
            "seed": seed, **SAMPLING, **extra}  # fmt: skip


def response_body(seed: int, **extra) -> dict:
    return {"model": "m", "input": "Weather?", "tools": FLAT_TOOLS, "text": {"format": TEXT_FORMAT},
            "max_output_tokens": 60, "seed": seed, **SAMPLING, **extra}  # fmt: skip


def check_chat(content: str | None, calls: list | None, finish: str) -> str:
    """One chat answer: valid calls (finish tool_calls, no content) or the formatted reply."""
    if calls:
        assert finish == "tool_calls" and content is None, (finish, content)
        for c in calls:
            assert c["function"]["name"] == "get_weather" and c["id"].startswith("call_")
            jsonschema.validate(json.loads(c["function"]["arguments"]), WEATHER)
        return "calls"
    assert finish == "stop", (finish, content)
    jsonschema.validate(json.loads(content or ""), ANSWER)
    return "json"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_answers_are_calls_or_the_formatted_reply(server, stream):
    kinds = []
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for seed in SEEDS:
            if not stream:
                r = c.post("/v1/chat/completions", json=chat_body(seed))
                assert r.status_code == 200, r.text
                ch = r.json()["choices"][0]
                kinds.append(check_chat(ch["message"]["content"], ch["message"].get("tool_calls"), ch["finish_reason"]))
                continue
            chunks = sdk(server, timeout=120).chat.completions.create(**chat_body(seed), stream=True)
            content, calls, finish = "", {}, None
            for ch in chunks:
                d = ch.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or ():
                    got = calls.setdefault(tc.index, {"id": tc.id, "function": {"name": "", "arguments": ""}})
                    got["function"]["name"] += tc.function.name or ""
                    got["function"]["arguments"] += tc.function.arguments or ""
                finish = ch.choices[0].finish_reason or finish
            kinds.append(check_chat(content or None, list(calls.values()), finish))
    assert set(kinds) == {"calls", "json"}, kinds  # both kinds, over the seeds


def check_response(r: dict) -> str:
    """One response: function_call items only, or one message whose text is the formatted reply."""
    assert r["status"] == "completed", r
    assert r["text"]["format"]["type"] == "json_schema" and r["text"]["format"]["schema"] == ANSWER
    kinds = [o["type"] for o in r["output"]]
    if "function_call" in kinds:
        assert set(kinds) == {"function_call"}, kinds
        for o in r["output"]:
            assert o["name"] == "get_weather" and o["status"] == "completed"
            jsonschema.validate(json.loads(o["arguments"]), WEATHER)
        return "calls"
    (msg,) = r["output"]
    jsonschema.validate(json.loads(msg["content"][0]["text"]), ANSWER)
    return "json"


def sse(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_are_calls_or_the_formatted_reply(server, stream):
    """The JSON reply is output_text, a call a function_call item; streamed: the reply comes as
    text deltas, a call as OpenAI streams one; read back (GET), the response is the same."""
    kinds = []
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for seed in SEEDS:
            r = c.post("/v1/responses", json=response_body(seed, stream=stream))
            assert r.status_code == 200, r.text
            if stream:
                events = sse(r.text)
                final = events[-1]["response"]
                kind = check_response(final)
                deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
                args = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
                if kind == "json":
                    assert deltas == final["output"][0]["content"][0]["text"] and not args
                else:
                    assert deltas == "" and args == [o["arguments"] for o in final["output"]]
                    assert not [e for e in events if e["type"] == "response.output_item.added"
                                and e["item"]["type"] == "message"]  # fmt: skip
            else:
                final = r.json()
                kind = check_response(final)
            kinds.append(kind)
            assert c.get(f"/v1/responses/{final['id']}").json()["output"] == final["output"]
    assert set(kinds) == {"calls", "json"}, kinds


def test_the_sdk_parses_the_formatted_reply(server):
    """output_text is the reply the SDK's typed helpers read (a seed that answers in the format)."""
    r = sdk(server, timeout=120).responses.create(**{k: v for k, v in response_body(8).items() if k != "seed"},
                                     extra_body={"seed": 8})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), ANSWER)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_with_a_format_is_the_call(server, choice):
    """required or a named function: the answer is the call list (the format is a later turn's)."""
    named_chat = {"type": "function", "function": {"name": "get_weather"}}
    named_flat = {"type": "function", "name": "get_weather"}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for seed in SEEDS:
            r = c.post("/v1/chat/completions",
                       json=chat_body(seed, tool_choice="required" if choice == "required" else named_chat))
            ch = r.json()["choices"][0]
            assert check_chat(ch["message"]["content"], ch["message"].get("tool_calls"), ch["finish_reason"]) == "calls"
            r = c.post("/v1/responses",
                       json=response_body(seed, tool_choice="required" if choice == "required" else named_flat))
            assert check_response(r.json()) == "calls"


def test_json_object_with_tools(server):
    """json_object as the format: a call list or a JSON object (seed 2 answers, 19 calls)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        kinds = []
        for seed in (2, 19):
            ch = c.post("/v1/chat/completions",
                        json=chat_body(seed, response_format={"type": "json_object"})).json()["choices"][0]
            if ch["finish_reason"] == "tool_calls":
                jsonschema.validate(json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"]), WEATHER)
            else:
                assert ch["finish_reason"] == "stop" and isinstance(json.loads(ch["message"]["content"]), dict)
            kinds.append(ch["finish_reason"])
        assert kinds == ["stop", "tool_calls"]


BAD = {"type": "object", "properties": {"a": {"$ref": "#"}}}  # recursive: the engine refuses it


def test_a_bad_format_with_tools_is_a_400_naming_the_format(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=chat_body(0, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}))  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        assert r.json()["error"]["code"] == "invalid_schema"
        r = c.post("/v1/responses", json=response_body(0, text={"format": {**TEXT_FORMAT, "schema": BAD}}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
        bad_tool = [{**FLAT_TOOLS[0], "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}]
        r = c.post("/v1/responses", json=response_body(0, tools=bad_tool))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_a_call_list_cut_beside_a_format_has_no_content(server):
    """Seed 19 calls; max_tokens cuts its list: no call, finish length, and content null streamed
    or not (the raw envelope as content broke the SDK's stream helper, which reads a formatted
    reply's content as JSON as it streams: QA saw a bare ValueError instead of its
    LengthFinishReasonError)."""
    import openai
    from openai.lib._parsing._completions import type_to_response_format_param as as_sdk_sends

    body = chat_body(19, max_tokens=8)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        ch = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert ch["finish_reason"] == "length" and ch["message"]["content"] is None, ch
        assert not ch["message"].get("tool_calls"), ch
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [x["choices"][0] for x in chunks if x["choices"]]
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["length"]
    assert not any(d["delta"].get("content") for d in deltas), deltas
    with httpx.Client(base_url=server.url, timeout=120) as c:  # a cut inside the marker itself: no
        for n in range(1, 8):  # content either (QA: '<tool_', the fragment, as the JSON reply)
            ch = c.post("/v1/chat/completions", json=chat_body(19, max_tokens=n)).json()["choices"][0]
            assert ch["finish_reason"] == "length" and ch["message"]["content"] in (None, ""), (n, ch)
    from pydantic import BaseModel, Field

    class Answer(BaseModel):  # ANSWER, as the SDK's helpers take it
        n: int = Field(ge=0, le=9)
        ok: bool

    kw = {k: v for k, v in body.items() if k not in ("response_format", "seed")}
    for seed in range(16, 40):  # a seed whose answer calls under the SDK's form of the schema
        ch = sdk(server, timeout=120).chat.completions.create(**kw, seed=seed, response_format=as_sdk_sends(Answer))
        if ch.choices[0].finish_reason == "length" and ch.choices[0].message.content is None:
            break  # (a JSON reply max_tokens cut has its text as content: JSON as far as it went)
    assert ch.choices[0].finish_reason == "length" and ch.choices[0].message.content is None, ch
    with pytest.raises(openai.LengthFinishReasonError):  # as parse() raises, not a JSON error mid-stream
        with sdk(server, timeout=120).chat.completions.stream(**kw, seed=seed, response_format=Answer) as stream:
            for _ in stream:
                pass


def test_a_recursive_tool_is_refused(server):
    """A tool whose parameters recurse (pydantic's `kids: list["Node"]`, as openai.pydantic_function_tool
    writes it): each tool's $defs move under the tools' grammar (#/items/anyOf/i/...), a pointer
    through array indices, which the recursion check did not follow (QA: accepted, nesting to length)."""
    import openai
    from pydantic import BaseModel

    class Node(BaseModel):
        name: str
        kids: list["Node"]

    tool = openai.pydantic_function_tool(Node)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for choice in ("auto", "required"):
            r = c.post("/v1/chat/completions", json={**chat_body(0), "tools": [tool], "tool_choice": choice})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_schema", r.text
            assert "recursive" in r.json()["error"]["message"], r.text


def test_the_task_keeps_the_one_grammar(server):
    """A Responses task has one grammar: the any_of of the calls and the format, stored as its
    `grammar` (its format as text: the response shows the request's text.format from its meta),
    so a fork of it (here through /v1/tasks) runs the same: a call or the formatted reply."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        rid = c.post("/v1/responses", json=response_body(8)).json()["id"]
        for seed in (8, 10):
            fork = c.post(f"/v1/tasks/TASK_{rid[5:]}/fork", json={"prompt": "\n\nUser: Again?\n\nAssistant:",
                                                               "max_tokens": 60, "seed": seed})  # fmt: skip
            assert fork.status_code == 200, fork.text
            res = task_result(c, fork.json()["task_id"])
            assert res["finish_reason"] == "stop", res
            head, calls = tools.parse_calls(res["result"], "formatted")
            if calls is None:
                jsonschema.validate(json.loads(head), ANSWER)
            else:
                assert [n for n, _ in calls] == ["get_weather"]


def test_task_params_store_the_call_grammar_and_show_the_format():
    from server.api.responses.agent import ResponseTools, task_params
    from server.api.responses.render import response
    from server.tasks.output import Output
    from server.tasks.params import clean_params, sampling_params
    from server.tasks.records import TASK, Task

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    plan = tools.plan(FLAT_TOOLS, "auto", False, flat=True)
    assert plan is not None
    plan = plan.with_format(GrammarSpec.json_schema(json.dumps(ANSWER)))
    raw = {"response_format": fmt, **task_params(ResponseTools(plan, plan, plan.grammar()), {"x": 1}, fmt)}
    params = clean_params(raw, 65536)  # (one grammar: a format beside it would be TaskInvalid)
    assert params["response_format"] == {"type": "text"} and params["meta"] == {"x": 1, "format": fmt}
    assert sampling_params(params, 16).grammar == plan.grammar()
    for text, kinds in [(CALL, ["function_call"]), ('{"n": 1, "ok": true}', ["message"])]:
        t = Task(id="TASK_" + "c" * 32, kind=TASK, params=params, prompt="User: x\n\nAssistant:",
                 out=Output(text, [len(text)]), finish_reason="stop", tag="response")  # fmt: skip
        body = response(t, "m")
        assert [o["type"] for o in body["output"]] == kinds
        assert body["text"]["format"] == {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}


def test_the_plan_builds_one_grammar_per_answer():
    fmt = GrammarSpec.json_schema(json.dumps(ANSWER))
    auto = tools.plan(CHAT_TOOLS, "auto", False)
    assert auto is not None and auto.mode == "auto" and auto.grammar().trigger == tools.MARKER
    either = auto.with_format(fmt)
    assert either.mode == "formatted"
    (calls_prefix, calls), (reply_prefix, reply) = either.grammar().alternatives()
    assert (calls_prefix, reply_prefix, reply) == (tools.MARKER, "", fmt)
    assert calls == GrammarSpec.json_schema(auto.grammar().source)  # the same list, without the trigger
    assert auto.with_format(None) is auto
    forced = tools.plan(CHAT_TOOLS, "required", False)
    assert forced is not None and forced.with_format(fmt) is forced and forced.grammar().kind == "json_schema"


async def test_a_chat_answers_grammar_starts_with_the_gap():
    """agents.chat_ready: a format's grammar, and the call-or-format union, start with the space
    the chat format writes after "Assistant:"; free text, triggered and forced grammars do not
    change, nor does a grammar whose any_of source would pass the size bound (it runs as given),
    nor one that continues an assistant message. Each is compiled once (a rich schema's first
    compile takes seconds); a forced plan's format, not in its grammar, is checked as well."""
    from types import SimpleNamespace

    from server.api.openai.agents import Agent, chat_ready
    from server.engine.types import MAX_GRAMMAR_CHARS

    made: list[GrammarSpec] = []
    sv: Any = SimpleNamespace(engine=SimpleNamespace(compile_grammar=lambda spec: (spec.check(), made.append(spec))))

    async def ready(agent: Agent, new_turn: bool = True) -> tuple[GrammarSpec | None, int]:
        made.clear()
        grammar = (await chat_ready(sv, agent, new_turn=new_turn)).grammar
        return grammar, len(made)

    fmt = GrammarSpec.json_schema(json.dumps(ANSWER))
    assert await ready(Agent(grammar=fmt, fmt=fmt)) == (GrammarSpec.any_of([(" ", fmt)]), 1)
    assert await ready(Agent(grammar=fmt, fmt=fmt), new_turn=False) == (fmt, 1)
    auto = tools.plan(CHAT_TOOLS, "auto", False)
    forced = tools.plan(CHAT_TOOLS, "required", False)
    assert auto is not None and forced is not None
    either = auto.with_format(fmt)
    gapped, n = await ready(Agent(either, either.grammar(), fmt=fmt))
    assert n == 1 and gapped is not None and [p for p, _ in gapped.alternatives()] == [" " + tools.MARKER, " "]
    assert [a for _, a in gapped.alternatives()] == [a for _, a in either.grammar().alternatives()]
    assert await ready(Agent()) == (None, 0)
    assert await ready(Agent(auto, auto.grammar())) == (auto.grammar(), 1)
    assert await ready(Agent(forced, forced.grammar())) == (forced.grammar(), 1)
    assert await ready(Agent(forced, forced.grammar(), fmt=fmt)) == (forced.grammar(), 2)  # + the format's check
    big = GrammarSpec.json_schema(json.dumps({"enum": ["x" * (MAX_GRAMMAR_CHARS - 20)]}))
    big.check()
    assert (await ready(Agent(grammar=big, fmt=big)))[0] is big


CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'


@pytest.mark.parametrize("text,content,n_calls,streamable", [
    (CALL, "", 1, 0),
    ('{"n": 1, "ok": true}', '{"n": 1, "ok": true}', 0, 20),
    ('{"n": "<tool_call>[1]"}', '{"n": "<tool_call>[1]"}', 0, 23),  # a marker inside the reply is text
    ("<tool_c", "<tool_c", 0, 0),  # may become the envelope: held back
    ('{"n": "<tool', '{"n": "<tool', 0, 12),
])  # fmt: skip
def test_a_formatted_output_splits_at_its_first_character(text, content, n_calls, streamable):
    head, calls = tools.split(text, "formatted")
    assert head == content and len(calls or ()) == n_calls
    assert tools.content_end(text, "formatted") == streamable
    assert tools.resent_text(text, "formatted") == (CALL if n_calls else text)


@pytest.mark.parametrize("text,n_calls,streamable", [
    (" " + CALL, 1, 0),
    (' {"n": 1, "ok": true}', 0, 21),
    (" ", 0, 0),  # the gap alone: may still become the envelope
    (" <tool_c", 0, 0),
    (' {"n": "<tool_call>[1]"}', 0, 24),
])  # fmt: skip
def test_a_chat_answers_gap_comes_before_its_first_character(text, n_calls, streamable):
    """A chat answer starts with the gap after "Assistant:" (agents.chat_ready): the envelope or
    the reply comes after it, and the message re-sent has no gap (the history writes one)."""
    head, calls = tools.split(text, "formatted")
    assert len(calls or ()) == n_calls and head == ("" if n_calls else text)
    assert tools.content_end(text, "formatted") == streamable
    assert tools.resent_text(text, "formatted") == (CALL if n_calls else text.lstrip())
