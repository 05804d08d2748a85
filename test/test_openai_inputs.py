"""Input checks of the OpenAI routes (real server, the openai SDK): how deep a response_format
schema may nest, a refused request leaves the waiting queue as it was, and bad values are
clear 400s in the OpenAI error shape."""

from __future__ import annotations

import contextlib
import threading

import httpx
import openai
import pytest
from openai import OpenAI
from util_server import inprocess_server, sdk, server_fixture

from server.api.errors import ApiError
from server.api.generation.jobs import submit_all
from server.api.metrics import parse_metrics
from server.api.openai.tools import MARKER, split
from server.engine.types import EngineStats, SamplingParams
from server.tasks.params import sampling_params
from server.tasks.response_format import MAX_JSON_DEPTH, MAX_SCHEMA_DEPTH

server = server_fixture()
USER = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return sdk(server)


def _object(levels: int) -> dict:
    """An object schema `levels` schema levels deep (the innermost is a string)."""
    s: dict = {"type": "string"}
    for _ in range(levels - 1):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"], "additionalProperties": False}
    return s


def _array(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels - 1):
        s = {"type": "array", "items": s, "maxItems": 1}
    return s


def _any_of(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels - 1):
        s = {"anyOf": [{"type": "null"}, s]}
    return s


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


@pytest.mark.parametrize("build", [_object, _array, _any_of])
def test_schema_depth_counts_schema_levels(client, build):
    """32 schema levels are accepted (an object level is one level, not two: the `properties`
    map is not a level), 33 are a 400 naming response_format."""
    for levels in (16, MAX_SCHEMA_DEPTH):
        r = client.chat.completions.create(
            model="any", messages=USER, max_tokens=2, response_format=_schema_format(build(levels))
        )
        assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="any", messages=USER, max_tokens=2, response_format=_schema_format(build(MAX_SCHEMA_DEPTH + 1))
        )
    err = e.value.body
    assert err["param"] == "response_format" and err["code"] == "invalid_request"
    assert f"nests deeper than {MAX_SCHEMA_DEPTH} levels" in err["message"]


def test_schema_json_depth_backstop(client):
    """Data nested deeper than MAX_JSON_DEPTH (not schema levels: a const) is refused before
    the recursive code after the check sees it; just within it passes."""
    value: object = 1
    for _ in range(MAX_JSON_DEPTH - 1):  # the schema object is level 1, these lists 2..MAX_JSON_DEPTH
        value = [value]
    ok = client.completions.create(
        model="any", prompt="x", max_tokens=1, extra_body={"response_format": _schema_format({"const": value})}
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="any", prompt="x", max_tokens=1, extra_body={"response_format": _schema_format({"const": [value]})}
        )
    assert f"JSON nests deeper than {MAX_JSON_DEPTH} levels" in e.value.body["message"]


def test_a_stored_schema_at_the_json_depth_limit(client):
    """A response (a task: its schema is stored in its parameters) with a schema nesting
    MAX_JSON_DEPTH levels is stored and answers (orjson writes at most 255 levels, the task's
    parameters around the schema included: the limit is below it)."""
    value: object = 1
    for _ in range(MAX_JSON_DEPTH - 1):
        value = [value]
    fmt = {"type": "json_schema", "name": "deep", "schema": {"const": value}}
    r = client.responses.create(model="any", input="x", max_output_tokens=1, text={"format": fmt})
    assert r.status in ("completed", "incomplete") and client.responses.retrieve(r.id).id == r.id


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    """A real uvicorn server in this process (so a test can hold its engine's loop): 8 waiting
    at most."""
    from server.config import Settings

    db = tmp_path_factory.mktemp("inputs") / "tasks.db"
    settings = Settings(device="cpu", db=str(db), stats_interval=0, max_batch=4, max_queue=8)
    with inprocess_server(settings) as (url, app):
        yield url, app.state.services.engine


@contextlib.contextmanager
def held(engine):
    """The engine's loop takes no step while the block runs: what is submitted or aborted stays
    in its inbox (as it does between two steps of a slow model, where the bug showed)."""
    go, run_once = threading.Event(), engine.run_once

    def wait_then_run():
        go.wait()
        return run_once()

    engine.run_once = wait_then_run
    try:
        yield
    finally:
        del engine.run_once  # the class's method again
        go.set()


