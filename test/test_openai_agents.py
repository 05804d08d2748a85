"""Agents on the OpenAI routes, with the official SDK against a real server (a tiny random-weight
fp32 checkpoint, where only the grammar makes an output valid): response_format json_schema
(50 outputs validate), forced tool calls, a tool round trip (streamed and not), logprobs equal to
log_softmax of the `rwkv` package's logits, and bad input refused with 400 before anything runs."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
from openai import OpenAI
from util_server import running_server, sdk, task_result

from server.api.metrics import parse_metrics
from server.model.synthetic import save_synthetic
from server.tokenizer import get_tokenizer

TOL = 1e-4
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["a", "b", "c"]}, "ok": {"type": "boolean"}},
          "required": ["n", "kind", "ok"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
PARAMS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "model.pth"
    save_synthetic("tiny", str(path), dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    # the conversation cache off: logprobs compared with a full prefill, prompts counted exactly
    with running_server(tmp_path_factory.mktemp("srv"), model=checkpoint,
                        env={"RWKV_CONVERSATION_CACHE_BYTES": "0"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return sdk(server, timeout=120)


def prompt_tokens_total(server) -> float:
    return parse_metrics(httpx.get(server.url + "/metrics").text)["rwkv_prompt_tokens_total"]


def test_50_json_schema_responses_all_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    t0 = time.monotonic()

    def one(i: int):
        return client.chat.completions.create(model="m", messages=USER, n=10, seed=100 * i, temperature=1.0,
                                              top_p=1.0, max_tokens=60, response_format=fmt)

    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(one, range(5)))
    took = time.monotonic() - t0
    choices = [c for r in answers for c in r.choices]
    assert len(choices) == 50
    for c in choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert list(json.loads(c.message.content)) == list(SCHEMA["properties"])  # the schema's order, as OpenAI
    assert len({c.message.content for c in choices}) > 5  # sampled, not one answer
    print(f"50 json_schema answers in {took:.1f}s")


def test_json_object_on_completions_and_streamed_chat(client):
    r = client.completions.create(model="m", prompt="Data:", max_tokens=120, seed=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    chunks = list(client.chat.completions.create(model="m", messages=USER, max_tokens=60, seed=5, stream=True,
                                                 response_format={"type": "json_schema", "json_schema": {
                                                     "name": "x", "schema": SCHEMA}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_parse_and_validate(client, choice):
    names = ["get_time"] if isinstance(choice, dict) else None
    for seed in range(4):
        r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice, seed=seed,
                                           parallel_tool_calls=False, max_tokens=60)
        (c,) = r.choices
        assert c.finish_reason == "tool_calls" and c.message.content is None
        check_calls(c.message.tool_calls, names)
        assert len(c.message.tool_calls) == 1


@pytest.mark.parametrize("choice,content", [
    ("required", None), ({"type": "function", "function": {"name": "get_time"}}, None), ("auto", ""), (None, ""),
], ids=["required", "named", "auto", "no-tools"])
def test_the_first_delta_of_a_forced_call_has_null_content(server, choice, content):
    """As OpenAI: a stream whose answer is the calls starts with {"role": "assistant", "content":
    null}; one that may answer in text with content ""."""
    tools = {"tools": TOOLS, "tool_choice": choice} if choice is not None else {}
    body = {"model": "m", "messages": USER, "max_tokens": 40, "seed": 1, "stream": True, **tools}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": content}, first


def streamed_calls(chunks):
    """The tool calls assembled from delta.tool_calls chunks (as an SDK user does)."""
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] = (d.function.name if d.function else None) or c["name"]
            c["arguments"] += (d.function.arguments if d.function else "") or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_round_trip(client, stream):
    kw = {"model": "m", "tools": TOOLS, "seed": 7, "max_tokens": 60, "parallel_tool_calls": False}
    if stream:
        chunks = list(client.chat.completions.create(messages=USER, tool_choice="required", stream=True, **kw))
        calls = streamed_calls(chunks)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["tool_calls"]
        for c in calls:
            assert c["id"].startswith("call_")
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
        call = {"id": calls[0]["id"], "type": "function",
                "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}
    else:
        first = client.chat.completions.create(messages=USER, tool_choice="required", **kw)
        check_calls(first.choices[0].message.tool_calls)
        call = first.choices[0].message.tool_calls[0].model_dump()
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]
    answer = client.chat.completions.create(messages=history, tool_choice="none", **kw)
    (c,) = answer.choices
    assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)
    # the history is in the prompt, in the documented format
    args = json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False, separators=(", ", ": "))
    expected = (f"User: What is the weather in Paris?\n\nAssistant: <tool_call>[{{\"name\": "
                f"\"{call['function']['name']}\", \"arguments\": {args}}}]\n\nTool: "
                '{"name": "' + call["function"]["name"] + '", "content": "Sunny, 21 C"}\n\nAssistant:')
    # tokenized with a boundary after the marker, where the model's call began (start.encode_chat);
    # with tool_choice "none" the tools are still described, in the system turn before it all
    from server.api.openai.tools import plan

    head, call_list = expected.split("<tool_call>")
    tok = get_tokenizer()
    system = f"System: {plan(TOOLS, 'auto', None).system_text()}\n\n"  # (one text for every choice)
    n_rest = len(tok.encode(head + "<tool_call>")) + len(tok.encode(call_list))
    assert answer.usage.prompt_tokens == len(tok.encode(system)) + n_rest


def test_the_history_writes_a_reply_as_the_model_wrote_it_and_a_named_choice_hides_no_tool():
    """A reply with text and a call, sent back as its message (content and tool_calls), renders
    as the model wrote it (one space before the marker, the JSON in the grammar's spacing), so the
    conversation cache can keep its state. A named tool_choice restricts the grammar, not the
    tools the system turn describes (the model sees them all; the cached prefix is the same)."""
    from server.api.openai.tools import plan, resent_text, split

    wrote = 'Let me check. <tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    content, calls = split(" " + wrote, "auto")
    assert content == " Let me check. " and calls[0]["function"]["name"] == "get_time"
    assert resent_text(" " + wrote, "auto") == wrote
    named = plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.system_text() == plan(TOOLS, "required", None).system_text()
    assert [t.name for t in named.tools] == ["get_time"] and named.forced and not named.parallel
    assert '"get_weather"' not in named.grammar().source and '"get_time"' in named.grammar().source


def test_allowed_tools_restrict_the_grammar_not_the_system_turn(client):
    """tool_choice allowed_tools (chat's shape: under "allowed_tools"): required, the reply is a
    call of the listed tools only; the system turn describes every tool (the cached prefix is the
    same whichever a turn allows); auto lets the reply be text too."""
    from server.api.openai.tools import plan

    allow = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    p = plan(TOOLS, allow, None)
    assert [t.name for t in p.tools] == ["get_time"] and p.forced and p.parallel
    assert p.system_text() == plan(TOOLS, "required", None).system_text()
    assert '"get_weather"' not in p.grammar().source and '"get_time"' in p.grammar().source
    auto = plan(TOOLS, {**allow, "allowed_tools": {**allow["allowed_tools"], "mode": "auto"}}, False)
    assert not auto.forced and not auto.parallel and [t.name for t in auto.tools] == ["get_time"]
    for seed in range(3):
        r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=allow, seed=seed,
                                           parallel_tool_calls=False, max_tokens=60)
        assert r.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    check_calls(r.choices[0].message.tool_calls)


def test_auto_tool_choice_answers(client):
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, seed=1, max_tokens=40)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        check_calls(c.message.tool_calls)
    else:
        assert c.message.tool_calls is None and isinstance(c.message.content, str)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
    loaded = sys.modules.get("rwkv.model")
    mod = importlib.reload(loaded) if loaded is not None else importlib.import_module("rwkv.model")
    return mod.RWKV_x070(checkpoint[: -len(".pth")], "cpu fp32")


def ref_logprobs(oracle, tokens: list[int]) -> torch.Tensor:
    """Row j: log_softmax of the reference logits after tokens[: j + 1]."""
    out, state = [], None
    for t in tokens:
        logits, state = oracle.forward([t], state)
        out.append(torch.log_softmax(logits.float(), -1))
    return torch.stack(out)


def test_logprobs_equal_log_softmax_of_the_reference_logits(client, oracle):
    tok = get_tokenizer()
    ids_of = {b: i for i, b in enumerate(tok.token_table) if b}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
                                       seed=3, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    ids = [ids_of[bytes(e.bytes)] for e in content]
    prompt = tok.encode("User: Hello\n\nAssistant:")
    ref = ref_logprobs(oracle, prompt + ids)
    for i, e in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert abs(e.logprob - row[ids[i]].item()) < TOL
        assert len(e.top_logprobs) == 3
        for alt, want in zip(e.top_logprobs, row.topk(3).values.tolist()):
            assert abs(alt.logprob - want) < TOL
    # completions: echo scores the prompt (its first token has none), then the generated tokens
    p = [5, 300, 65000, 17, 9, 1234]
    c = client.completions.create(model="m", prompt=p, max_tokens=3, seed=1, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True}).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(p) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    gen = [ids_of.get(s.encode("utf-8"), -1) for s in lp.tokens[len(p):]]  # a token that is part of a
    ref = ref_logprobs(oracle, p + [max(g, 0) for g in gen])  # character shows as U+FFFD: skipped
    for j in range(1, len(p)):
        assert abs(lp.token_logprobs[j] - ref[j - 1][p[j]].item()) < TOL
        assert len(lp.top_logprobs[j]) <= 3 and lp.top_logprobs[j][lp.tokens[j]] == lp.token_logprobs[j]  # N + 1
    for i, g in enumerate(gen[: next((k for k, x in enumerate(gen) if x < 0), len(gen))]):
        assert abs(lp.token_logprobs[len(p) + i] - ref[len(p) - 1 + i][g].item()) < TOL
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_from_a_template_scores_the_prompt_s_first_token_too(server, client, oracle):
    """With `state`, the prompt's first token follows the template's pending token: it has a
    logprob (QA: null, as if it were the first token fed)."""
    head, p = [5, 300, 65000, 17], [9, 1234, 77]
    t = httpx.post(server.url + "/v1/tasks/create", json={"prompt": head, "max_tokens": 0}, timeout=30).json()
    for _ in range(200):
        if httpx.get(server.url + f"/v1/tasks/{t['task_id']}/get_result").json()["finished"]:
            break
        time.sleep(0.05)
    r = httpx.post(server.url + f"/v1/tasks/{t['task_id']}/as_template", params={"name": "lp_head"}, json={})
    assert r.status_code == 200, r.text
    lp = client.completions.create(model="m", prompt=p, max_tokens=1, logprobs=1, echo=True,
                                   extra_body={"state": "lp_head", "ignore_eos": True}).choices[0].logprobs
    ref = ref_logprobs(oracle, head + p)
    assert [x is not None for x in lp.token_logprobs[: len(p)]] == [True] * len(p), lp.token_logprobs
    for j, tok in enumerate(p):
        assert abs(lp.token_logprobs[j] - ref[len(head) - 1 + j][tok].item()) < TOL


def test_streamed_logprobs_cover_every_token(client):
    chunks = list(client.chat.completions.create(model="m", messages=USER, max_tokens=8, seed=2, stream=True,
                                                 logprobs=True, top_logprobs=1, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert all(len(e.top_logprobs) == 1 for e in entries)


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
    "a": {"$ref": "#"}}}}}
DEEP = {"type": "object"}
for _ in range(40):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


def tool(name, params=None):
    return {"type": "function", "function": {"name": name, "parameters": params or {"type": "object"}}}


@pytest.mark.parametrize("body,param", [
    ({"response_format": BAD_SCHEMA}, "response_format"),  # recursive
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [tool(f"f{i}") for i in range(129)]}, "tools"),
    ({"tools": [tool("f"), tool("f")]}, "tools"),
    ({"tools": [tool("f", {"type": "object", "properties": {"x": {"type": "nonsense"}}})]}, "tools"),
    ({"tools": [tool("f", {"type": "string"})]}, "tools[0].function.parameters"),  # arguments are an object
    ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [tool("f")], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "g"}}]}}}, "tool_choice.allowed_tools.tools[0]"),
    ({"tools": [tool("f")], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}}}, "tool_choice.allowed_tools.mode"),
    ({"tools": [tool("f")], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": {"a": 1}}}]}}},
     "tool_choice.allowed_tools.tools[0]"),  # (was a 500)
    ({"tools": [tool("f")], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "bogus": 1, "tools": [{"type": "function", "function": {"name": "f"}}]}}}, "tool_choice"),
    ({"tools": [tool("f")], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                            "tools": [{"type": "function", "name": "f"}]}}, "tool_choice"),  # (its flat shape)
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_x", "content": "r"}]}, "messages[1].tool_call_id"),
    ({"tools": [tool("f")], "messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "custom", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0]"),  # only function calls
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    # a tool's fields are OpenAI's (unknown ones and wrong types were taken and ignored)
    ({"tools": [{**tool("f"), "cache_control": {"type": "ephemeral"}}]}, "tools[0].cache_control"),
    ({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools[0].function.examples"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_agent_input_is_a_400_and_starts_nothing(server, body, param):
    before = prompt_tokens_total(server)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert prompt_tokens_total(server) == before


def test_bad_logprobs_on_completions(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="m", prompt="x", max_tokens=1, logprobs=6)
    assert ei.value.body["param"] == "logprobs"


def test_task_routes_take_response_format(server):
    http = httpx.Client(base_url=server.url, timeout=60)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    r = http.post("/v1/tasks/tmp", json={"prompt": "Data:", "max_tokens": 60, "seed": 1, "response_format": fmt})
    assert r.status_code == 200, r.text
    res = task_result(http, r.json()["task_id"], timeout=30)
    assert res["finish_reason"] == "stop", res
    jsonschema.validate(json.loads(res["result"]), SCHEMA)
    listed = http.get("/v1/tasks/list").json()
    r = http.post("/v1/tasks/create", json={"prompt": "x", "response_format": BAD_SCHEMA})
    assert r.status_code == 422 and r.json()["error"]["param"] == "response_format", r.text
    assert http.get("/v1/tasks/list").json() == listed  # nothing created


def _two_tools_with_nested_models():
    """Two pydantic tools whose nested models share a $defs name ("Addr") with different
    definitions: pydantic writes each nested model under "$defs" and refers to it by "#/$defs/Addr"."""
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Addr(BaseModel):
        city: Literal["Paris", "Rome"]
        zip: int = Field(ge=0, le=99)

    class Ship(BaseModel):
        to: Addr
        back: Optional[Addr]  # noqa: UP045 (Python 3.9's spelling of the SDK's examples)

    class Addr(BaseModel):  # type: ignore[no-redef]  # another model of the same name
        street: Literal["Main", "High"]

    class Mail(BaseModel):
        to: Addr

    return Ship, Mail


def test_pydantic_tools_with_nested_models_call_on_chat_and_responses(client):
    """openai.pydantic_function_tool (and the Agents SDK's tools with model arguments) put nested
    models in $defs: each tool's references are rebased, so every call parses into its model."""
    ship, mail = _two_tools_with_nested_models()
    tools = [openai.pydantic_function_tool(ship), openai.pydantic_function_tool(mail)]
    assert "$defs" in tools[0]["function"]["parameters"] and "$defs" in tools[1]["function"]["parameters"]
    for model in (ship, mail):
        choice = {"type": "function", "function": {"name": model.__name__}}
        msg = client.chat.completions.parse(model="m", messages=USER, tools=tools, tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=120).choices[0].message
        (call,) = msg.tool_calls
        assert isinstance(call.function.parsed_arguments, model), call
        flat = [{"type": "function", **t["function"]} for t in tools]
        r = client.responses.create(model="m", input="Send it.", tools=flat, parallel_tool_calls=False,
                                    tool_choice={"type": "function", "name": model.__name__}, max_output_tokens=120)
        (fc,) = [item for item in r.output if item.type == "function_call"]
        assert fc.name == model.__name__ and isinstance(model.model_validate_json(fc.arguments), model)


def test_a_tool_with_null_parameters_takes_an_object_on_both_routes(server):
    """`parameters: null` is a tool without parameters on chat as on /v1/responses (chat refused
    it); its arguments are still an object (a schema without a type let them be any JSON)."""
    for path, tool_, choice in (
        ("/v1/chat/completions", {"type": "function", "function": {"name": "ping", "parameters": None}},
         {"type": "function", "function": {"name": "ping"}}),
        ("/v1/responses", {"type": "function", "name": "ping", "parameters": None}, {"type": "function", "name": "ping"}),
    ):
        body = {"tools": [tool_], "tool_choice": choice, "parallel_tool_calls": False, "seed": 3}
        body |= {"messages": USER, "max_tokens": 40} if path.startswith("/v1/chat") else {"input": "x",
                                                                                          "max_output_tokens": 40}
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        args = (out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] if "choices" in out
                else next(i for i in out["output"] if i["type"] == "function_call")["arguments"])
        assert isinstance(json.loads(args), dict), args
    loose = {"type": "function", "function": {"name": "any", "parameters": {}}}  # no type: still an object
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "tools": [loose], "tool_choice": "required",
                                                              "parallel_tool_calls": False, "max_tokens": 40, "seed": 5})
    assert r.status_code == 200 and isinstance(json.loads(
        r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]), dict), r.text


