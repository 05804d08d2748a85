"""A call's arguments are the JSON text the model wrote (server.api.openai.tools.parse_calls), on
chat and on /v1/responses: decoded and encoded again, a number past a double's range came back as
`Infinity` (not JSON), long numbers lost digits, and an escaped half of a surrogate pair made the
answer a 500 (and the stored response unreadable). A real server, the random tiny model with
seeds that make it write such values (the grammar allows them)."""

from __future__ import annotations

import json

import httpx
import pytest
from util_server import server_fixture

from server.api.openai import tools

server = server_fixture()
NUMBER = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"], "additionalProperties": False}
SURROGATE = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^\\\\u[dD][89abAB][0-9a-fA-F]{2}$"}},
             "required": ["s"], "additionalProperties": False}  # fmt: skip


def strict(text: str):
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def respond_body(params: dict, **extra) -> dict:
    tools = [{"type": "function", "name": "f", "parameters": params}]
    return {"model": "m", "input": "x", "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "seed": 0, **extra}  # fmt: skip


def respond(c: httpx.Client, params: dict, **extra) -> httpx.Response:
    return c.post("/v1/responses", json=respond_body(params, **extra))


def chat(c: httpx.Client, params: dict, **extra) -> httpx.Response:
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    return c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                "tools": tools, "tool_choice": "required",
                                                "parallel_tool_calls": False, "seed": 0, **extra})  # fmt: skip


def written(c: httpx.Client, rid: str) -> str:
    """The arguments' text in what the model wrote (the response's task's raw output)."""
    raw = c.get(f"/v1/tasks/TASK_{rid[5:]}/get_result").json()["result"]
    return raw[raw.index('"arguments": ') + len('"arguments": ') : raw.rindex("}]")]


@pytest.mark.parametrize("seed", range(6))
def test_numbers_are_the_models_text(server, seed):
    sampling = {"temperature": 1.5, "top_p": 1.0, "seed": seed}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = respond(c, NUMBER, max_output_tokens=80, **sampling).json()
        calls = [o for o in r["output"] if o["type"] == "function_call"]
        if r["status"] == "completed":
            assert calls and calls[0]["arguments"] == written(c, r["id"])
            strict(calls[0]["arguments"])
        ch = chat(c, NUMBER, max_tokens=80, **sampling).json()["choices"][0]
        if ch["finish_reason"] == "tool_calls":
            strict(ch["message"]["tool_calls"][0]["function"]["arguments"])


def test_an_escaped_lone_surrogate_keeps_its_text():
    """The JSON grammar lets the model write an escaped half of a surrogate pair (any \\uXXXX) in
    a string: the call's arguments are that text as written, storable as UTF-8 (decoded and
    encoded again it was a string no JSON encoder writes: a 500 and an unreadable stored
    response)."""
    for mode, text in (("forced", '[{"name": "f", "arguments": {"s": "\\ud800"}}]'),
                       ("formatted", ' <tool_call>[{"name": "f", "arguments": {"s": "a\\uDC00"}}]')):  # fmt: skip
        head, calls = tools.parse_calls(text, mode)
        assert head == "" and calls is not None and len(calls) == 1, (mode, calls)
        name, args = calls[0]
        assert name == "f" and args == text[text.index('{"s"') : text.rindex("}]")], (mode, args)
        assert args.encode("utf-8").decode("utf-8") == args and "\\u" in args


def test_a_pattern_written_as_json_text_is_refused(server):
    """A pattern that writes a backslash itself (this file once made the model write an escaped
    surrogate with one: the decoder matched the pattern against the JSON text) is a 400 naming
    where, on both routes; nothing runs."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for r in (respond(c, SURROGATE, max_output_tokens=40), chat(c, SURROGATE, max_tokens=40)):
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_schema" and "the pattern writes" in err["message"], err
        assert c.get("/health").json()["running"] == 0


def test_history_arguments_must_be_json(server):
    """Sent back, arguments holding NaN or Infinity (not JSON) are a 400 naming them."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for bad in ('{"x": NaN}', '{"x": Infinity}'):
            call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": bad}}
            msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "1"}]  # fmt: skip
            tools = [{"type": "function", "function": {"name": "f", "parameters": NUMBER}}]
            r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": tools, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"].endswith("function.arguments"), r.text