def test_refused_batch_leaves_the_queue_as_it_was(inproc):
    """4 slots, 8 waiting at most. A: n=6 takes the slots and 2 places. B: n=7 does not fit (6
    places left): 429, and nothing of it stays queued, so a request of 6 is taken at once; the
    bound still holds after it."""
    url, engine = inproc
    sdk = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = {"model": "any", "messages": USER, "max_tokens": 4, "stream": True}
    with held(engine):
        a = sdk.chat.completions.create(n=6, **kw)
        with pytest.raises(openai.RateLimitError) as e:
            sdk.chat.completions.create(n=7, **kw)
        assert e.value.body["code"] == "queue_full" and e.value.response.headers["retry-after"] == "1"
        health = httpx.get(url + "/health").json()
        assert (health["running"], health["waiting"]) == (4, 2)  # not 9 waiting: B left nothing behind
        fits = sdk.chat.completions.create(n=6, **kw)
        with pytest.raises(openai.RateLimitError):
            sdk.completions.create(model="any", prompt="x", max_tokens=1)
    for stream in (a, fits):
        assert all(c.choices for c in stream)  # both run to their end once the loop goes on
        stream.close()


class _FullEngine:
    """An engine stand-in whose queue has `room` places left; it must never be submitted to."""

    def __init__(self, waiting: int, engines_alive: int) -> None:
        self.st = EngineStats(waiting=waiting, engines_alive=engines_alive)
        self.submitted = 0

    def stats(self) -> EngineStats:
        return self.st

    def submit(self, *a, **kw):
        self.submitted += 1
        raise AssertionError("submitted")


def test_submit_all_checks_room_before_submitting():
    """The room is max_queue per live engine (a router sums the engines' waiting)."""
    prompt = ([1], None, 1)
    eng = _FullEngine(waiting=13, engines_alive=2)  # 2 x 8 - 13 = 3 places
    with pytest.raises(ApiError) as e:
        submit_all(eng, [prompt] * 4, [SamplingParams()] * 4, "t", max_queue=8)  # type: ignore[arg-type]
    assert e.value.status == 429 and eng.submitted == 0


def test_completions_empty_prompt_has_a_code(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt="", max_tokens=1)
    err = e.value.body
    assert err["param"] == "prompt" and err["code"] == "invalid_request" and "empty" in err["message"]