def test_a_message_always_has_its_refusal_field(server):
    """OpenAI's schema requires `refusal` in every chat message (null: no refusal); clients
    generated from that schema refuse an answer without it. Plain and agent answers both."""
    plain = {"messages": USER, "max_tokens": 2}
    forced = {**plain, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40}
    for body in (plain, {**plain, "logprobs": True}, forced):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["refusal"] is None, r.text


def test_the_sdk_helpers_messages_go_back_as_history(client):
    """`messages.append(completion.choices[0].message)` with the message of the SDK's `parse()`
    or `stream()` helper: the SDK sends it back as it is, with its own fields (`parsed`,
    `annotations`, a call's `index` and `function.parsed_arguments`); they were unknown fields
    (a 400), as OpenAI's API takes them."""
    from typing import Literal

    from pydantic import BaseModel

    class Answer(BaseModel):
        ok: bool

    class GetTime(BaseModel):
        zone: Literal["UTC", "CET"]

    parsed = client.chat.completions.parse(model="m", messages=USER, response_format=Answer, max_tokens=30, seed=1)
    msg = parsed.choices[0].message
    assert msg.parsed is not None
    history = [*USER, msg, {"role": "user", "content": "And tomorrow?"}]
    again = client.chat.completions.create(model="m", messages=history, max_tokens=2)
    assert again.choices[0].message.content is not None

    tool = openai.pydantic_function_tool(GetTime)
    with client.chat.completions.stream(model="m", messages=USER, tools=[tool], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=40, seed=1) as stream:
        for _ in stream:
            pass
        msg = stream.get_final_completion().choices[0].message
    (call,) = msg.tool_calls
    assert call.function.parsed_arguments is not None and call.index == 0
    history = [*USER, msg, {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = client.chat.completions.create(model="m", messages=history, tools=[tool], max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