@pytest.mark.parametrize(("path", "status"), [("/v1/completions", 400), ("/v1/tasks/create", 422)])
def test_a_null_where_a_value_is_needed_says_null(server, path, status):
    """`{"prompt": null}` names the null, not only the type pydantic wanted ("a valid string")."""
    r = httpx.post(server.url + path, json={"prompt": None, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == "prompt", r.text
    assert "null is not allowed" in err["message"] and "valid string" in err["message"], err


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_temperature(server, value):
    """Python's JSON parser reads NaN: it is not a number in the bounds, it is not finite."""
    body = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "temperature": %s}' % value.encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "temperature" and err["code"] == "invalid_request"
    assert "finite number" in err["message"] and "less than" not in err["message"]


def test_tool_message_without_tool_call_id(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "1"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=messages, max_tokens=1)
    err = e.value.body
    assert err["param"] == "messages[2].tool_call_id" and err["code"] == "invalid_request"
    assert "is required" in err["message"] and "None" not in err["message"]


@pytest.mark.parametrize(
    ("fmt", "field"),
    [
        ({"type": "json_object", "extra": 1}, "'extra'"),
        ({"type": "text", "schema": {}}, "'schema'"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}, "'json_schema.extra'"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}, "schema": {}}, "'schema'"),
    ],
)
def test_response_format_unknown_keys(client, server, fmt, field):
    """A key outside OpenAI's shape is refused naming it, on chat, completions and the task routes."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=USER, max_tokens=1, response_format=fmt)
    err = e.value.body
    assert err["param"] == "response_format" and field in err["message"] and "unknown field" in err["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="any", prompt="x", max_tokens=1, extra_body={"response_format": fmt})
    r = httpx.post(server.url + "/v1/tasks/tmp", json={"prompt": "x", "max_tokens": 1, "response_format": fmt})
    assert r.status_code == 422 and field in r.json()["error"]["message"]


def test_response_format_known_shapes_and_stored_formats():
    """The flat form (the Responses API's) stays accepted; a format stored before the key check
    (a task's parameters) still runs."""
    flat = {"type": "json_schema", "name": "x", "strict": True, "description": "d", "schema": {"type": "string"}}
    assert sampling_params({"response_format": flat}, 8).grammar is not None
    stored = sampling_params({"response_format": {"type": "json_object", "extra": 1}}, 8)
    assert stored.grammar is not None and stored.grammar.kind == "json_object"


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_count_characters_not_token_texts(client, stream):
    # a character of several tokens (each shown as U+FFFD) used to advance the non-streamed
    # offsets by one per token: " is" after "月亮 🌙" was at 6, not 4
    prompt = "月亮 🌙 is"
    kw = dict(model="m", prompt=prompt, max_tokens=6, seed=3, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    if stream:
        parts = list(client.completions.create(**kw, stream=True))
        text = "".join(p.choices[0].text for p in parts)
        tokens = [t for p in parts for t in p.choices[0].logprobs.tokens]
        offsets = [o for p in parts for o in p.choices[0].logprobs.text_offset]
    else:
        c = client.completions.create(**kw).choices[0]
        text, tokens, offsets = c.text, c.logprobs.tokens, c.logprobs.text_offset
    assert text.startswith(prompt) and offsets == sorted(offsets) and offsets[-1] <= len(text)
    whole = [(t, o) for t, o in zip(tokens, offsets) if "\ufffd" not in t]
    assert any(t == " is" for t, _ in whole)
    for t, o in whole:  # a token that is whole characters stands at its offset in the text
        assert text[o:o + len(t)] == t, (t, o, text)


def _completion_logprobs(client, stream: bool, **kw) -> tuple[str, list[str], list[int], list, list]:
    """text, tokens, text_offset, token_logprobs, top_logprobs of one completion (streamed: joined)."""
    if stream:
        parts = list(client.completions.create(**kw, stream=True))
        lps = [p.choices[0].logprobs for p in parts if p.choices and p.choices[0].logprobs]
        text = "".join(p.choices[0].text for p in parts if p.choices)
    else:
        c = client.completions.create(**kw).choices[0]
        lps, text = [c.logprobs], c.text
    return (text, [t for lp in lps for t in lp.tokens], [o for lp in lps for o in lp.text_offset],
            [x for lp in lps for x in lp.token_logprobs], [x for lp in lps for x in lp.top_logprobs])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kw", [
    # token 200 is the lone byte 0xC7: " A" after it stood on its U+FFFD (offset 1, not 2)
    dict(prompt=[100, 200, 300, 400], max_tokens=2, logprobs=1, echo=True),
    # the synthetic model writes a lone lead byte, then a token that does not go on with it
    dict(prompt="Once upon a time", max_tokens=8, seed=3, logprobs=0),
], ids=["echoed-ids", "generated"])
def test_a_token_after_a_broken_character_stands_after_its_replacement(client, stream, kw):
    text, tokens, offsets, _, _ = _completion_logprobs(client, stream, model="m", **kw)
    assert any("\ufffd" in t for t in tokens)  # (the case this test is about)
    for t, o in zip(tokens, offsets):
        if "\ufffd" not in t:
            assert text[o:o + len(t)] == t, (t, o, text, offsets)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [0, 3])
def test_completion_top_logprobs_hold_the_chosen_token(client, stream, n):
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up
    to logprobs+1 elements" (it was missing in most positions, and logprobs 0 gave {})."""
    _, tokens, _, chosen, tops = _completion_logprobs(client, stream, model="m", prompt="Once upon a time",
                                                      max_tokens=8, seed=5, logprobs=n, temperature=1.0)
    assert len(tokens) == 8
    for t, lp, top in zip(tokens, chosen, tops):
        assert top[t] == lp and n <= len(top) <= n + 1, (t, lp, top)


def test_a_flat_token_id_prompt_is_one_prompt_whatever_its_length(client):
    # "at most 64 prompts" counted the ids of a flat list, so echo scoring of any context over
    # 64 tokens failed for clients that send one
    c = client.completions.create(model="m", prompt=[65] * 300, max_tokens=1, echo=True, logprobs=0)
    assert len(c.choices) == 1 and len(c.choices[0].logprobs.tokens) == 301
    with pytest.raises(openai.BadRequestError, match="64 prompts"):
        client.completions.create(model="m", prompt=[[65]] * 65, max_tokens=1)


def test_echo_with_suffix_is_refused_as_openai_does(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="def f(", suffix=")\n", echo=True, max_tokens=2)
    assert e.value.body["param"] == "echo"


def prompt_tokens_total(server) -> float:
    return parse_metrics(httpx.get(server.url + "/metrics").text)["rwkv_prompt_tokens_total"]


def _nested(depth: int, kind: str) -> str:
    """JSON text of lists (or objects) nesting `depth` levels."""
    return "[" * depth + "1" + "]" * depth if kind == "list" else '{"a": ' * depth + "1" + "}" * depth


def _call_history(arguments: str) -> list:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*USER, {"role": "assistant", "tool_calls": [call]}]


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1500])
def test_deeply_nested_history_arguments_are_a_400(server, depth, kind):
    """A history call's arguments nesting deeper than MAX_JSON_DEPTH: a 400 naming them (the
    parser's RecursionError was a 500), and nothing runs."""
    before = prompt_tokens_total(server)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": _call_history(_nested(depth, kind)), "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls[0].function.arguments" and err["code"] == "invalid_request"
    assert str(MAX_JSON_DEPTH) in err["message"] and err["type"] == "invalid_request_error"
    assert prompt_tokens_total(server) == before


@pytest.mark.parametrize("raw", ["not json", "{\"a\": NaN}", "{\"a\": 1"])
def test_history_arguments_that_are_not_json_say_so(server, raw):
    """Not JSON (the message said they nested too deep): a 400 naming them, nothing runs."""
    before = prompt_tokens_total(server)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": raw}}
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [*USER, {"role": "assistant", "tool_calls": [call]}], "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls[0].function.arguments"
    assert "is not JSON text" in err["message"] and "nest" not in err["message"], err
    assert prompt_tokens_total(server) == before


def test_history_arguments_at_the_depth_bound_are_accepted(client):
    answered = [*_call_history(_nested(MAX_JSON_DEPTH, "list")), {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    r = client.chat.completions.create(model="m", messages=answered, max_tokens=1)
    assert r.usage.prompt_tokens > MAX_JSON_DEPTH


def test_a_deeply_nested_call_in_the_models_output_is_no_call():
    """The grammar bounds a call list's shape, not its depth: such an output is text, no crash."""
    text = MARKER + '[{"name": "f", "arguments": ' + _nested(5000, "list") + "}]"
    assert split(text, "auto") == (text, None)


@pytest.mark.parametrize("prompt", [[510, 285, 9], [[510, 285], [9]]])
def test_suffix_with_token_id_prompts_is_refused(server, prompt):
    """FIM wraps a text prompt: with token ids the suffix was silently ignored."""
    before = prompt_tokens_total(server)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "suffix": "end", "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "suffix" and err["code"] == "unsupported_field" and "token id" in err["message"]
    assert prompt_tokens_total(server) == before


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
@pytest.mark.parametrize("content", ["missing", None])
def test_a_message_without_content_is_a_400(server, role, content):
    """As OpenAI: only an assistant message's content may be missing or null."""
    msg = {"role": role, **({} if content == "missing" else {"content": content})}
    if role == "tool":
        msg["tool_call_id"] = "c1"
    before = prompt_tokens_total(server)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [*USER, msg], "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].content" and err["code"] == "invalid_request"
    assert f"a {role} message needs its content" in err["message"]
    assert prompt_tokens_total(server) == before


def test_a_text_part_without_text_says_so(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [{"type": "text"}]}],
                                       max_tokens=1)
    err = e.value.body
    assert err["param"] == "messages[0].content" and "needs its 'text'" in err["message"]
    assert "not supported" not in err["message"]


def test_an_assistant_refusal_part_is_left_out_as_its_refusal_field_is(client):
    """OpenAI's assistant content may hold {"type": "refusal"} parts (an SDK's earlier answer sent
    back): left out of the prompt, as the message's `refusal` field is (QA: a 400); a user's
    refusal part is no part OpenAI has: still refused."""
    def ask(parts, role="assistant"):
        msgs = [{"role": "user", "content": "a"}, {"role": role, "content": parts}, {"role": "user", "content": "b"}]
        return client.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0, seed=1)

    with_refusal = ask([{"type": "text", "text": "ok"}, {"type": "refusal", "refusal": "no"}])
    assert with_refusal.usage.prompt_tokens == ask([{"type": "text", "text": "ok"}]).usage.prompt_tokens
    assert ask([{"type": "refusal", "refusal": "no"}]).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="refusal"):
        ask([{"type": "refusal", "refusal": "no"}], role="user")


def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]}


def _result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "r"}


@pytest.mark.parametrize("messages,param,ids", [
    ([*USER, _calls("c1", "c2"), _result("c1"), *USER], "messages[3].role", "c2"),  # one of two answered
    ([*USER, _calls("c1", "c2"), *USER], "messages[2].role", "c1, c2"),
    ([*USER, _calls("c1", "c2"), _result("c2")], "messages", "c1"),  # the last message
    ([*USER, _calls("c1")], "messages", "c1"),
    ([*USER, _calls("c1"), _result("c1"), _calls("c2"), _calls("c3"), _result("c3")], "messages[4].role", "c2"),
])  # fmt: skip
def test_every_tool_call_is_answered_by_the_tool_messages_after_it(server, messages, param, ids):
    """As OpenAI: the tool messages right after an assistant message with tool_calls answer each
    of its calls; otherwise a 400 in OpenAI's words, and nothing runs."""
    before = prompt_tokens_total(server)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {ids}",
        "type": "invalid_request_error", "param": param, "code": "invalid_request"}  # fmt: skip
    assert prompt_tokens_total(server) == before


def test_two_calls_of_one_message_may_not_share_an_id(server):
    """Their tool message could not say which it answers (QA: accepted, the second call's name
    shown for both)."""
    before = prompt_tokens_total(server)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [*USER, _calls("a", "a"), _result("a")], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[1].id", r.text
    assert "two calls of this message have the id 'a'" in r.json()["error"]["message"]
    assert prompt_tokens_total(server) == before


def test_tool_messages_may_answer_calls_in_any_order(client):
    messages = [*USER, _calls("c1", "c2"), _result("c2"), _result("c1"), *USER, _calls("c3"), _result("c3")]
    assert client.chat.completions.create(model="m", messages=messages, max_tokens=1).choices


def test_a_responses_reply_hides_its_leading_whitespace_from_stops_and_inherits_no_seed(inproc):
    """A /v1/responses reply after a fresh "Assistant:" hides its leading whitespace (as chat's),
    so the "\\n\\n" turn stop must not match inside it: its runs get SamplingParams.hidden_lead. An
    input ending with the assistant's message is continued (its whitespace is text): no hidden
    lead, also on a fork of a response that had one (the flag is stored with the task, explicit)."""
    url, engine = inproc
    seen: list[SamplingParams] = []
    submit = engine.submit

    def spy(prompt, params=None, **kw):
        seen.append(params)
        return submit(prompt, params, **kw)

    engine.submit = spy
    try:
        def create(inp, **extra) -> dict:
            r = httpx.post(url + "/v1/responses", json={"model": "m", "input": inp, "max_output_tokens": 2,
                                                        "seed": 1, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        fresh = create("Hello")
        continued = create([*USER, {"role": "assistant", "content": "Sure, here"}], previous_response_id=fresh["id"])
        again = create("And now?", previous_response_id=continued["id"])
        create("No seed now.", previous_response_id=again["id"], seed=None)
    finally:
        engine.submit = submit
    assert [p.hidden_lead for p in seen] == [True, False, True, True]
    assert all(p.stop == ("\n\n",) for p in seen)
    # nothing is inherited from the previous response: a request without a seed samples afresh
    assert [p.seed for p in seen] == [1, 1, 1, None]


@pytest.mark.parametrize(
    "field,value,says",
    [("name", 5, "'name' must be"), ("name", "has space", "'name' must be"), ("name", "n" * 65, "'name' must be"),
     ("strict", "yes", "'strict' must be"), ("description", 5, "'description' must be")],
)  # fmt: skip
def test_a_json_schema_formats_fields_are_typed_as_openai_types_them(client, field, value, says):
    """response_format.json_schema's name (1 to 64 of [A-Za-z0-9_-]), strict (a boolean) and
    description (text): anything else is a 400 naming response_format, with nothing started; the
    valid forms (and no name at all) answer."""
    fmt = {"type": "json_schema", "json_schema": {"name": "ok-name_1", "schema": {"type": "object"}}}
    bad = {"type": "json_schema", "json_schema": {**fmt["json_schema"], field: value}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=USER, max_tokens=2, response_format=bad)
    assert e.value.body["param"] == "response_format" and says in e.value.body["message"]
    good = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": True, "description": "d"}}
    for f in (fmt, good):
        r = client.chat.completions.create(model="any", messages=USER, max_tokens=2, response_format=f)
        assert r.choices[0].finish_reason in ("length", "stop")
